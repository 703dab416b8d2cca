#!/bin/sh
# One device call's worth of GPU checks (after the MLX-CUDA staging calls that
# `sh scripts/gpu_stage.sh` prints: the shared wheel in as many parts as this tree leaves room for): the CUDA-only tests, start-up in two processes, and the
# decode benchmarks, the server's overhead, each bounded, every log under $OUT (or ./gpu-check when $OUT is unset).
# Usage on the device: PYTHONPATH=/tmp/site:$PWD sh scripts/gpu_check.sh [tests|tests1|tests2|kernels|rows|diag|sampled|spec|startup|bench|context|chunks|batch|batch9b|ab8|open-batch|open-long|server|summary|all]
# (`all`: tests, start-up, server and one summary table, within one call)
out=${OUT:-gpu-check}
mkdir -p "$out"
what=${1:-all}
export PYTHONUNBUFFERED=1
# `all` must end inside one device call (600 s, the install before it included): each section gets at most what is left of 560 s,
# and one that cannot get its minimum is skipped and named in the summary
deadline=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-560} ))
left() {  # left MAX MIN: seconds this section may take, or nothing when fewer than MIN remain
    r=$(( deadline - $(date +%s) ))
    [ "$r" -gt "$1" ] && r=$1
    if [ "$r" -lt "$2" ]; then echo "skipped for time: $3" >> "$out/skipped.txt"; return 1; fi
    echo "$r"
}
[ "$what" = summary ] || rm -f "$out/skipped.txt"
# The CUDA-backend suite: the kernels and compiled step (group 1), then the model against its
# references, caches, constraints and batching on the GPU path (group 2). Over pytest-xdist workers
# (gpu_stage.sh stages it) both groups fit one call; in one process each needs its own (tests1, tests2).
group1="tests/model/test_attn_kernel.py tests/model/test_gdn_kernel.py tests/model/test_kernel_selftest.py
    tests/model/test_qmv_kernels.py tests/model/test_compiled_step.py tests/model/test_model_llamacpp.py
    tests/model/test_kernel_cache.py tests/model/test_kernel_warmup.py tests/model/test_kv_tail.py"
group2="tests/model/test_model_reference.py tests/generation/test_prompt_cache.py tests/generation/test_constraint.py
    tests/batching/test_batching.py tests/speculative/test_capture_width.py tests/speculative/test_long_context.py
    tests/speculative/test_kv_dtype.py tests/speculative/test_draft_vocab.py tests/generation/test_sampling_oracle.py
    tests/generation/test_pipeline.py tests/generation/test_profiler_bench.py tests/model/test_product_slabs.py
    tests/generation/test_prompt_read.py tests/batching/test_joint_read.py"
gpu_tests() {  # name, then the files; serve_parallel (threads and HTTP, nothing of the GPU) stays on the CPU
    t=$(left 580 120 "$1") || return 0
    # MLX's modules are not prepared in worker processes here: 8 test processes, each with its own
    # cache folder, would start 4 workers each (a CUDA context apiece) for modules the tests compile anyway
    MTP_ENGINE_MLX_PREPARE_WORKERS=0 timeout "$t" python3 -m pytest -q -p no:cacheprovider --tb=short --durations=12 $workers -k "not serve_parallel" \
        $2 > "$out/$1.log" 2>&1
    echo "$1 rc=$?"; grep -E "passed|failed" "$out/$1.log" | tail -1
}
workers=""
python3 -c "import xdist" 2>/dev/null && workers="-n 8"
if [ "$what" = tests ] || [ "$what" = all ]; then
    if [ -n "$workers" ]; then gpu_tests tests "$group1 $group2"
    else gpu_tests tests1 "$group1"; echo "(no pytest-xdist: run 'gpu_check.sh tests2' in the next call)"; fi
fi
[ "$what" = tests1 ] && gpu_tests tests1 "$group1"
[ "$what" = tests2 ] && gpu_tests tests2 "$group2"
if [ "$what" = kernels ]; then  # the custom kernels alone against the MLX path (a few minutes)
    MTP_ENGINE_MLX_PREPARE_WORKERS=0 timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/model/test_gdn_kernel.py \
        tests/model/test_attn_kernel.py tests/model/test_qmv_kernels.py tests/model/test_kernel_selftest.py \
        tests/model/test_kernel_source.py > "$out/kernels.log" 2>&1
    echo "kernels rc=$?"; grep -E "passed|failed" "$out/kernels.log" | tail -1
fi
if [ "$what" = rows ]; then  # where a batch's rows stop computing what the sequence computes alone, per kernel setting
    timeout 300 python3 scripts/bench/qmv_rows.py --rows-equal --rows 1,2,4,8,16 --repeats 2 > "$out/rows.log" 2>&1
    echo "rows rc=$?"; cat "$out/rows.log" | grep -E "differing|quantized_matmul"
