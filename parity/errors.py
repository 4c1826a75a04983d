class SetupError(Exception):
    """Usage or setup problem (unknown family/variant, invalid config, bad checkpoint or case directory).
    fvparity prints it as one line and exits 2."""
