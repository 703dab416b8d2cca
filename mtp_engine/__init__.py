"""mtp-engine: multi-token-prediction speculative decoding for Qwen3.5 GGUF models on MLX."""
from importlib import metadata as _metadata

from .api import GenerationResult, Model, generate, load, stream_generate
from .constraint import Constraint
from .errors import MTPEngineError
from .options import EngineOptions
from .prompt_cache import PromptCache
from .sampling import SamplerConfig
from .speculative.config import SpecConfig

__all__ = ["generate", "stream_generate", "load", "Model", "GenerationResult", "MTPEngineError", "EngineOptions",
           "SpecConfig", "SamplerConfig", "PromptCache", "Constraint"]

try:  # the installed distribution's version (pyproject.toml), one source of truth
    __version__ = _metadata.version("mtp-engine")
except _metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