fi
if [ "$what" = diag ]; then  # one call's worth of the open questions: which stage of a delta-net mixer makes a
    # batch's rows differ from alone (from equal inputs), batches at 1/4/8 streams with their rounds' stages, auto's
    # round times per length against fixed lengths'
    timeout 150 python3 scripts/bench/qmv_rows.py --rows-equal --gdn --rows 1,4,8 --kernel-sets mlx,custom \
        > "$out/rows-gdn.log" 2>&1
    echo "rows-gdn rc=$?"; grep -E "kernels=" "$out/rows-gdn.log"
    timeout 240 python3 scripts/bench/bench_batch.py --random-9b -t 64 --concurrency 1,4,8 --repeats 1 --oracle 0.8 \
        --profile --out "$out/batch9b.json" > "$out/batch9b.log" 2>&1
    echo "batch9b rc=$?"; tail -3 "$out/batch9b.log"
    timeout 180 python3 scripts/bench/bench_gpu.py --sections auto --tokens 128 --repeats 3 --shapes 9b \
        --accs 0.5,0.8,0.9 --out "$out/auto" > "$out/auto.log" 2>&1
    echo "auto rc=$?"; tail -8 "$out/auto.log"
fi
if [ "$what" = sampled ]; then  # batches of sampled streams (top-p 0.95): their rows draw and draft on the device
    timeout 300 python3 scripts/bench/bench_batch.py --random-9b -t 64 --concurrency 1,4,8 --repeats 1 --oracle 0.8 \
        --temperature 0.8 --top-p 0.95 --out "$out/batch9b-sampled.json" > "$out/batch9b-sampled.log" 2>&1
    echo "sampled rc=$?"; tail -3 "$out/batch9b-sampled.log"
fi
if [ "$what" = spec ]; then  # auto's speedups against fixed n-max at the 9B shape (6 repeats: two of one
    # setting differ by up to 20%; the table's "held out" column scores auto without the best's upward bias)
    timeout 330 python3 scripts/bench/bench_gpu.py --sections auto --tokens 128 --repeats 6 --shapes 9b \
        --accs 0.5,0.8,0.9 --out "$out/auto" > "$out/auto.log" 2>&1
    echo "auto rc=$?"; tail -12 "$out/auto.log"
fi
if [ "$what" = startup ] || [ "$what" = all ]; then
    # an empty cache root: process 1 is a fresh machine's start-up whatever ran before it (the
    # suite compiles many of the same modules), process 2 the same machine's second
    root=$(mktemp -d /tmp/mtp-startup.XXXXXX)
    for i in 1 2; do
        t=$(left 150 20 "startup $i") || continue
        # users' first uses too: a 600-token prompt alone (MLX's own prompt path), a server's batches
        timeout "$t" python3 scripts/bench/startup_breakdown.py --root "$root" --first-forward --long 600 --batch \
            > "$out/startup$i.json" 2> "$out/startup$i.err"
        echo "startup $i rc=$?"
    done
fi
if [ "$what" = bench ]; then  # not in `all`: with the suite it would not fit one call
    timeout 200 python3 scripts/bench/bench_gpu.py --sections plain,verify --configs fused,fused+attn --repeats 5 \
        --tokens 64 --no-peer > "$out/plain-verify.json" 2> "$out/plain-verify.log"
    echo "plain/verify rc=$?"
    timeout 200 python3 scripts/bench/bench_gpu.py --sections loop --quick > "$out/loop.json" 2> "$out/loop.log"
    echo "loop rc=$?"
fi
if [ "$what" = context ]; then  # long prompts and contexts: prefill, decode and draft-mtp against the prompt's length
    # step: what a pipelined step allocates beyond the cache; context: each length warmed first, plain
    # beside the same model without KV tails
    timeout 330 python3 scripts/bench/bench_context.py --sections step,context --lengths 512,8192,32768 \
        --tokens 128 --repeats 1 --n-max 3,auto --no-tail --peer-max 2048 --out "$out/context" > "$out/context.log" 2>&1
    echo "context rc=$?"; tail -4 "$out/context.log"
    timeout 260 python3 scripts/bench/bench_gpu.py --sections auto --tokens 128 --repeats 1 --shapes 9b --accs 0.8 \
        --prompt-tokens 512,8192,32768 --out "$out/auto-context" > "$out/auto-context.log" 2>&1
    echo "auto-context rc=$?"; tail -16 "$out/auto-context.log"
fi
if [ "$what" = chunks ]; then  # long prompts at the default prefill chunk and at 8192 (chunks shrink past 8192
    # positions: model/memory.prefill_chunk_at), draft-mtp n-max 3 beside plain at each length
    timeout 300 python3 scripts/bench/bench_context.py --sections context --lengths 8192,32768 --tokens 32 --repeats 1 \
        --n-max 3 --peer-max 0 --prefill-chunks 8192 --out "$out/chunks" > "$out/chunks.log" 2>&1
    echo "chunks rc=$?"; tail -6 "$out/chunks.log"
