"""Checks MLX's gathered quantized matmul (the MoE expert path) on the current device against a
dense reference: 4-bit / 8-bit group-32 experts, decode and verify-sized batches."""
import mlx.core as mx
import numpy as np

for bits in (4, 8):
    E, out, inn = 16, 256, 512
    W = mx.random.normal((E, out, inn)) * 0.05
    wq, sc, bi = mx.quantize(W.reshape(E * out, inn), 32, bits)
    wq, sc, bi = (a.reshape(E, out, -1) for a in (wq, sc, bi))
    deq = mx.dequantize(wq.reshape(E * out, -1), sc.reshape(E * out, -1), bi.reshape(E * out, -1), 32, bits).reshape(E, out, inn)
    for rows, k in ((1, 4), (4, 4), (40, 4)):
        x = mx.random.normal((rows, 1, 1, inn))
        idx = mx.random.randint(0, E, (rows, k))
        y = mx.gather_qmm(x, wq, sc, bi, rhs_indices=idx, transpose=True, group_size=32, bits=bits)
        ref = np.einsum("ri,rkoi->rko", np.array(x.reshape(rows, inn)), np.array(deq)[np.array(idx)])
        err = np.abs(np.array(y).reshape(rows, k, out) - ref).max()
        print(f"{mx.default_device()} bits {bits} rows {rows} top-{k}: max err {err:.2e}", "ok" if err < 1e-3 else "FAIL")
