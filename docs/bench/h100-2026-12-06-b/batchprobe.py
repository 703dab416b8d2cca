"""Where a batch verify's time goes: trunk forwards of B rows x S tokens, alone and batched, compiled.

    PYTHONPATH=scripts/bench python3 docs/bench/h100-2026-12-06-b/batchprobe.py [small] [quick] [slab16]
"""
import statistics, sys, time
import mlx.core as mx
from harness import config_9b, random_model
from mtp_engine.model.batch_cache import BatchCache
from mtp_engine.model.cache import capture_at_width
from mtp_engine.threads import evaluate_all
from mtp_engine.model.step import Pass

SMALL = 'small' in sys.argv
if "slab16" in sys.argv:  # products in slabs of at most 16 rows (2 column tiles) instead of 32
    from mtp_engine.model.kernels import qmv
    qmv.MAX_ROWS = 16
    print("slabs of 16 rows", flush=True)
from harness import smoke_config
m = random_model(smoke_config() if SMALL else config_9b(False))
H = m.cfg.hidden_size
P = [(7 * i) % 8000 + 5 for i in range(64)]


def prefilled():
    c = m.make_cache()
    mx.eval(m.forward(mx.array([P]), c, Pass.PREFILL))
    evaluate_all(c)
    return c


def ms(fn, reps=15):
    for _ in range(4):
        mx.eval(fn())
    t = []
    for _ in range(reps):
        t0 = time.perf_counter(); mx.eval(fn()); t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def batch_of(B):
    """B prefilled rows; their step ids, verify ids and a verify of 5 tokens keeping 1."""
    batch = BatchCache(m)
    for _ in range(B):
        batch.add(prefilled())
    capture_at_width(batch.layers, 5)
    ids1, ids5 = mx.full((B, 1), 5, mx.int32), mx.full((B, 5), 5, mx.int32)
    keep = mx.full((B,), 1, mx.int32)

    def verify():
        h = m.forward_batch(ids5, batch, capture=True)
        batch.rollback_lazy(keep)
        return h
    return batch, ids1, ids5, verify


c = prefilled()
capture_at_width(c.layers, 5)
def alone_verify():
    h = m.forward(mx.array([[5] * 5]), c, Pass.VERIFY)
    c.rollback(1)
    return h
print(f"alone  S=1 {ms(lambda: m.forward(mx.array([[5]]), c)):.2f} ms  S=5 capture {ms(alone_verify):.2f} ms", flush=True)
for B in ((1, 4) if SMALL else (1, 4, 8, 16)):
    batch, ids1, ids5, verify = batch_of(B)
    t1 = ms(lambda: m.forward_batch(ids1, batch))
    t5c = ms(verify)
    t5 = ms(lambda: m.forward_batch(ids5, batch))
    print(f"batch B={B:2d} S=1 {t1:.2f} ms  S=5 capture {t5c:.2f}  S=5 no capture {t5:.2f}", flush=True)
    # products alone: the FFN and mixer inputs of one layer at B and 5B rows
    lay = m.layers[0]
    x1, x5 = mx.random.normal((B, 1, H)), mx.random.normal((B, 5, H))
    f1, f5 = ms(lambda: lay.mlp(x1)), ms(lambda: lay.mlp(x5))
    print(f"         layer0 mlp B rows {f1:.3f} ms, 5B rows {f5:.3f} ms", flush=True)
# which kernel family makes a batch verify expensive: each left out in turn (MLX's path instead)
full = m.options
for B in (() if 'quick' in sys.argv else (4,) if SMALL else (4, 8)):
    for ks in ("qmv,gdn,attn,norm", "gdn,attn,norm", "qmv,attn,norm", "qmv,gdn,norm", "mlx"):
        m.use(full.updated(kernels=ks))
        batch, ids1, ids5, verify = batch_of(B)
        print(f"B={B} kernels {ks:18s} S=1 {ms(lambda: m.forward_batch(ids1, batch)):.2f} ms  S=5 capture {ms(verify):.2f}", flush=True)
m.use(full)
