"""mtp-engine: multi-token-prediction speculative decoding for Qwen3.5 GGUF models on MLX."""
from .api import GenerationResult, Model, batch_generate, generate, load, stream_generate, stream_request
from .constraint import Constraint
from .errors import MTPEngineError
from .generation.prompt_cache import PromptCache
from .generation.sampling import SamplerConfig
from .options import EngineOptions
from .request.request import GenerationRequest
from .speculative.config import SpecConfig
from .version import __version__

__all__ = ["generate", "stream_generate", "stream_request", "batch_generate", "load", "Model", "GenerationResult", "GenerationRequest",
           "MTPEngineError", "EngineOptions", "SpecConfig", "SamplerConfig", "PromptCache", "Constraint", "__version__"]
