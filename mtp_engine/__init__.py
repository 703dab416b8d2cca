"""mtp-engine: multi-token-prediction speculative decoding for Qwen3.5 GGUF models on MLX."""
from .api import GenerationResult, Model, generate, load, stream_generate
from .errors import MTPEngineError

__all__ = ["generate", "stream_generate", "load", "Model", "GenerationResult", "MTPEngineError"]
__version__ = "0.1.0"
