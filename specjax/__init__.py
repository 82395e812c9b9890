"""specjax: lossless speculative decoding in JAX/XLA (CPU, GPU, TPU)."""

import os as _os

# specjax uses transformers for tokenizers only, without torch: its advice that PyTorch was not
# found is noise to a specjax user.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from specjax.errors import (
    DrafterError,
    InvalidPromptError,
    InvalidSamplingError,
    ModelLoadError,
    SpecjaxError,
)
from specjax.generate import GenerationResult, GenerationStats, generate
from specjax.models.config import LlamaConfig
from specjax.models.loading import Model, load_model
from specjax.sampling import SamplingParams

__all__ = [
    "DrafterError",
    "GenerationResult",
    "GenerationStats",
    "InvalidPromptError",
    "InvalidSamplingError",
    "LlamaConfig",
    "Model",
    "ModelLoadError",
    "SamplingParams",
    "SpecjaxError",
    "generate",
    "load_model",
]
__version__ = "0.1.0"
