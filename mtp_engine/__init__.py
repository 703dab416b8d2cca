"""mtp-engine: multi-token-prediction speculative decoding for Qwen3.5 GGUF models on MLX."""
from .api import GenerationResult, Model, generate, load, stream_generate
from .errors import MTPEngineError
from .sampling import SamplerConfig
from .speculative.config import SpecConfig

__all__ = ["generate", "stream_generate", "load", "Model", "GenerationResult", "MTPEngineError", "SpecConfig",
           "SamplerConfig"]
__version__ = "0.1.0"
