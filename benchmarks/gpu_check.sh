#!/usr/bin/env bash
# The GPU check (never in CI): on a machine with a CUDA GPU, from the repository root,
#   OUT=gpu-check bash benchmarks/gpu_check.sh
# 1. the CUDA-only tests (tests/test_cuda.py: logits vs transformers, NCCL collectives, the verifier's law
#    on the device) and the engine's exactness suites with every model on the GPU;
# 2. `saguaro bench` on the demo pair (fp32) on the GPU;
# 3. the same against the demo target inflated to a real model's cost (bench/inflate.py, bf16), where
#    a target forward costs many draft forwards, as on real pairs.
# Each stage is time-boxed and runs whatever the last one did; logs and results land under $OUT.
set -uo pipefail
set -f  # pytest node ids hold [brackets]: no globbing
OUT=${OUT:-gpu-check}
STAGES=${STAGES:-tests,bench,inflated}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

has() { [[ ",$STAGES," == *",$1,"* ]]; }
bench() {  # bench NAME TIMEOUT ARGS...: one `saguaro bench` run, its table last in the log
    local name=$1 limit=$2; shift 2
    timeout "$limit" $PY -m saguaro_dist.cli bench --device cuda --settings equal --no-plots --no-progress \
        --out "$OUT/$name" "$@" 2>&1 | grep -v -i warning | tee "$OUT/$name.log" | tail -40
}

# The sampling suite's statistical cases take ~15 s each on a CPU: a GPU run takes one per path kind
# (hit, Saguaro C < 1, the draft process, truncated sampling); the CPU suite in CI runs them all.
SAMPLING="test_first_tokens_follow_the_target[ssd_hit_path] test_first_tokens_follow_the_target[ssd_saguaro_c]
 test_first_tokens_follow_the_target[ssd_draft_process] test_truncated_sampling_follows_the_target[t0.8_topk4]"
if has tests; then
    timeout "${TESTS_TIMEOUT:-200}" env SAGUARO_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider --timeout 60 \
        --maxfail 8 tests/test_cuda.py tests/test_engine_greedy.py tests/test_draft_process.py \
        $(for t in $SAMPLING; do printf 'tests/test_engine_sampling.py::%s ' "$t"; done) \
        2>&1 | tee "$OUT/tests.log" | tail -30
fi
if has bench; then
    bench demo-fp32 "${BENCH_TIMEOUT:-110}" --systems ar,sd,ssd,hf-assisted --batch 1,8 --temperatures 0,0.7 --repeats 2
fi
if has inflated; then
    big=/tmp/inflated-target
    timeout 120 $PY - "$big" <<'EOF' || exit 1
import sys
from saguaro_dist.bench.inflate import inflate_llama
from saguaro_dist.demo import demo_pair
inflate_llama(demo_pair()[0], sys.argv[1], extra_layers=27, intermediate_size=49152, dtype="bfloat16")
EOF
    bench inflated-bf16 "${INFLATED_TIMEOUT:-180}" --target "$big" --draft "$($PY -c 'from saguaro_dist.demo import demo_pair; print(demo_pair()[1])')" \
        --dtype bfloat16 --systems ar,sd,ssd,hf-assisted --batch 1,8 --temperatures 0,0.7 --repeats 2 --max-new-tokens 64
fi
