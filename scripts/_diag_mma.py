import numpy as np, mlx.core as mx
from mtp_engine.model import kernels
np.set_printoptions(linewidth=200, precision=3, suppress=True)
def pack(q, bits):
    vpw = 32 // bits; wq = np.zeros((q.shape[0], q.shape[1] // vpw), np.uint32)
    for v in range(vpw): wq |= q[:, v::vpw].astype(np.uint32) << np.uint32(bits * v)
    return wq
def run(q, s, b, x, bits, group, **kw):
    out = kernels.quantized_rows_mma(mx.array(x), mx.array(pack(q, bits)), mx.array(s), mx.array(b), bits, group, **kw)
    ref = x.astype(np.float64) @ (q * np.repeat(s, group, 1) + np.repeat(b, group, 1)).T
    return np.array(out), ref
N, K = 16, 32
rng = np.random.default_rng(0)
cases = {
  "q=1,s=1,b=0,x=1": (np.ones((N, K)), np.ones((N, 1)), np.zeros((N, 1)), np.ones((8, K))),
  "q=0,s=1,b=1,x=1": (np.zeros((N, K)), np.ones((N, 1)), np.ones((N, 1)), np.ones((8, K))),
  "q=row idx": (np.repeat(np.arange(N)[:, None] % 16, K, 1), np.ones((N, 1)), np.zeros((N, 1)), np.ones((8, K))),
  "x=onehot k": (rng.integers(0, 16, (N, K)), np.ones((N, 1)), np.zeros((N, 1)), np.eye(8, K) ),
  "x=row m": (np.ones((N, K)), np.ones((N, 1)), np.zeros((N, 1)), np.repeat(np.arange(1, 9)[:, None], K, 1)),
}
for name, (q, s, b, x) in cases.items():
    got, ref = run(q.astype(np.uint32), s.astype(np.float32), b.astype(np.float32), x.astype(np.float32), 4, 32, warps=1, unroll=1)
    print(name, "maxdiff", np.abs(got - ref).max()); 
    if np.abs(got - ref).max() > 1e-3: print("got\n", got[:, :16], "\nref\n", ref[:, :16])
for (N, K, M, w, u) in [(16, 32, 8, 1, 1), (16, 64, 8, 1, 1), (16, 128, 8, 1, 4), (16, 128, 8, 4, 1), (32, 128, 3, 4, 4), (512, 1024, 3, 4, 4)]:
    q = rng.integers(0, 16, (N, K)).astype(np.uint32); s = rng.normal(size=(N, K // 32)).astype(np.float32)
    b = rng.normal(size=(N, K // 32)).astype(np.float32); x = rng.normal(size=(M, K)).astype(np.float32)
    got, ref = run(q, s, b, x, 4, 32, warps=w, unroll=u)
    print(N, K, M, w, u, "rel", np.abs(got - ref).max() / np.abs(ref).max())
    q2 = q.copy(); s2 = np.ones_like(s); b2 = np.zeros_like(b)
    got, ref = run(q2, s2, b2, x, 4, 32, warps=w, unroll=u); print("  s=1,b=0 rel", np.abs(got - ref).max() / np.abs(ref).max())
    got, ref = run(q2, s, b2, x, 4, 32, warps=w, unroll=u); print("  b=0 rel", np.abs(got - ref).max() / np.abs(ref).max())
    got, ref = run(q2, s2, b2, np.abs(x), 4, 32, warps=w, unroll=u); print("  s=1,b=0,x>0 rel", np.abs(got - ref).max() / np.abs(ref).max())
