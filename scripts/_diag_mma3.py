import sys
sys.argv = sys.argv[:1]
import mlx.core as mx
from mtp_engine.model import kernels
import importlib
qr = importlib.import_module("scripts.qmv_rows") if False else None
sys.path.insert(0, "scripts")
import qmv_rows
for bits, group in ((8, 32), (4, 64), (4, 32), (8, 32)):
    print(bits, group, qmv_rows.check(bits, group, 3))
# fresh kernel object per config
for bits, group in ((8, 32), (4, 64)):
    kernels._mma_kernel = mx.fast.cuda_kernel(name=f"mtp_qmv_mma_{bits}_{group}", input_names=["x", "wq", "scales", "biases"],
                                          output_names=["out"], source=kernels._MMA_SOURCE, header=kernels._MMA_HEADER)
    print("fresh", bits, group, qmv_rows.check(bits, group, 3))
