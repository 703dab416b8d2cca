"""MLX's modules a model's first long prompt and a server's first batched steps need, compiled
ahead while the model loads (`model.kernels.mlx_jit` recipes run in its worker processes).

A prompt longer than the delta-net kernel's 16 tokens takes MLX's own path (the chunked delta rule,
the masked attention, MLX's quantized or dequantized products); a batch's rounds add their row
bookkeeping and sampler. On a fresh
H100 a server's first batched step compiled 22 such modules one after another (48.6 s). Each recipe
here runs the real code on the model's miniature (`model.miniature`: the same graphs and constants,
a few layers deep), so the modules it compiles are those the model will ask for; the recipes are
split so that the workers compile them side by side. A module a worker has moved into the cache
folder is read, not compiled, by a first use that meets it later; one that meets it earlier compiles
it as it always did.
"""
from __future__ import annotations

import os

from ..generation.decode import PlainDecoder
from ..generation.sampling import Sampler, SamplerConfig
from ..model.loaded import Model
from ..model.loader import LoadInfo
from ..model.miniature import VOCAB, miniature
from ..speculative.config import DraftParams
from ..speculative.methods import build_decoder
from .mtp import MTPBatchScheduler
from .scheduler import BatchScheduler
from .sequence import Sequence

LONG = 300  # prompt tokens past the dequantized products' threshold (`EngineOptions.dequant_rows`)
MEDIUM = 40  # past the delta-net kernel's 16 tokens, below that threshold
SHORT = 5
TOKENS = 6  # generated per sequence: a few rounds of each kind


def _ids(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % (VOCAB - 1) + 1 for i in range(n)]


def _path(hexpath: str) -> str:
    return os.fsdecode(bytes.fromhex(hexpath))


def recipe_path(path: str) -> str:
    """A model file's path as a recipe's argument (recipe arguments are split at commas; any name
    the file system allows)."""
    return os.fsencode(str(path)).hex()


def jit_prompt(hexpath: str, spec: str, n: str) -> list:
    """A sequence alone: a prompt of `n` tokens, then a few rounds (`spec` "none" or "draft-mtp")."""
    model = miniature(_path(hexpath))
    sampler = Sampler(SamplerConfig())
    if spec == "none":
        decoder = PlainDecoder(model, sampler)
    else:
        decoder = build_decoder(spec, model, sampler, DraftParams(n_max=2))
    decoder.prefill(_ids(int(n)), budget=TOKENS)
    for _ in range(3):
        decoder.step()
    decoder.finish()
    return []


def jit_batch(hexpath: str, spec: str, lengths: str) -> list:
    """Sequences of the prompt `lengths` ("40+5") decoding together, plain or draft-mtp."""
    path = _path(hexpath)
    model = Model(miniature(path), None, LoadInfo(path), path)
    draft = spec == "draft-mtp"
    sizes = [int(n) for n in lengths.split("+")]
    scheduler = (MTPBatchScheduler if draft else BatchScheduler)(model, len(sizes), own_thread=False)
    seqs = [Sequence(_ids(n, salt=i), Sampler(SamplerConfig()), TOKENS, draft=draft, n_max=2 if draft else None)
            for i, n in enumerate(sizes)]
    for s in seqs:
        scheduler.submit(s)
    scheduler.drive(lambda: all(s.done for s in seqs))
    for s in seqs:  # a failed sequence is cancelled (done) with the error in its queue
        while not s.out.empty():
            item = s.out.get()
            if isinstance(item, BaseException):
                raise item
    return []


# (phase, recipe) per model file, after the first generations' own (phases 0-2): five runs that
# between them compile every graph the nine runs of a long prompt alone and a batch of one or two
# (plain or draft-mtp; prompts of 5, 40 and 300 tokens) compile (on this CPU: 41 graphs, each run
# ~30 of them; a worker links what others finished, `mlx_jit.share_modules`), the likeliest first
def recipes(path: str) -> list[tuple[int, str]]:
    """The recipes for the GGUF model at `path`."""
    p, m = recipe_path(path), __name__
    return [(3, f"{m}:jit_prompt:{p},draft-mtp,{MEDIUM}"), (3, f"{m}:jit_batch:{p},none,{SHORT}+{SHORT}"),
            (3, f"{m}:jit_prompt:{p},none,{LONG}"), (3, f"{m}:jit_batch:{p},draft-mtp,{MEDIUM}+{SHORT}"),
            (3, f"{m}:jit_batch:{p},none,{SHORT}")]