fi
if [ "$what" = batch ]; then  # continuous batching: the shipped model, then pass -m for the 9B shape
    timeout 500 python3 scripts/bench/bench_batch.py -t 64 --concurrency 1,2,4,8,16 --repeats 3 --out "$out/batch.json" \
        --plot "$out/batch.png" > "$out/batch.log" 2>&1
    echo "batch rc=$?"; tail -5 "$out/batch.log"
fi
if [ "$what" = batch9b ]; then  # batching at the 9B shape: 1 to 16 streams, plain and draft-mtp at oracle 0.8
    timeout 560 python3 scripts/bench/bench_batch.py --random-9b -t 64 --concurrency 1,4,8,16 --repeats 2 --oracle 0.8 \
        --out "$out/batch9b.json" --plot "$out/batch9b.png" > "$out/batch9b.log" 2>&1
    echo "batch9b rc=$?"; tail -6 "$out/batch9b.log"
fi
if [ "$what" = ab8 ]; then  # 8 streams at the 9B shape, this tree against .gpu/base (`BASE=REV gpu_stage.sh`,
    # carried), interleaved: where a change moved the batch's first tokens or steps
    for t in new base new base; do
        p=$PYTHONPATH; [ "$t" = base ] && p=/tmp/site:$PWD/.gpu/base
        PYTHONPATH=$p timeout 80 python3 scripts/bench/bench_batch.py --random-9b -t 64 --concurrency 8 --repeats 1 \
            > "$out/ab8-$t.log" 2>&1
        echo "$t rc=$? $(grep 'C= 8' "$out/ab8-$t.log" | cut -c1-130)"
    done
fi
if [ "$what" = open-batch ]; then  # the batch's open figures: 1 and 8 streams' first tokens (short prompts) with
    # joint reads on and off (MTP_ENGINE_JOINT_READ) and against .gpu/base, then 8 streams of 48-token prompts
    for t in new new-off base; do
        p=$PYTHONPATH; [ "$t" = base ] && p=/tmp/site:$PWD/.gpu/base
        j=1; [ "$t" = new-off ] && j=0
        r=$(left 120 60 "ab8 $t") || continue
        MTP_ENGINE_JOINT_READ=$j PYTHONPATH=$p timeout "$r" python3 scripts/bench/bench_batch.py --random-9b -t 64 \
            --concurrency 1,8 --repeats 1 > "$out/ab8-$t.log" 2>&1
        echo "$t rc=$? $(grep 'C= ' "$out/ab8-$t.log" | cut -c1-130)"
    done
    for j in 1 0; do
        r=$(left 80 50 "joint read $j") || continue
        MTP_ENGINE_JOINT_READ=$j timeout "$r" python3 scripts/bench/bench_batch.py --random-9b -t 32 --concurrency 8 \
            --prompt-tokens 48 --repeats 1 > "$out/joint-$j.log" 2>&1
        echo "joint read $j rc=$? $(grep 'C= ' "$out/joint-$j.log" | cut -c1-130)"
    done
fi
if [ "$what" = open-long ]; then  # the long context's and start-up's open figures: long prompts' chunks, a fresh start-up
    r=$(left 250 120 chunks) && timeout "$r" python3 scripts/bench/bench_context.py --sections context --lengths 8192,32768 \
        --tokens 32 --repeats 1 --n-max 3 --peer-max 0 --prefill-chunks 8192 --out "$out/chunks" > "$out/chunks.log" 2>&1
    echo "chunks rc=$?"; tail -6 "$out/chunks.log"
    r=$(left 200 60 startup) && timeout "$r" python3 scripts/bench/startup_breakdown.py --root "$(mktemp -d /tmp/mtp-startup.XXXXXX)" \
        --first-forward --long 600 --batch > "$out/startup1.json" 2> "$out/startup1.err"
    echo "startup rc=$?"; tail -c 600 "$out/startup1.json"
fi
if [ "$what" = server ] || [ "$what" = all ]; then
    # single runs of the shipped model vary by +-25% (1.6 ms a token, host-bound): medians need many
    repeats=15
    [ "$what" = all ] && repeats=9
    for spec in none draft-mtp; do
        t=$(left 150 60 "server $spec") || continue
        timeout "$t" python3 scripts/bench/bench_server.py -n 256 --repeats $repeats --spec $spec --n-max auto \
            --out "$out/server-$spec.json" > "$out/server-$spec.log" 2>&1
        echo "server $spec rc=$?"; tail -3 "$out/server-$spec.log"
    done
fi
if [ "$what" = all ] || [ "$what" = summary ]; then
    python3 scripts/gpu_summary.py "$out" | tee "$out/summary.md"
fi
