"""Graph nodes (MLX primitives, i.e. kernels to encode on the host) of one plain step and of one
device-resident round per draft length, by primitive: where the host's per-node cost goes.

MLX's CUDA backend records every node into a CUDA graph on the host (~8-10 us each on the H200),
so a round's host time is about its node count times that; this script says which parts of a
round own the nodes.

Usage: python3 scripts/round_nodes.py [--small] [--ks 1,3] [--tiny]
(GPU: the 9B shape with random 4-bit weights; --tiny: 32 layers at tiny widths, for the CPU.)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_9b_oracle import config_9b, decode_tps, random_model  # noqa: E402
from mtp_engine.model.config import Qwen35Config  # noqa: E402
from mtp_engine.speculative import resident  # noqa: E402


def tiny_config(n: int = 32) -> Qwen35Config:
    return Qwen35Config(vocab_size=2048, hidden_size=128, n_layer=n, n_mtp=1, ffn_size=[256] * (n + 1),
                        n_head=4, n_head_kv=2, head_dim=32, n_rot=16, rope_base=1e7, eps=1e-6, conv_kernel=4,
                        ssm_key_dim=32, ssm_key_heads=2, ssm_value_heads=4, ssm_inner=128,
                        recurrent=[(i + 1) % 4 != 0 for i in range(n)], context_length=8192)


def nodes(*outs: mx.array) -> collections.Counter:
    """Primitives in the unevaluated graph behind `outs`, by name."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outs)
        text = Path(path).read_text()
    finally:
        os.remove(path)
    return collections.Counter(re.findall(r'label\s*=\s*"([A-Za-z_]+)', text))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="8 layers")
    ap.add_argument("--tiny", action="store_true", help="32 layers at tiny widths (CPU)")
    ap.add_argument("--ks", default="1,3")
    a = ap.parse_args()
    model = random_model(tiny_config() if a.tiny else config_9b(a.small))
    model.compile_steps = True
    seen: list[tuple[int, collections.Counter]] = []
    orig = resident.ResidentRounds._queue

    def queue(self, r):
        b = self.drafter.block
        seen.append((r.k, nodes(*r.read(), b.tokens, b.hidden)))
        return orig(self, r)

    resident.ResidentRounds._queue = queue
    prompt = list(range(100, 164))
    out = {"device": str(mx.default_device()), "layers": model.cfg.n_layer}
    for k in [0] + [int(x) for x in a.ks.split(",")]:
        seen.clear()
        decode_tps(model, prompt, 16, "draft-mtp", k, 0.8)
        counts = [c for kk, c in seen if kk == k][-1]  # a steady round (the first ones carry catch-up)
        out[f"k{k}"] = {"nodes": sum(counts.values()), "top": counts.most_common(12)}
        print(json.dumps({f"k{k}": out[f"k{k}"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
