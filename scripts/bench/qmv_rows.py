"""Few-row quantized products on the GPU: the CUDA-core kernel, the tensor-core kernel (in several
block shapes) and MLX's `quantized_matmul`, checked against each other and timed per row count.

    python scripts/bench/qmv_rows.py [--shapes 24576x4096,4096x12288] [--rows 1,2,4,8] [--repeats 5]

Each timed product reads a different copy of the weight (more bytes than the L2 holds); the
effective bandwidth counts weights, scales and biases. The products of one timing are independent,
so a CUDA graph may overlap them, which flatters kernels that leave the GPU half idle (a decode
step's products depend on each other). `--in-model` times what a step sees instead: whole 9B-shape
forwards of S rows, queued back to back, under each tensor-core block shape (`--batched`: and a
batch's steps and verifies of B rows x T tokens; `--resident`: one-token steps with the KV offsets
kept on the device). `--rows-equal` asks
where a batch's rows stop computing what the same sequence computes alone: B identical sequences
in a `BatchCache` against one in its own cache, step by step, per kernel setting, and MLX's own
product at 1 row against B.
"""
from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from mtp_engine.model import kernels
from mtp_engine.model.step import StepGraphs


def check(bits: int, group: int, rows: int, n: int = 512, k: int = 1024, split: int = kernels.mma.SPLIT) -> float:
    w = mx.random.normal((n, k), key=mx.random.key(bits + group))
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    x = mx.random.normal((rows, k), key=mx.random.key(rows)) * 3.0
    ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group, bits=bits)
    got = kernels.mma.quantized_rows(x, q, s, b, bits, group, split=split)
    alone = kernels.mma.quantized_rows(x[:1], q, s, b, bits, group, split=split)
    if not mx.array_equal(alone[0], got[0]).item():
        print(f"ROW-DEPENDENT bits={bits} group={group} rows={rows}: row 0 differs from row 0 alone")
    return float((mx.abs(got - ref).max() / mx.abs(ref).max()).item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="24576x4096,4096x12288,8192x4096,248320x4096")
    ap.add_argument("--rows", default="1,2,3,4,5,8,16,32")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="4x2x3,4x1x4,2x4x3,8x1x3",
                    help="tensor-core block shapes: warps x tiles x stages [x bf16 parts of x]; --in-model: "
                         "every row count on that kernel, one row included, beside `base` (one row on the CUDA cores)")
    ap.add_argument("--in-model", action="store_true", help="time 9B-shape forwards per block shape")
    ap.add_argument("--resident", action="store_true",
                    help="--in-model: also one-token steps on a sequence's cache with device-held offsets (`R1`: "
                         "Pass.ROUND_STEP, as every decoder's plain rounds run) beside S=1 (host offsets, as a plain step ran "
                         "before the one round)")
    ap.add_argument("--batched", default="",
                    help="--in-model: also batched steps of B rows x T tokens (a BatchCache, compiled), as BxT "
                         "(e.g. 1x1,4x1,8x1,4x5)")
    ap.add_argument("--check-only", action="store_true", help="only the precision checks")
    ap.add_argument("--rows-equal", action="store_true",
                    help="batch rows against the sequence alone (8-layer 9B shape), per kernel setting")
    ap.add_argument("--gdn", action="store_true",
                    help="--rows-equal: each stage of a delta-net mixer on B copies of one row against the row alone")
    ap.add_argument("--model", default=None, help="--rows-equal: a GGUF file instead of the random 9B shape")
    ap.add_argument("--layers", action="store_true",
                    help="--rows-equal: the first step's sub-blocks (mixer, MLP) per layer, batch row 0 against alone")
    ap.add_argument("--kernel-sets", default="custom,mlx,qmv,gdn,attn,norm",
                    help="--rows-equal: the engine's kernel settings to compare under (MTP_ENGINE_QMV's values)")
    a = ap.parse_args()
    if a.in_model:
        return in_model(a)
    if a.rows_equal and a.gdn:
        return rows_gdn(a)
    if a.rows_equal and a.layers:
        return rows_layers(a)
    if a.rows_equal:
        return rows_equal(a)
    for split in (2, 3):
        worst = 0.0
        for bits, group in ((4, 32), (4, 64), (4, 128), (8, 32), (8, 64)):
            for rows in (1, 3, 8):
                e = check(bits, group, rows, split=split)
                worst = max(worst, e)
                if e > 1e-4:
                    print(f"MISMATCH bits={bits} group={group} rows={rows}: max rel err {e:.2e}")
        print(f"tensor-core kernel (x in {split} bf16 parts) vs quantized_matmul: worst max-rel error {worst:.2e}",
              flush=True)
    if a.check_only:
        return

    variants = [tuple(int(v) for v in s.split("x")) for s in a.variants.split(",")]
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = mx.random.normal((n, k), key=mx.random.key(1)) * 0.02
        q, s, b = mx.quantize(w, group_size=a.group, bits=a.bits)
        nbytes = q.nbytes + s.nbytes + b.nbytes
        copies = max(2, int(400e6 // nbytes) + 1)
        weights = [(q + mx.array(i, dtype=q.dtype) * 0, s * 1.0, b * 1.0) for i in range(copies)]
        mx.eval(weights)
        fns = {"mlx": lambda x, q, s, b: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=a.group,
                                                             bits=a.bits),
               "simt": lambda x, q, s, b: kernels.qmv.simt_rows(x, q, s, b, a.bits, a.group)}
        for wv, tm, st, *sp in variants:
            if n % (16 * tm) == 0:
                sp = sp[0] if sp else kernels.mma.SPLIT
                fns[f"tc{wv}x{tm}x{st}x{sp}"] = (lambda wv, tm, st, sp: lambda x, q, s, b: kernels.mma.quantized_rows(
                    x, q, s, b, a.bits, a.group, warps=wv, tiles=tm, stages=st, split=sp))(wv, tm, st, sp)
        # the default tensor-core product over slabs of at most 16 rows (two column tiles, none padded)
        fns["tc-slab16"] = lambda x, q, s, b: mx.concatenate(
            [kernels.mma.quantized_rows(x[i:i + 16], q, s, b, a.bits, a.group) for i in range(0, x.shape[0], 16)])
        print(f"\n{n}x{k} {a.bits}-bit g{a.group}: {nbytes / 1e6:.1f} MB per copy, {copies} copies; "
              "us per product (GB/s)", flush=True)
        print("rows " + "".join(f"{name:>18}" for name in fns))
        for rows in (int(r) for r in a.rows.split(",")):
            x = mx.random.normal((rows, k), key=mx.random.key(7))
            # the SIMT kernel takes at most its largest row variant
            live = {name: f for name, f in fns.items()
                    if name != "simt" or rows <= max(kernels.qmv.ROW_VARIANTS)}
            times: dict[str, list[float]] = {name: [] for name in live}
            for name, f in live.items():  # warm-up (compiles)
                mx.eval([f(x, *wt) for wt in weights[:2]])
            for _ in range(a.repeats):
                for name, f in live.items():
                    outs = [f(x, *wt) for _ in range(2) for wt in weights]  # graph built untimed
                    mx.synchronize()
                    t0 = time.perf_counter()
                    mx.eval(outs)
                    mx.synchronize()
                    times[name].append((time.perf_counter() - t0) / (2 * copies))
            cells = []
            for name in fns:
                if name not in live:
                    cells.append(f"{'-':>18}")
                    continue
                t = statistics.median(times[name])
                cells.append(f"{t * 1e6:8.1f} ({nbytes / t / 1e9:5.0f})")
            print(f"{rows:>4} " + "".join(f"{c:>18}" for c in cells), flush=True)


def in_model(a) -> None:
    """ms per forward of S rows (queued 20 at a time, medians of interleaved repeats) at the 9B
    shape, per tensor-core block shape, and with every product of several rows on the CUDA cores."""
    from harness import config_9b, random_model
    model = random_model(config_9b(False))
    model.compile_steps = True
    original, supports = kernels.mma.quantized_rows, kernels.mma.supports
    variants = ["simt", "base"] + a.variants.split(",")
    graphs: dict = {}

    def select(v: str) -> None:
        kernels.mma.supports, kernels.mma.quantized_rows, kernels.qmv.TENSOR_CORE_ROWS = supports, original, 2
        if v == "simt":
            kernels.mma.supports = lambda *args: False
        elif v != "base":
            wv, tm, st, *sp = (int(x) for x in v.split("x"))
            kernels.qmv.TENSOR_CORE_ROWS = 1
            kernels.mma.quantized_rows = lambda *args, split=kernels.mma.SPLIT: original(
                *args, warps=wv, tiles=tm, stages=st, split=sp[0] if sp else split)
        for owner in (model, model.mtp):  # each variant keeps its own traced graphs
            owner.graphs = graphs.setdefault((id(owner), v), StepGraphs())

    def primed():
        """A sequence's cache after a 64-token prompt."""
        cache = model.make_cache()
        mx.eval(model.forward(mx.array([list(range(100, 164))]), cache), *cache.arrays())
        return cache

    def forwards(shape, n: int) -> float:
        if shape == "R1":
            return resident(n)
        if isinstance(shape, tuple):
            return batched(*shape, n)
        cache = primed()
        ids = mx.array([list(range(7, 7 + shape))])
        outs = []
        t0 = time.perf_counter()
        for _ in range(n):
            h = model.forward(ids, cache)
            outs.append(mx.argmax(model.logits(h[0]), axis=-1))
            mx.async_eval(outs[-1], *cache.arrays())
        mx.eval(outs)
        return (time.perf_counter() - t0) / n * 1e3

    def resident(n: int) -> float:
        """One-token steps fed their own argmax, on a cache whose KV offsets stay on the device."""
        from mtp_engine.model.step import Pass
        cache = primed()
        cache.kv_to_device()
        tok = mx.array([7], mx.int32)
        outs = []
        t0 = time.perf_counter()
        for _ in range(n):
            post = model.forward_states(tok[:, None], cache, Pass.ROUND_STEP).post
            tok = mx.argmax(model.logits(post[:, -1]), axis=-1).astype(mx.int32)
            outs.append(tok)
            mx.async_eval(tok, *cache.arrays())
        mx.eval(outs)
        return (time.perf_counter() - t0) / n * 1e3

    def batched(b: int, t: int, n: int) -> float:
        """A batch's step (t = 1) or verify (t > 1, captured and rolled back to one token) of b
        rows at a 64-token prompt each, queued n times."""
        from mtp_engine.model.batch_cache import BatchCache
        from mtp_engine.model.step import Pass
        batch = BatchCache(model, tail=model.kv_tail)
        for _ in range(b):
            batch.add(primed())
        ids = mx.array([list(range(7, 7 + t))] * b)
        outs = []
        t0 = time.perf_counter()
        for _ in range(n):
            post = model.forward_states(ids, batch, Pass.ROUND_VERIFY if t > 1 else Pass.ROUND_STEP).post
            if t > 1:
                batch.rollback_lazy(mx.full((b,), 1, mx.int32))
            outs.append(mx.argmax(model.logits(post[:, -1]), axis=-1))
            mx.async_eval(outs[-1], *batch.arrays())
        mx.eval(outs)
        return (time.perf_counter() - t0) / n * 1e3

    rows = [int(r) for r in a.rows.split(",")] + (["R1"] if a.resident else []) + \
        [tuple(int(x) for x in bt.split("x")) for bt in a.batched.split(",") if bt]
    times = {(v, s): [] for v in variants for s in rows}
    for v in variants:  # trace and compile each shape
        select(v)
        for s in rows:
            forwards(s, 2)
    for _ in range(a.repeats):
        for v in variants:
            select(v)
            for s in rows:
                forwards(s, 2)
                times[(v, s)].append(forwards(s, 20))
    print("ms per forward of S rows of one sequence, or of a batch's B rows x T tokens (9B shape), medians of",
          a.repeats, flush=True)
    name = lambda s: f"B{s[0]}xT{s[1]}" if isinstance(s, tuple) else s if s == "R1" else f"S={s}"  # noqa: E731
    print("variant " + "".join(f"{name(s):>9}" for s in rows))
    for v in variants:
        print(f"{v:>7} " + "".join(f"{statistics.median(times[(v, s)]):9.2f}" for s in rows), flush=True)


def rows_equal(a) -> None:
    """Per kernel setting and batch size B: the first decode step at which a batch's row 0 (B copies
    of one sequence) differs from the sequence alone, and the largest difference in its post-norm
    hidden state and logits over the steps (0: the same bits)."""
    from harness import config_9b, random_model

    from mtp_engine.model.step import Pass

    model = random_model(config_9b(True))
    prompt = [(7 * i) % 8000 + 100 for i in range(40)]
    batches = [int(r) for r in a.rows.split(",") if int(r) > 1]
    x = mx.random.normal((max(batches), 4096), key=mx.random.key(3))
    q, sc, bi = mx.quantize(mx.random.normal((4096, 4096), key=mx.random.key(4)) * 0.02, group_size=32, bits=4)
    for b in batches:  # MLX's own quantized product: one row against row 0 of B
        one, many = (mx.quantized_matmul(x[:r], q, sc, bi, transpose=True, group_size=32, bits=4) for r in (1, b))
        print(f"mx.quantized_matmul 1 row vs row 0 of {b}: max abs diff {float(mx.abs(one[0] - many[0]).max()):.3e}",
              flush=True)

    for setting in a.kernel_sets.split(","):
        model.use(model.options.updated(kernels=setting))
        for b in batches:
            alone, batch = _alone_and_batch(model, prompt, b)
            tok, first, worst_h, worst_l = prompt[-1], None, 0.0, 0.0
            for step in range(a.repeats * 4):
                h1 = model.forward_states(mx.array([[tok]]), alone, Pass.STEP).post[0, -1]
                hb = model.forward_states(mx.array([[tok]] * b), batch, Pass.ROUND_STEP).post[:, -1]
                l1, lb = model.logits(h1), model.logits(hb)
                dh, dl = float(mx.abs(hb - h1).max()), float(mx.abs(lb - l1).max())
                if first is None and (dh or dl):
                    first = step
                worst_h, worst_l = max(worst_h, dh), max(worst_l, dl)
                tok = int(mx.argmax(l1).item())
            print(f"kernels={setting:<7} B={b:<3} first differing step: {first}, max |dh| {worst_h:.3e}, "
                  f"max |dlogits| {worst_l:.3e}", flush=True)


def _alone_and_batch(model, prompt: list[int], b: int):
    """The prompt but its last token in a sequence's own caches, and in a batch of b copies of them."""
    from mtp_engine.model.batch_cache import BatchCache
    from mtp_engine.model.step import Pass

    def prefilled(cache):
        mx.eval(model.forward_states(mx.array([prompt[:-1]]), cache, Pass.PREFILL).post, *cache.arrays())
        return cache

    batch = BatchCache(model)
    for _ in range(b):
        batch.add(prefilled(model.make_cache()))
    return prefilled(model.make_cache()), batch


def _probe_model(a):
    if a.model:
        from mtp_engine import load
        return load(a.model).model
    from harness import config_9b, random_model
    return random_model(config_9b(True))


def rows_gdn(a) -> None:
    """Each stage of the first delta-net mixer (its input products, the conv and gates, one
    delta-rule step fused and as separate operations, the gated norm, the output product) run on
    B copies of one row and on the row alone, from the same inputs: the largest difference of row
    0 per stage and kernel setting (0: the same bits). A stage that differs here is one whose
    arithmetic depends on the row count."""
    from mtp_engine.model import gdn
    from mtp_engine.model.cache import RecurrentCache
    from mtp_engine.model.delta_rule import delta_rule_step, delta_rule_step_ops

    model = _probe_model(a)
    layer = next(l.mixer for l in model.layers if hasattr(l.mixer, "conv_w"))
    c = model.cfg
    d = gdn.Dims(c.ssm_key_heads, c.ssm_key_dim, c.ssm_value_heads, c.ssm_value_dim, c.conv_kernel, c.eps)
    x = mx.random.normal((1, 1, c.hidden_size), key=mx.random.key(1))
    conv0 = mx.random.normal((1, d.kernel - 1, c.conv_channels), key=mx.random.key(2)) * 0.5
    state0 = mx.random.normal((1, d.vh, d.kd, d.vd), key=mx.random.key(3)) * 0.1

    def stages(x, conv0, state0):
        """Each stage's output, and the later stages' inputs ((q, k, v, g, beta), z_x)."""
        qkv_x, z_x, alpha_x, beta_x = layer._inputs(x)
        window = mx.concatenate([conv0, qkv_x], axis=1)
        q, k, v, g, beta = gdn._prepare(d.kh, d.kd, d.vh, d.vd, d.kernel, d.eps)(
            window, layer.conv_w, alpha_x, beta_x, layer.dt_bias, layer.a)
        return {"input products": qkv_x, "conv and gates": q, "gates g": g,
                "step (fused)": delta_rule_step(state0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])[1],
                "step (ops)": delta_rule_step_ops(state0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])[1]}, \
            (q, k, v, g, beta), z_x

    def isolated(b):
        """Every stage from the alone row's inputs, broadcast to b rows."""
        rep = lambda t: mx.concatenate([t] * b)  # noqa: E731
        one, (q, k, v, g, beta), z_x = stages(x, conv0, state0)
        o1 = one["step (fused)"]
        y1 = gdn._output(o1[:, None], z_x.reshape(1, 1, d.vh, d.vd), layer.norm, d.eps).reshape(1, 1, -1)
        one.update({"gated norm": y1, "output product": layer.out(y1)})
        many = stages(rep(x), rep(conv0), rep(state0))[0]
        many["step (fused)"] = delta_rule_step(rep(state0), rep(q[:, 0]), rep(k[:, 0]), rep(v[:, 0]), rep(g[:, 0]),
                                               rep(beta[:, 0]))[1]
        many["step (ops)"] = delta_rule_step_ops(rep(state0), rep(q[:, 0]), rep(k[:, 0]), rep(v[:, 0]),
                                                 rep(g[:, 0]), rep(beta[:, 0]))[1]
        many["gated norm"] = gdn._output(rep(o1)[:, None], rep(z_x).reshape(b, 1, d.vh, d.vd), layer.norm,
                                         d.eps).reshape(b, 1, -1)
        many["output product"] = layer.out(rep(y1))
        # the whole mixer as a step runs it (the fused CUDA layer where the setting has it)
        one["whole mixer"] = layer(x, RecurrentCache.holding(d.kernel, conv0, state0))
        many["whole mixer"] = layer(rep(x), RecurrentCache.holding(d.kernel, rep(conv0), rep(state0)))
        return {name: float(mx.abs(many[name][0].astype(mx.float32) - one[name][0].astype(mx.float32)).max())
                for name in one}

    for setting in a.kernel_sets.split(","):
        model.use(model.options.updated(kernels=setting))
        layer = next(l.mixer for l in model.layers if hasattr(l.mixer, "conv_w"))
        for b in [int(r) for r in a.rows.split(",") if int(r) > 1]:
            diffs = isolated(b)
            print(f"kernels={setting:<7} B={b:<3} " + "; ".join(f"{n} {v:.1e}" for n, v in diffs.items()), flush=True)


