"""Exception types. Every user-facing error names the field that was wrong."""


class SpecDecError(Exception):
    """Base class of every error this package raises on purpose."""


class FieldError(SpecDecError, ValueError):
    """A value was out of range or of the wrong kind; `field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class InvalidRequestError(FieldError):
    """A request parameter (prompt, max_tokens, temperature, ...) is invalid."""


class ConfigError(FieldError):
    """A model, engine or speculative configuration value is invalid."""


class CapacityError(SpecDecError):
    """No free KV-cache slot: the engine already serves max_batch_size sequences."""


class UnknownSequenceError(FieldError):
    """A request id that the engine does not know (e.g. cancel of a finished request)."""


class ModelLoadError(SpecDecError):
    """A model directory or file is missing, incomplete, or of an unsupported architecture."""
