import numpy as np, mlx.core as mx
from mtp_engine.model import kernels
src = r"""
    const int lane = threadIdx.x & 31;
    unsigned qa = mtp_q(0x00010001u);
    out[lane * 8 + 0] = __uint_as_float(qa << 16);
    out[lane * 8 + 1] = __uint_as_float(qa & 0xffff0000u);
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    mtp_mma(c, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u);
    out[lane * 8 + 2] = c[0];
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mtp_mma(d, qa, qa, qa, qa, 0x3F803F80u, 0x3F803F80u);
    out[lane * 8 + 3] = d[0];
    float e[4] = {0.f, 0.f, 0.f, 0.f};
    mtp_mma_x(e, qa, qa, qa, qa, 1.0f, 1.0f, 1.0f, 1.0f);
    out[lane * 8 + 4] = e[0];
    out[lane * 8 + 5] = dummy[0];
"""
k = mx.fast.cuda_kernel(name="diag_mma", input_names=["dummy"], output_names=["out"], source=src, header=kernels._MMA_HEADER)
o = k(inputs=[mx.ones((4,))], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(256,)], output_dtypes=[mx.float32], verbose=True)[0]
print(np.array(o).reshape(32, 8)[:4])
