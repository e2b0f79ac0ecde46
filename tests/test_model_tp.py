"""Tensor parallel: 2 CPU ranks (gloo) give the logits of 1 rank, for extend and branch decode."""
from __future__ import annotations

import contextlib
import functools
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from saguaro_dist.model import ModelRunner

pytestmark = pytest.mark.slow


@functools.cache
def rendezvous_root() -> tempfile.TemporaryDirectory:
    """This process's folder of rendezvous files, removed at exit (each used to leave a /tmp/gloo-* behind)."""
    return tempfile.TemporaryDirectory(prefix="gloo-")


def rendezvous() -> str:
    """Where spawned gloo ranks meet: a fresh file, not a TCP port (a probed free port can be taken by another
    test before the store binds it, and the TCP store's thread aborted a rank at teardown once in CI)."""
    return f"file://{tempfile.mkdtemp(dir=rendezvous_root().name)}/store"


@contextlib.contextmanager
def gloo_world(rank: int, world: int, init_method: str):
    """The gloo group of `world` spawned ranks; a barrier before the teardown, so no rank destroys the group
    while a peer still reads its last collective."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        yield dist.group.WORLD
        dist.barrier()
    finally:
        dist.destroy_process_group()


def workload(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill two sequences, score, truncate, then branch-decode from both: every logits tensor seen."""
    out = []
    runner.add("a")
    runner.add("b")
    out += runner.extend(["a", "b"], [[1, 5, 9, 13, 2, 7], [3, 4]], [6, 2])
    out += runner.extend(["b", "a"], [[8, 10, 11], [12]], [3, 1])
    runner.truncate("b", 3)
    state, logits = runner.branch_start(["a", "b", "a"], [7, 3, 4], [20, 21, 22])
    out += [logits, runner.branch_step(state, torch.tensor([30, 31, 32]))]
    return out


def _rank(rank: int, world: int, init_method: str, paths: list[str], indivisible: str, result_file: str):
    torch.set_num_threads(1)
    with gloo_world(rank, world, init_method) as group:
        results = [workload(ModelRunner(p, tp_group=group)) for p in paths]
        try:  # 3 key/value heads cannot be split over 2 ranks (nor 1 replicated on each)
            ModelRunner(indivisible, tp_group=group)
            results.append("no error")
        except ValueError as e:
            results.append(str(e))
        torch.save(results, f"{result_file}.{rank}")


@pytest.fixture(scope="module")
def odd_vocab_biased(tmp_path_factory):
    """Vocab 63 (not divisible by 2: the last vocab shard is padded) and biases on q/k/v/o (row-parallel bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # here, so the spawned ranks need not import it
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=63, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, mlp_bias=True, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("odd_vocab")
    model.save_pretrained(path)
    return path


def test_two_ranks_equal_one(tiny_checkpoint, odd_vocab_biased, tmp_path):
    """The draft's one KV head is replicated on both ranks (vLLM's KV head replicas)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(1)
    paths = [str(tiny_checkpoint("qwen3")), str(tiny_checkpoint("tied")), str(tiny_checkpoint("qwen2")),
             str(odd_vocab_biased), str(tiny_checkpoint("draft"))]
    indivisible = tmp_path / "three_kv_heads"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=6, num_key_value_heads=3)).save_pretrained(indivisible)
    mp.spawn(_rank, args=(2, rendezvous(), paths, str(indivisible), str(tmp_path / "out")), nprocs=2, join=True)
    rank0, rank1 = torch.load(tmp_path / "out.0"), torch.load(tmp_path / "out.1")
    assert "tensor parallel size 2 must divide num_key_value_heads=3 (or, with fewer KV heads" in rank0.pop()
    rank1.pop()
    for path, got0, got1 in zip(paths, rank0, rank1):
        want = workload(ModelRunner(path))
        for a, b, w in zip(got0, got1, want):
            assert a.shape == w.shape
            torch.testing.assert_close(a, w, atol=1e-5, rtol=0)
            torch.testing.assert_close(b, a, atol=0, rtol=0)
