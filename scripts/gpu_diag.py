"""Finds which MLX op of the forward pass fails on a backend (diagnostics for new devices)."""
import traceback

import mlx.core as mx


def t(name, f):
    try:
        mx.eval(f())
        print("ok  ", name)
    except Exception as e:
        print("FAIL", name, type(e).__name__, e)


W = mx.random.normal((1024, 512))
for bits in (4, 5, 6, 8):
    q = mx.quantize(W, 32, bits)
    for m in (1, 4):
        x = mx.random.normal((1, m, 512))
        t(f"qmm {bits}b M={m}", lambda: mx.quantized_matmul(x, *q, transpose=True, group_size=32, bits=bits))
    t(f"dequant rows {bits}b", lambda: mx.dequantize(q[0][mx.array([3])], q[1][mx.array([3])], q[2][mx.array([3])], group_size=32, bits=bits))
x = mx.random.normal((1, 5, 2, 128))
t("rms_norm", lambda: mx.fast.rms_norm(x, mx.ones((128,)), 1e-6))
xt = x.transpose(0, 2, 1, 3)
t("rope", lambda: mx.fast.rope(xt, 32, traditional=False, base=1e7, scale=1.0, offset=3))
k = mx.random.normal((1, 1, 9, 128))
t("sdpa causal", lambda: mx.fast.scaled_dot_product_attention(xt, k, k, scale=0.1, mask="causal"))
t("sdpa none s1", lambda: mx.fast.scaled_dot_product_attention(xt[:, :, :1], k, k, scale=0.1, mask=None))
t("argmax 1d", lambda: mx.argmax(mx.random.normal((8192,)), axis=-1))
t("argmax item", lambda: mx.argmax(mx.random.normal((8192,)), axis=-1).item())
try:
    import mtp_engine as me
    m = me.load()
    model = m.model
    c = model.make_cache()
    ids = mx.array([[1, 2, 3]])
    xx = model.embed_tokens(ids)
    t("embed", lambda: xx)
    for i, L in enumerate(model.layers):
        xx = L(xx, c.layers[i])
        t(f"layer {i} {type(L.mixer).__name__}", lambda: xx)
    h = mx.fast.rms_norm(xx, model.output_norm, 1e-6)
    t("lm_head", lambda: model.logits(h))
    t("lm_head row", lambda: model.logits(h[0, -1]))
except Exception:
    traceback.print_exc()
