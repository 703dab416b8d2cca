#!/bin/sh
# Stages MLX's CUDA wheel for the GPU machine in as many parts as this tree leaves room for.
# A device call carries the working tree plus one part, 64 MiB in all; the shared stage.sh cuts the
# wheel in three ~30 MB parts, which leaves a tree of 35 MB at most, and the tree (the shipped model
# and the vendored fixtures) is larger. Run from the project root, here:
#     sh scripts/gpu_stage.sh [../shared/device/mlx-cuda]
# then the calls it prints, back to back (the machine keeps /tmp only while warm). With BASE=REV it
# also writes REV's package and scripts to .gpu/base: a warm call that carries .gpu/base runs any
# bench section on both trees in one lease (ratios only within one), e.g.
#     PYTHONPATH=/tmp/site:$PWD/.gpu/base OUT=$OUT/base sh scripts/gpu_check.sh batch9b
#     PYTHONPATH=/tmp/site:$PWD OUT=$OUT/new sh scripts/gpu_check.sh batch9b
# (the scripts run from this tree import the package PYTHONPATH names; the suite is this tree's)
set -e
src=${1:-../shared/device/mlx-cuda}
limit=$((60 * 1024 * 1024))  # of the 64 MiB, keeping 4 MiB for files added before the calls
tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
wheel=$(cat "$src"/part.* | wc -c)
extra=$(cat "$src"/mlx-*.whl "$src"/gguf-*.whl "$src"/SHA256SUMS | wc -c)
room=$((limit - tree - extra))
if [ "$room" -le $((8 * 1024 * 1024)) ]; then
    echo "gpu_stage: the tree is $((tree / 1048576)) MiB, too large to carry MLX beside it" >&2; exit 1
fi
n=$(( (wheel + room - 1) / room ))
[ "$n" -lt 3 ] && n=3
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/stage && mkdir -p .gpu/stage
cat "$src"/part.* > .gpu/stage/wheel
split -n "$n" -d -a 2 .gpu/stage/wheel .gpu/stage/part.
rm .gpu/stage/wheel
i=1
for p in .gpu/stage/part.*; do
    rm -rf ".gpu/$i" && mkdir -p ".gpu/$i" && mv "$p" ".gpu/$i/"
    i=$((i + 1))
done
rmdir .gpu/stage
cp "$src"/mlx-*.whl "$src"/gguf-*.whl "$src"/SHA256SUMS .gpu/1/
# the last call's installer: what it runs on the GPU machine
cat > ".gpu/$n/install.sh" <<'INSTALL'
#!/bin/sh
# Runs on the GPU machine in the last staging call: joins the parts the earlier calls left in /tmp/mlxw with this call's, checks
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
         "$here"/prometheus_client-*.whl "$here"/mlx_lm-*.whl "$here"/llguidance-*.whl; do
    # optional: the suite over workers, the server, the peer (mlx-lm), the constraint tests (llguidance)
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"
done
PYTHONPATH=/tmp/site python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
INSTALL
# pytest-xdist spreads the GPU suite over worker processes (kernel compilation is CPU-bound, the
# machine has 16 cores): without it the suite needs two device calls, with it one
python3 -m pip download -q --no-deps -d ".gpu/$n" pytest-xdist==3.8.0 execnet==2.1.2 >/dev/null 2>&1 ||
    echo "gpu_stage: pytest-xdist not staged (no package index): the GPU tests run in one process" >&2
# the server's own dependencies (pure Python; the device has none of them): `gpu_check.sh server`
python3 -m pip download -q --no-deps -d ".gpu/$n" uvicorn==0.55.0 h11==0.16.0 click==8.5.1 starlette==1.10.0 \
    anyio==4.16.0 idna==3.10 prometheus-client==0.26.0 >/dev/null 2>&1 ||
    echo "gpu_stage: the server's wheels not staged (no package index): gpu_check.sh server cannot start it" >&2
# the peer benchmarks' mlx-lm (its transformers/huggingface_hub imports get unusable stand-ins,
# scripts/bench/peer.py: those wheels with theirs are ~34 MB, more than a call carries)
python3 -m pip download -q --no-deps -d ".gpu/$n" mlx-lm==0.32.2 >/dev/null 2>&1 ||
    echo "gpu_stage: mlx-lm not staged (no package index): the peer columns stay empty" >&2
# constrained decoding's grammar engine (one abi3 wheel, ~3 MB): without it the GPU suite skips the
# constraint tests
python3 -m pip download -q --no-deps -d ".gpu/$n" llguidance==1.9.1 >/dev/null 2>&1 ||
    echo "gpu_stage: llguidance not staged (no package index): the constraint tests skip on the GPU" >&2
if [ -n "${BASE:-}" ]; then  # the tree to compare against (git ignores .gpu/: a call carries it only when named)
    rm -rf .gpu/base && mkdir -p .gpu/base && git archive "$BASE" mtp_engine scripts | tar -x -C .gpu/base
    echo "staged $BASE's mtp_engine and scripts in .gpu/base (carry .gpu/base on the calls that compare)"
fi
echo "staged MLX in $n parts (tree $((tree / 1048576)) MiB + at most $(( (wheel / n + extra) / 1048576 + 1)) MiB a call)."
i=1
while [ "$i" -lt "$n" ]; do
    echo "  call $i: mkdir -p /tmp/mlxw && cp .gpu/$i/* /tmp/mlxw/        carry .gpu/$i"
    i=$((i + 1))
done
echo "  call $n: sh .gpu/$n/install.sh > \$OUT/install.log 2>&1; export PYTHONPATH=/tmp/site:\$PWD; OUT=\$OUT sh scripts/gpu_check.sh all   carry .gpu/$n"
echo "  (all: the suite, start-up, the server and one table within the call; later warm calls: export PYTHONPATH=/tmp/site:\$PWD; ...)"
