"""The KV cache's worst case against the memory it may take (model/memory.py): the formula against the
pool a real runner allocates, the preallocated pool (CUDA's) against the growing one (the CPU's), the
start-up error and the warning, the container limit, and the flag's way to the runners."""
from __future__ import annotations

import logging

import pytest
import torch

from engine_helpers import DEVICE, llama_config, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.model import ModelRunner
from saguaro_dist.model.memory import GIB, KVNeed, cgroup_headroom, kv_budget, kv_bytes_per_token, shortfall

NOTHING = 1e-6  # a share of any machine's memory too small for any KV cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_memory") / "model"
    save_model(path, llama_config(64, 32, 2), seed=3)  # 2 layers, 2 KV heads of 8 dims, 256 positions
    return str(path)


def test_the_formula_is_what_a_preallocated_pool_holds(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="saguaro_dist.model.memory"):
        runner = ModelRunner(checkpoint, max_batch_size=3, preallocate_kv=True)
    assert "KV cache on cpu: up to 3 rows x 256 positions = 0.2 MiB (allocated now)" in caplog.text  # vLLM's line
    pool = runner.pool
    per_token = kv_bytes_per_token(2, 2, 8, torch.float32)
    assert per_token == 2 * 2 * 2 * 8 * 4
    assert pool.rows == 3 and pool.nbytes == KVNeed(3, 0, 256, per_token).bytes  # the worst case, held at once
    start, capacity = pool.k.data_ptr(), pool.capacity
    runner.add("long")
    runner.extend(["long"], [[i % 64 for i in range(200)]], [1])
    assert pool.capacity > capacity and pool.capacity >= 200  # the views widened ...
    assert (pool.k.data_ptr(), pool.nbytes) == (start, KVNeed(3, 0, 256, per_token).bytes)  # ... in place


def test_a_preallocated_pool_computes_what_a_growing_one_does(checkpoint):
    grown, whole = ModelRunner(checkpoint, max_batch_size=4), ModelRunner(checkpoint, max_batch_size=4, preallocate_kv=True)
    assert grown.pool.nbytes < whole.pool.nbytes
    prompts = [[5, 9, 2, 7], [1, 3, 3, 8, 8, 6, 2]]
    for runner in (grown, whole):
        runner.add("a"), runner.add("b")
    for step in range(4):  # a prefill, then one token a step, as decoding does
        tokens = prompts if step == 0 else [[step + 1], [step + 2]]
        got = [r.extend(["a", "b"], tokens, [1, 1]) for r in (grown, whole)]
        for g, w in zip(*got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_worst_case_over_the_budget_fails_start_up_naming_what_fits(checkpoint):
    with pytest.raises(ValueError, match=r"worst case, max_batch_size 8 x max_model_len 256 x 256 bytes a position "
                                         r"= 0.5 MiB, is more than .* at gpu_memory_utilization 1e-06"):
        ModelRunner(checkpoint, preallocate_kv=True, gpu_memory_utilization=NOTHING)


def test_a_growing_pool_over_the_budget_warns_and_runs(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.model.memory"):
        with LLM(model=checkpoint, mode="ar", gpu_memory_utilization=NOTHING) as llm:
            out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                                                           ignore_eos=True))
    assert len(out[0].token_ids) == 5
    assert "KV cache's worst case" in caplog.text and "may run out of memory" in caplog.text


def test_what_fits_is_computed_from_the_budget():
    need = KVNeed(batch=8, spare_rows=1, max_len=40960, bytes_per_token=kv_bytes_per_token(28, 8, 128, torch.bfloat16))
    budget = 30 * GIB
    assert need.fitting_len(budget) == 31207 and KVNeed(8, 1, 31207, need.bytes_per_token).bytes <= budget
    assert need.fitting_batch(budget) == 5 and KVNeed(5, 1, 40960, need.bytes_per_token).bytes <= budget
    assert KVNeed(6, 1, 40960, need.bytes_per_token).bytes > budget
    why = shortfall(need, budget, torch.device("cuda:0"), 0.9)
    assert "(max_batch_size 8 + 1 scratch row) x max_model_len 40960" in why
    assert "Fits: max_model_len 31207 or max_batch_size (max_num_seqs) 5" in why
    assert "Nothing fits" in shortfall(need, 1000, torch.device("cpu"), 0.9)
    assert shortfall(need, need.bytes, torch.device("cpu"), 0.9) is None


@pytest.mark.parametrize("files, headroom", [
    ({"memory.max": "1073741824\n", "memory.current": "268435456\n"}, 768 * 2 ** 20),  # cgroup v2
    ({"memory.max": "max\n", "memory.current": "268435456\n"}, None),                  # v2, no limit
    ({"memory/memory.limit_in_bytes": "2147483648\n", "memory/memory.usage_in_bytes": "0\n"}, 2 * GIB),  # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n"}, None),
    ({}, None),                                                                          # no cgroup files
])
def test_a_containers_memory_limit_counts(tmp_path, files, headroom):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_headroom(tmp_path) == headroom


def test_the_budget_is_a_share_of_what_is_free():
    assert 0 < kv_budget(torch.device(DEVICE), 0.5) < kv_budget(torch.device(DEVICE), 1.0)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "0.9"])
def test_gpu_memory_utilization_is_a_fraction(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in \\(0, 1\\]"):
        Config(model="m", mode="ar", gpu_memory_utilization=value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh)")
def test_on_cuda_the_pool_is_allocated_whole_at_start_up(checkpoint):
    runner = ModelRunner(checkpoint, device="cuda", max_batch_size=3, cuda_graphs=True)
    per_token = kv_bytes_per_token(2, 2, 8, torch.float32)
    assert runner.pool.nbytes == KVNeed(3, 1, 256, per_token).bytes  # 3 sequences and the graphs' scratch row
    with pytest.raises(ValueError, match="KV cache's worst case"):
        ModelRunner(checkpoint, device="cuda", gpu_memory_utilization=NOTHING)
