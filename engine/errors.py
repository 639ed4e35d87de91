"""Errors the engine raises on bad input. Each message names what is wrong."""


class EngineError(Exception):
    """Base class: anything the user can fix (bad model, bad prompt, bad parameter)."""


class ModelLoadError(EngineError):
    """A model source that cannot be loaded: missing, truncated, mis-shaped, unsupported."""


class UnsupportedModelError(ModelLoadError):
    """An architecture or config field this engine does not implement."""


class InputError(EngineError):
    """A prompt or a generation parameter the engine refuses."""
