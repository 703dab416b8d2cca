"""mtp-engine: multi-token-prediction speculative decoding for Qwen3.5 GGUF models on MLX."""
import sys

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

# Module paths before the package layout of 2026-12-04 (and `spec`, the old name of `speculative`)
# keep importing, for one release, as the modules that moved: one module object under both names.
# (`generate` is left out: importing a submodule sets the package attribute, the API's function.)
_MOVED = {"bpe": "tokenizer.bpe", "tokenizer_gguf": "tokenizer.from_gguf", "tokenizer_hf": "tokenizer.from_hf",
          "detokenizer": "tokenizer.detokenizer", "prompt_encode": "tokenizer.bounded",
          "chat_template": "chat.template", "template_budget": "chat.budget", "template_hooks": "chat.hooks",
          "template_json": "chat.tojson", "tool_calls": "chat.tool_calls", "memory": "model.memory",
          "sampling": "generation.sampling", "penalties": "generation.penalties",
          "prompt_cache": "generation.prompt_cache", "decode": "generation.decode", "profiler": "generation.profiler",
          "costmodel": "speculative.costmodel", "chat_cli": "cli.chat",
          "bench": "cli.bench", "server.main": "cli.serve", "server.flags": "cli.flags",
          "gguf.from_hf": "convert.to_gguf", "gguf.to_hf": "convert.to_hf", "spec": "speculative"}


class _MovedFinder:
    """Finds `mtp_engine.<old path>` as the module now at its new path."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        # first on sys.meta_path, so asked about every import of the process: others leave at once
        prefix = __name__ + "."
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        head = next((old for old in _MOVED if rest == old or rest.startswith(old + ".")), None)
        if head is None:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(name, _MovedLoader(prefix + _MOVED[head] + rest[len(head):]))


class _MovedLoader:
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        import importlib

        module = importlib.import_module(self.new)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.real_spec  # the import system set the alias's: relative imports read it


sys.meta_path.insert(0, _MovedFinder())  # before the path finder, which would load a second copy
