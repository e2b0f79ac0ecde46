"""Shared fixtures: tiny real checkpoints written by transformers (no mocks, no downloads)."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

TINY_VOCAB = 64
_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# kind -> (model class, config); every kind shares the tiny vocabulary
CHECKPOINT_KINDS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False)),
    "llama3": (LlamaForCausalLM, lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE)),
    "tied": (LlamaForCausalLM, lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True)),
    "sharded": (LlamaForCausalLM, lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False)),
    # Mistral v0.1's sliding window, longer than every context the tests use (so it is full attention)
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**{**_COMMON, "sliding_window": 200}, tie_word_embeddings=False)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**_COMMON, tie_word_embeddings=False)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=False)),
    "draft": (LlamaForCausalLM, lambda: LlamaConfig(**{**_COMMON, "hidden_size": 16, "intermediate_size": 32,
                                                       "num_hidden_layers": 1, "num_attention_heads": 2,
                                                       "num_key_value_heads": 1}, tie_word_embeddings=True)),
}


def write_checkpoint(kind: str, path, seed: int = 0):
    """Save a random `kind` model; biases and norm weights are randomised too (HF inits them to 0 / 1)."""
    cls, make_config = CHECKPOINT_KINDS[kind]
    torch.manual_seed(seed)
    model = cls(make_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="20KB" if kind == "sharded" else "5GB")
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(kind) -> path of a checkpoint of that kind (written once per session).
    Kinds: llama, llama3 (rope_scaling llama3), tied, sharded, mistral, qwen2, qwen3, draft."""
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = write_checkpoint(kind, tmp_path_factory.mktemp(f"ckpt_{kind}"), seed=list(CHECKPOINT_KINDS).index(kind))
        return made[kind]
    return get


@pytest.fixture(scope="session")
def tiny_llama_pair(tiny_checkpoint):
    """(target_path, draft_path): two different tiny Llama checkpoints with the same vocabulary (64)."""
    return tiny_checkpoint("llama"), tiny_checkpoint("draft")


RAY_START_ATTEMPTS = 3


def _start_ray(ray, metrics_port: int) -> None:
    """ray.init, tried again after a failed start: on the 2-vCPU CI box the raylet once took longer to
    register than Ray's own fixed 30 s wait, and every Ray test of that run errored at setup."""
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _metrics_export_port=metrics_port,
                     _system_config={"metrics_report_interval_ms": 1000})
            return
        except Exception:  # Ray raises TimeoutError, RuntimeError or ConnectionError here, by version
            ray.shutdown()
            if attempt == RAY_START_ATTEMPTS:
                raise
            logging.getLogger(__name__).warning("ray.init failed (attempt %d), starting again", attempt, exc_info=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session (start-up costs seconds). address="local": never join
    a neighbour's cluster. Logical CPUs above the machine's 2 cores only gate scheduling: the serve app,
    tensor-parallel ranks and draft pools of the tests fit side by side. Yields the URL of its Prometheus
    endpoint (None for a Ray someone else started), reported every second (Ray's default: 10 s)."""
    import ray

    from saguaro_dist.serve.ingress import free_port
    started = not ray.is_initialized()
    metrics_port = free_port()
    if started:
        _start_ray(ray, metrics_port)
    yield f"http://127.0.0.1:{metrics_port}/metrics" if started else None
    from ray import serve
    serve.shutdown()
    if started:
        ray.shutdown()


# The files that take longest (minutes of one worker each: seeded chi-square cases, Ray clusters). They
# run first, so that the two xdist workers (scripts/test.sh: a test file each) finish together rather
# than one running a long file alone at the end. Each file's tests stay together and in order.
SLOWEST_FIRST = ("test_distributed_sampling.py", "test_engine_sampling.py", "test_engine_sampling_constraints.py",
                 "test_distributed.py", "test_cli_serve.py", "test_benchmark_scripts.py", "test_bench_grid.py",
                 "test_serve_recovery.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FIRST)))  # stable: the rest keep their order
