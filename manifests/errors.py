class ManifestError(ValueError):
    """A config, variant, manifest or contract that fails validation. The message says what and why."""


class RequestFieldError(ManifestError):
    """A generation request refused by its contract; `field` names the request field at fault (the HTTP server
    answers 400 with it as `param`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class CheckpointError(ManifestError):
    """A canonical checkpoint that cannot be read as asked. One line naming the file (and key). (Here, not in
    checkpoint.py, so the layouts checkpoint.py builds on can raise it too.)"""

    def __init__(self, msg: str):
        super().__init__(" ".join(str(msg).split()))


class PipelineError(ValueError):
    """A diffusers pipeline root a family's pipeline layout refuses (the converter reports it as a conversion
    error). Not a ManifestError: a config error inside it is reported with the pipeline's context, once."""