def rows_layers(a) -> None:
    """Where inside a step a batch's row 0 first leaves the sequence alone: per layer, the largest
    difference of the mixer's input and output and the MLP's input and output (eager, uncompiled
    forwards, so each sub-block's output is seen). The first sub-block whose output differs while
    its input does not is the one whose arithmetic depends on the row count."""
    from harness import config_9b, random_model

    from mtp_engine.model import blocks
    from mtp_engine.model.step import Pass

    model = random_model(config_9b(True))
    model.compile_steps = False
    prompt = [(7 * i) % 8000 + 100 for i in range(40)]
    seen: list[tuple[str, int, mx.array]] = []

    def recording(layer, i, part):
        inner = getattr(layer, part)

        def call(x, *rest):
            out = inner(x, *rest)
            seen.append((part, i, x, out))
            return out
        return call

    real = blocks.run_layers

    def run_layers(layers, x, caches, final_norm, eps, fused_norm=False):
        class Spy:
            def __init__(self, layer, i):
                self._l, self.mixer, self.mlp = layer, recording(layer, i, "mixer"), recording(layer, i, "mlp")

            def __getattr__(self, name):
                return getattr(self._l, name)
        return real([Spy(layer, i) for i, layer in enumerate(layers)], x, caches, final_norm, eps, fused_norm)

    blocks.run_layers = run_layers
    import mtp_engine.model.qwen35 as qwen35
    qwen35.run_layers = run_layers

    batches = [int(r) for r in a.rows.split(",") if int(r) > 1]
    for setting in a.kernel_sets.split(","):
        model.use(model.options.updated(kernels=setting))
        for b in batches:
            alone, batch = _alone_and_batch(model, prompt, b)
            tok = prompt[-1]
            seen.clear()
            mx.eval(model.forward_states(mx.array([[tok]]), alone, Pass.ROUND_STEP).post)
            one = list(seen)
            seen.clear()
            mx.eval(model.forward_states(mx.array([[tok]] * b), batch, Pass.ROUND_STEP).post)
            many = list(seen)
            cells = []
            for (part, i, x1, o1), (_, _, xb, ob) in zip(one, many):
                dx, do = float(mx.abs(xb[0] - x1[0]).max()), float(mx.abs(ob[0] - o1[0]).max())
                cells.append(f"L{i}.{part} in {dx:.1e} out {do:.1e}")
            first = next((c for c, (p1, pb) in zip(cells, zip(one, many))
                          if float(mx.abs(pb[3][0] - p1[3][0]).max()) > 0), "none")
            print(f"kernels={setting:<7} B={b:<3} first sub-block differing: {first}", flush=True)
            print("   " + "; ".join(cells[:12]), flush=True)


if __name__ == "__main__":
    main()
