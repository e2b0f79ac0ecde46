#!/usr/bin/env bash
# The GPU check (never in CI): on a machine with a CUDA GPU, from the repository root,
#   OUT=gpu-check bash benchmarks/gpu_check.sh
# Stages (STAGES=tests,inflated,bench by default, run in that order), each time-boxed, each run
# whatever the last did:
#   tests     the CUDA-only tests (tests/test_cuda.py: logits vs transformers, NCCL collectives, the
#             verifier's law on the device) and the engine's exactness suites with every model on the GPU;
#   inflated  `saguaro bench` against the demo target inflated to a real model's cost (bench/inflate.py,
#             bf16), where a target forward costs many draft forwards, as on real pairs;
#   bench     `saguaro bench` on the demo pair itself (fp32).
# Logs and results land under $OUT; each bench cell is logged as it is measured.
set -uo pipefail
set -f  # pytest node ids hold [brackets]: no globbing
OUT=${OUT:-gpu-check}
STAGES=${STAGES:-tests,inflated,bench}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of the script itself
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

bench() {  # bench NAME TIMEOUT ARGS...: one interleaved `saguaro bench` run; cells and table shown
    local name=$1 limit=$2; shift 2
    timeout "$limit" $PY -m saguaro_dist.cli --log-level INFO bench --device "$DEVICE" --settings equal --no-plots \
        --no-progress --interleave --out "$OUT/$name" "$@" 2>&1 | tee "$OUT/$name.log" \
        | grep --line-buffered -E "cell |^\|"
}
demo_draft() { $PY -c 'from saguaro_dist.demo import demo_pair; print(demo_pair()[1])'; }

# The sampling suite's statistical cases take ~15 s each on a CPU and longer on a GPU: a GPU run takes
# one per path kind (hit, Saguaro C < 1, the draft process, truncated sampling); CI runs them all.
S=tests/test_engine_sampling.py
TESTS=${TESTS:-"tests/test_cuda.py tests/test_engine_greedy.py tests/test_draft_process.py
 $S::test_first_tokens_follow_the_target[ssd_hit_path] $S::test_first_tokens_follow_the_target[ssd_saguaro_c]
 $S::test_first_tokens_follow_the_target[ssd_draft_process] $S::test_truncated_sampling_follows_the_target[t0.8_topk4]"}
stage_tests() {
    timeout "${TESTS_TIMEOUT:-200}" env SAGUARO_TEST_DEVICE="$DEVICE" $PY -m pytest -q -p no:cacheprovider \
        --timeout 60 --maxfail 8 $TESTS 2>&1 | tee "$OUT/tests.log" | tail -30
}
stage_inflated() {
    local big=${TMPDIR:-/tmp}/saguaro-inflated-target  # not under $OUT: gigabytes that need not come back
    if timeout "${INFLATE_TIMEOUT:-90}" $PY -c "import sys; from saguaro_dist.bench.inflate import inflate_llama
from saguaro_dist.demo import demo_pair
inflate_llama(demo_pair()[0], '$big', extra_layers=${INFLATE_LAYERS:-27}, intermediate_size=${INFLATE_WIDTH:-24576})"; then
        bench inflated-bf16 "${INFLATED_TIMEOUT:-180}" --target "$big" --draft "$(demo_draft)" --dtype bfloat16 \
            --systems ar,sd,ssd,hf-assisted --batch 1,8 --temperatures 0,0.7 --max-new-tokens 64
    fi
}
stage_bench() {
    bench demo-fp32 "${BENCH_TIMEOUT:-110}" --systems ar,sd,ssd --batch 1,8 --temperatures 0,0.7 --max-new-tokens 64
}
for stage in ${STAGES//,/ }; do
    "stage_$stage"
done
