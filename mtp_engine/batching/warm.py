"""MLX's modules a model's first long prompt and a server's first batched steps need, compiled
ahead while the model loads (`model.kernels.mlx_jit` recipes run in its worker processes).

A prompt longer than the delta-net kernel's 16 tokens takes MLX's own path (the chunked delta rule,
the masked attention, MLX's quantized or dequantized products); a batch's rounds add their row
bookkeeping and sampler. On a fresh
H100 a server's first batched step compiled 22 such modules one after another (48.6 s). Each recipe
here runs the real code on the model's miniature (`model.miniature`: the same graphs and constants,
a few layers deep), so the modules it compiles are those the model will ask for. A whole run
compiles its ~30 modules one after another in one worker, longer than a first long prompt waits
for them; so a prompt's pieces come first, each its own recipe (a delta-net layer, an attention
layer, a feed-forward, the output layer, at both product paths), compiled side by side by the
workers, and the whole runs after them take what the pieces compiled (`mlx_jit.share_modules`)
and compile what is left. A module a worker has moved into the cache folder is read, not
compiled, by a first use that meets it later; one that meets it earlier compiles it as it always
did.
"""
from __future__ import annotations

import os

import mlx.core as mx

from ..generation.decode import PlainDecoder
from ..generation.sampling import Sampler, SamplerConfig
from ..model.loaded import Model
from ..model.loader import LoadInfo
from ..model.layers import rms_norm
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


def jit_part(hexpath: str, part: str, n: str) -> list:
    """One piece of a prompt of `n` tokens through the miniature: "delta" or "attention", the first
    layer of that mixer on its own cache; "mlp", a feed-forward; "head", the output norm and layer."""
    model = miniature(_path(hexpath))
    cfg = model.cfg
    x = model.embed_tokens(mx.array([_ids(int(n))]))
    if part == "head":
        return [model.logits(rms_norm(x, model.output_norm, cfg.eps)[:, -1:])]
    if part == "mlp":
        layer = model.layers[0]
        return [layer.mlp(rms_norm(x, layer.post_norm, cfg.eps))]
    i = cfg.recurrent.index(part == "delta")
    layer, cache = model.layers[i], model.make_cache()
    return [layer.mixer(rms_norm(x, layer.attn_norm, cfg.eps), cache.layers[i]), *cache.layers[i].arrays()]


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


# (phase, recipe) per model file, after the first generations' own (phases 0-2): a prompt's pieces
# at both product paths (3), then five runs that between them compile every graph the nine runs of
# a long prompt alone and a batch of one or two (plain or draft-mtp; prompts of 5, 40 and 300
# tokens) compile (on this CPU: 41 graphs, each run ~30 of them), the likeliest first (5: after the
# sampler's, which a first sampled round meets sooner)
def recipes(path: str) -> list[tuple[int, str]]:
    """The recipes for the GGUF model at `path`."""
    p, m = recipe_path(path), __name__
    parts = [(3, f"{m}:jit_part:{p},{part},{n}") for n in (LONG, MEDIUM) for part in ("delta", "attention", "mlp")]
    return [*parts, (3, f"{m}:jit_part:{p},head,{LONG}"),
            (5, f"{m}:jit_prompt:{p},draft-mtp,{MEDIUM}"), (5, f"{m}:jit_batch:{p},none,{SHORT}+{SHORT}"),
            (5, f"{m}:jit_prompt:{p},none,{LONG}"), (5, f"{m}:jit_batch:{p},draft-mtp,{MEDIUM}+{SHORT}"),
            (5, f"{m}:jit_batch:{p},none,{SHORT}")]
