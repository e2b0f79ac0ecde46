#!/usr/bin/env bash
# The GPU check (never in CI): on a machine with a CUDA GPU, from the repository root,
#   OUT=gpu-check bash benchmarks/gpu_check.sh
# Stages (STAGES=tests,graphs,bench,inflated by default, run in that order), each time-boxed, each run
# whatever the last did:
#   tests     the CUDA-only tests (tests/test_cuda.py: logits vs transformers, NCCL collectives, the
#             verifier's law on the device, CUDA-graph replay) and the engine's exactness suites with
#             every model on the GPU (short forwards replayed from CUDA graphs, the default there);
#   graphs    latency eager vs CUDA graphs (benchmarks/bench_cuda_graphs.py), demo pair fp32 and the
#             inflated target bf16; a graphed decode beside a long request's wide KV pool vs the narrowed
#             pool (benchmarks/bench_kv_narrowing.py);
#   bench     `saguaro bench` on the demo pair itself (fp32), with CUDA graphs and then --enforce-eager;
#   inflated  `saguaro bench` against the demo target inflated to a real model's cost (bench/inflate.py,
#             bf16), where a target forward costs many draft forwards, as on real pairs (INFLATED_EAGER=1:
#             with --enforce-eager; INFLATED_SYSTEMS, INFLATED_BATCH, INFLATED_TEMPERATURES narrow the grid).
# The image may lack packages the tests import: wheels in ./.whl (WHEELS=dir) are installed into a folder put
# on the path first, or name a folder of packages in EXTRA_PATH. Session 64's H200 image lacked Ray (its tests
# are left out then), llguidance, grpcio-health-checking and the protobuf / grpcio the committed stubs need:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#     --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#     protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1 llguidance==1.9.1
# TEST_WORKERS=N runs the tests stage in N pytest-xdist workers sharing the GPU (the suites' models are tiny;
# each worker holds a CUDA context of its own).
# Logs and results land under $OUT; each bench cell is logged as it is measured. REPEATS=N: timed passes
# per cell (each bench warms up with one whole untimed pass on a GPU first).
set -uo pipefail
set -f  # pytest node ids hold [brackets]: no globbing
OUT=${OUT:-gpu-check}
STAGES=${STAGES:-tests,graphs,bench,inflated}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of the script itself
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
set +f
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/saguaro-site \
        "$WHEELS"/*.whl && EXTRA_PATH=/tmp/saguaro-site${EXTRA_PATH:+:$EXTRA_PATH}
fi
set -f
export PYTHONPATH="$PWD${EXTRA_PATH:+:$EXTRA_PATH}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

bench() {  # bench NAME TIMEOUT ARGS...: one interleaved `saguaro bench` run; cells and table shown
    local name=$1 limit=$2; shift 2
    timeout "$limit" $PY -m saguaro_dist.cli --log-level INFO bench --device "$DEVICE" --settings equal --no-plots \
        --no-progress --interleave --out "$OUT/$name" ${REPEATS:+--repeats $REPEATS} "$@" 2>&1 | tee "$OUT/$name.log" \
        | grep --line-buffered -E "cell |^\|"
}
demo_draft() { $PY -c 'from saguaro_dist.demo import demo_pair; print(demo_pair()[1])'; }

# The sampling suite's statistical cases take ~15 s each on a CPU and longer on a GPU: a GPU run takes
# one per path kind (hit, Saguaro C < 1, the draft process, truncated sampling); CI runs them all.
S=tests/test_engine_sampling.py
TESTS=${TESTS:-"tests/test_cuda.py tests/test_step_graphs.py tests/test_engine_greedy.py tests/test_engine_logprobs.py
 tests/test_draft_process.py tests/test_draft_worker_hits.py tests/test_draft_kv_tail.py tests/test_draft_context.py
 tests/test_vocab_padding.py tests/test_tree_plans.py
 $S::test_first_tokens_follow_the_target[ssd_hit_path] $S::test_first_tokens_follow_the_target[ssd_saguaro_c]
 $S::test_first_tokens_follow_the_target[ssd_draft_process]
 tests/test_engine_sampling_constraints.py::test_truncated_sampling_follows_the_target[t0.8_topk4]"}
stage_tests() {
    local no_ray=()  # the GPU image has no Ray: its tests (named on_ray) are left out there
    $PY -c "import ray" 2>/dev/null || no_ray=(-k "not on_ray")
    # -v: each test's result on a line of its own, so a log the time box cuts still names its failures (session 65's
    # did not); 150 s a test: the split and draft-process sampling cases took 90-105 s on an H200 under load.
    timeout "${TESTS_TIMEOUT:-300}" env SAGUARO_TEST_DEVICE="$DEVICE" $PY -m pytest -v -rfE -p no:cacheprovider \
        --timeout 150 --maxfail 8 ${TEST_WORKERS:+-n $TEST_WORKERS} "${no_ray[@]}" $TESTS > "$OUT/tests.log" 2>&1
    grep -E "FAILED|ERROR|XPASS" "$OUT/tests.log" | tail -20; tail -3 "$OUT/tests.log"
}
BIG=${TMPDIR:-/tmp}/saguaro-inflated-target  # not under $OUT: gigabytes that need not come back
inflated_target() {  # writes $BIG once; false if that failed
    [ -f "$BIG/config.json" ] || timeout "${INFLATE_TIMEOUT:-90}" $PY -c "from saguaro_dist.bench.inflate import inflate_llama
from saguaro_dist.demo import demo_pair
inflate_llama(demo_pair()[0], '$BIG', extra_layers=${INFLATE_LAYERS:-27}, intermediate_size=${INFLATE_WIDTH:-24576})"
}
stage_graphs() {
    { timeout "${GRAPHS_TIMEOUT:-60}" $PY benchmarks/bench_cuda_graphs.py --device "$DEVICE"
      inflated_target && timeout "${GRAPHS_TIMEOUT:-60}" $PY benchmarks/bench_cuda_graphs.py --device "$DEVICE" \
          --models "$BIG,$(demo_draft)" --dtype bfloat16
      timeout "${GRAPHS_TIMEOUT:-60}" $PY benchmarks/bench_kv_narrowing.py --device "$DEVICE" --long 8000; } 2>&1 \
        | tee "$OUT/graphs.log"
}
stage_inflated() {
    inflated_target && bench inflated-bf16 "${INFLATED_TIMEOUT:-180}" --target "$BIG" --draft "$(demo_draft)" \
        --dtype bfloat16 --systems ${INFLATED_SYSTEMS:-ar,sd,ssd,ssd-split,hf-assisted} --batch ${INFLATED_BATCH:-1,8} \
        --temperatures ${INFLATED_TEMPERATURES:-0,0.7} --max-new-tokens 64 ${INFLATED_EAGER:+--enforce-eager}
}
stage_bench() {
    for eager in "" ${BENCH_EAGER---enforce-eager}; do  # BENCH_EAGER= : graphs only
        bench "demo-fp32${eager:+-eager}" "${BENCH_TIMEOUT:-110}" --systems ar,sd,ssd,ssd-split --batch 1,8 \
            --temperatures ${BENCH_TEMPERATURES:-0,0.7} --max-new-tokens 64 $eager
    done
}
for stage in ${STAGES//,/ }; do
    "stage_$stage"
done
