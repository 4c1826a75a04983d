class SetupError(Exception):
    """Usage or setup problem (unknown family/variant, invalid config, bad checkpoint or case directory).
    fvparity prints it as one line and exits 2."""


class UpstreamConversionFailed(Exception):
    """A golden case's upstream checkpoint that fvconvert's manifests refuse: a failure of what is checked (a
    converter / manifest bug), so `fvparity golden` reports it as that case's failed check and goes on (not exit 2)."""
