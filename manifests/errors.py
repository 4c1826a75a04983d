class ManifestError(ValueError):
    """A config, variant, manifest or contract that fails validation. The message says what and why."""
