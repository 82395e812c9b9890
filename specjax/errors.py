"""Exception types of specjax.

Every error a user can cause (bad model path, bad prompt, bad sampling settings, ...) is a
:class:`SpecjaxError`; the CLI prints its message as one line and exits with code 2. Anything
else is an internal failure (exit code 1).
"""


class SpecjaxError(Exception):
    """Base class of errors caused by bad input (CLI exit code 2)."""


class ModelLoadError(SpecjaxError):
    """The model path is missing, corrupt, or holds an unsupported architecture."""


class InvalidPromptError(SpecjaxError, ValueError):
    """A prompt is empty or does not fit in the model's context."""


class InvalidSamplingError(SpecjaxError, ValueError):
    """Sampling settings are out of range (temperature, top-k, top-p, max_new_tokens, ...)."""


class DrafterError(SpecjaxError):
    """A drafter is unknown, missing, or does not fit the target."""


def short_repr(v, limit: int = 80) -> str:
    """A short repr of a user's value for an error line (any depth, any size)."""
    try:
        text = repr(v) if not isinstance(v, (list, dict)) or len(v) < 64 else f"<a {type(v).__name__}>"
    except (RecursionError, ValueError):
        text = f"<a {type(v).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
