"""Where a decode step's time goes (issue 7): each part of one plain step timed on its own, on the
loaded model and the current device, against the measured whole step.

Parts: every matrix product (grouped: attention/GDN projections, FFN, output head), the rest of
each mixer (norms, rope, attention, conv, the delta rule, gates) and of each FFN, the embedding
lookup. Each part is run 30 times independently inside one evaluation, so its figure is its own
cost without per-evaluation overhead; "dispatch and the rest" is the whole step minus the parts.

Usage: python scripts/step_breakdown.py [-m MODEL.gguf] [--compiled 0|1] [--rows 1,4,8] [--json OUT]
       python scripts/step_breakdown.py --random-9b   (GPU: the 9B shape of bench_gpu.py)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mtp_engine import load  # noqa: E402
from mtp_engine.model.cache import KVCache, RecurrentCache  # noqa: E402
from mtp_engine.model.layers import Linear, rms_norm  # noqa: E402
from mtp_engine.model.qwen35 import GatedAttention  # noqa: E402

REPS = 30


def each_ms(fn) -> float:
    """ms of one call of fn (a lazy MLX computation), from REPS independent calls evaluated together."""
    mx.eval(fn())
    times = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(REPS)])
        times.append((time.perf_counter() - t) / REPS * 1e3)
    return statistics.median(times)


def products(obj) -> list[tuple[str, Linear]]:
    return [(k, v) for k, v in vars(obj).items() if isinstance(v, Linear)]


def breakdown(model, rows: int = 1) -> dict:
    """Parts of a forward of `rows` tokens (1: a plain step; k+1: a verify of k drafts)."""
    c = model.cfg
    x = mx.random.normal((1, rows, c.hidden_size), key=mx.random.key(0)) * 0.1
    parts: dict[str, float] = {}

    def add(name, ms):
        parts[name] = parts.get(name, 0.0) + ms

    for layer in model.layers:
        mixer = layer.mixer
        kind = "attention" if isinstance(mixer, GatedAttention) else "gdn"
        lin_ms = 0.0
        for name, lin in products(mixer):
            inp = x if lin.in_features == c.hidden_size else mx.zeros((1, rows, lin.in_features))
            ms = each_ms(lambda: lin(inp))
            lin_ms += ms
            add(f"{kind} products", ms)

        def mixer_call():
            if isinstance(mixer, GatedAttention):
                cache = KVCache(c.n_head_kv, c.head_dim)
                cache.reserve(256)
                cache.offset = 64
            else:
                cache = RecurrentCache(c.conv_kernel, c.conv_channels, c.ssm_value_heads, c.ssm_key_dim,
                                       c.ssm_value_dim)
            return mixer(rms_norm(x, layer.attn_norm, c.eps), cache)

        rest = "norm, conv, delta rule, gates" if kind == "gdn" else "norms, rope, attention, gate"
        add(f"{kind} rest ({rest})", max(each_ms(mixer_call) - lin_ms, 0.0))
        ffn_lin = 0.0
        for name, lin in products(layer.mlp):
            inp = x if lin.in_features == c.hidden_size else mx.zeros((1, rows, lin.in_features))
            ms = each_ms(lambda: lin(inp))
            ffn_lin += ms
            add("ffn products", ms)
        add("ffn rest (norm, SwiGLU, residuals)",
            max(each_ms(lambda: x + layer.mlp(rms_norm(x, layer.post_norm, c.eps))) - ffn_lin, 0.0))
    add("output head", each_ms(lambda: model.logits(x[0])))
    ids = mx.array([[5] * rows])
    add("embedding lookup", each_ms(lambda: model.embed_tokens(ids)))

    cache = model.make_cache()
    mx.eval(model.forward(mx.array([[1] * 64]), cache), *cache.arrays())
    steps = []
    tok = mx.array([[5] * rows])
    for _ in range(40):
        snap = cache.snapshot()
        t = time.perf_counter()
        h = model.forward(tok, cache, capture=rows > 1)
        mx.eval(mx.argmax(model.logits(h[0]), axis=-1), *cache.arrays())
        steps.append((time.perf_counter() - t) * 1e3)
        cache.restore(snap)
    step = statistics.median(steps[3:])
    accounted = sum(parts.values())
    parts["dispatch and the rest"] = max(step - accounted, 0.0)
    return {"device": str(mx.default_device()), "compiled": model.compile_steps, "rows": rows, "step_ms": step,
            "parts_ms": parts}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="models/qwen35-mtp-code-Q4_K_M.gguf")
    ap.add_argument("--random-9b", action="store_true")
    ap.add_argument("--compiled", choices=["0", "1"], default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="1", help="forward widths, e.g. 1,4,8 (a verify of k drafts is k+1 rows)")
    a = ap.parse_args()
    if a.random_9b:
        from bench_9b_oracle import config_9b, random_model

        model = random_model(config_9b(False))
    else:
        model = load(a.model).model
    if a.compiled is not None:
        model.compile_steps = a.compiled == "1"
    outs = [breakdown(model, int(r)) for r in a.rows.split(",")]
    print(f"{outs[0]['device']}, compiled steps {outs[0]['compiled']}: forward of S rows, ms\n")
    print("| part | " + " | ".join(f"S={o['rows']}" for o in outs) + " |\n|---|" + "---|" * len(outs))
    print("| whole forward | " + " | ".join(f"{o['step_ms']:.2f}" for o in outs) + " |")
    for k in sorted(outs[0]["parts_ms"], key=lambda k: -outs[0]["parts_ms"][k]):
        print(f"| {k} | " + " | ".join(f"{o['parts_ms'].get(k, 0.0):.2f}" for o in outs) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(outs if len(outs) > 1 else outs[0], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
