"""Joining prompts read together: fresh prompts that join a batch in one scheduler pass, read in
one forward per group instead of one forward each.

On a GPU a short prompt's read is mostly the dispatch of an uncompiled forward's operations (a
prefill's shape rarely recurs, so it is not traced: `model.step.traced`); a group of G prompts
padded to its longest, W tokens, dispatches them once. Each row computes exactly what its prompt
computes alone:
  - the delta rule's tokens past a row's length get decay 1 and write strength 0, as the chunked
    form's own padding (`gdn.mix`'s `valid`, set by `BatchCache.begin_rows`): their terms are exact
    zeros, and the row's conv window is taken at its own length;
  - the attention layers, from empty caches, read with the causal mask and the rope offset a
    prompt alone reads with (`BatchCache.joint_start`);
  - a group holds only prompts whose arithmetic alone (the delta rule's chunking, each product's
    path: `Qwen35Model.read_arithmetic`) is the same at the group's length and row count.
Eligible: fresh prompts (no prompt-cache hit: rows at different lengths would need another mask)
of 2 tokens to a chunk, read without a drafter, whose read alone would not run a compiled graph
(the forward of a group is not compiled: its shapes rarely recur). Up to a step's 16 tokens the
delta rule runs token by token, masked as the chunked form; a prompt the fused CUDA kernel steps
alone reads alone (the kernel has no per-row length, so its arithmetic apart is not its own).
Each reader takes its row's caches back (`PromptReader.took`), and a prompt cache's state before
the last token is kept as alone (that token then read alone).
`EngineOptions.joint_read` turns it on (off by default: on a GPU, where it is meant to pay, its rows
compute as alone but its speed is unmeasured; on the CPU a read is its arithmetic, one forward for
eight costs what eight do and every first token waits for the group).
"""
from __future__ import annotations

import traceback

import mlx.core as mx

from ..model.batch_cache import BatchCache
from ..model.qwen35 import Qwen35Model
from .sequence import Sequence

Firsts = list[tuple[Sequence, mx.array]]  # joined sequences and the logits of their first tokens


def read_together(model: Qwen35Model, joining: list[Sequence], chunk: int,
                  joined: list[Sequence]) -> tuple[int, Firsts]:
    """Reads the eligible prompts among `joining` in groups (module docstring), within `chunk`
    padded tokens in all. Returns the tokens run and the logits of the first tokens of the
    sequences whose prompts are now read, which go to `joined`."""
    if not model.options.joint_read:
        return 0, []
    size = {s: len(s.reader.next_ids()) for s in joining
            if s.reader.drafter is None and s.reader.done_tokens == 0 and not s.reader.cached}
    # a prompt whose read alone runs a compiled graph (its shape traced already) is read alone
    fresh = sorted((s for s, n in size.items() if n > 1 and not model.reads_compiled(s.reader.trunk, n)),
                   key=lambda s: -size[s])
    alone = {s: model.read_arithmetic(size[s], size[s]) for s in fresh}  # each prompt's, read by itself
    fresh = [s for s in fresh if alone[s] is not None]  # (None: a mixture of experts, never grouped)
    spent, firsts = 0, []
    while len(fresh) >= 2:
        group = [fresh.pop(0)]
        width = size[group[0]]
        for s in list(fresh):
            trial = group + [s]
            if spent + len(trial) * width > chunk:
                break
            together = model.read_arithmetic(width, len(trial) * width, apart=True)
            if all(alone[x] == together for x in trial):
                group.append(s)
                fresh.remove(s)
        if len(group) > 1:
            try:
                firsts += read_group(model, group, width, joined)
                spent += len(group) * width
            except Exception:  # a bug here must not fail the prompts: each is then read alone
                traceback.print_exc()
    return spent, firsts


def read_group(model: Qwen35Model, group: list[Sequence], width: int, joined: list[Sequence]) -> Firsts:
    """One forward of `group`'s next tokens, each padded to `width`; each reader takes its row's
    caches. Returns the first-token logits of the rows whose prompts are read (a prompt cache's
    keep leaves the last token to its reader), queued on the device."""
    batch = BatchCache(model)
    for s in group:
        batch.add(s.reader.trunk)
    ids = [s.reader.next_ids() for s in group]
    batch.begin_rows([len(r) for r in ids])
    post = model.forward_batch(mx.array([r + [0] * (width - len(r)) for r in ids], mx.int32), batch)
    firsts = []
    for b, (s, r) in enumerate(zip(group, ids)):
        s.reader.took(batch.row(b), post[b:b + 1, len(r) - 1:len(r)])
        if s.reader.done:
            firsts.append((s, model.logits(s.reader.last[0, 0])))
            joined.append(s)
    mx.async_eval(*batch.arrays(), *[logits for _, logits in firsts])
    return firsts
