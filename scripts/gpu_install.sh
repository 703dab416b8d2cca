#!/bin/sh
# Runs on the GPU machine in the last staging call (scripts/gpu_stage.sh copies it there as
# .gpu/N/install.sh): joins the parts the earlier calls left in /tmp/mlxw with this call's, checks
# the wheel's sha256 and installs MLX (CUDA), mlx and gguf (and pytest-xdist when staged) into /tmp/site. Nothing when installed.
set -e
if PYTHONPATH=/tmp/site python3 -c 'import mlx.core as mx; assert mx.default_device().type == mx.gpu' 2>/dev/null; then
    exit 0
fi
here=$(cd "$(dirname "$0")" && pwd)
cp "$here"/part.* /tmp/mlxw/
cd /tmp/mlxw
wheel=$(awk '{print $2}' SHA256SUMS)
cat part.* > "$wheel"
sha256sum -c SHA256SUMS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$wheel" mlx-*.whl gguf-*.whl
for w in "$here"/pytest_xdist-*.whl "$here"/execnet-*.whl "$here"/uvicorn-*.whl "$here"/h11-*.whl \
         "$here"/click-*.whl "$here"/starlette-*.whl "$here"/anyio-*.whl "$here"/idna-*.whl \
         "$here"/prometheus_client-*.whl "$here"/mlx_lm-*.whl; do  # optional: the suite over workers, the server, the peer (mlx-lm)
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"
done
PYTHONPATH=/tmp/site python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
