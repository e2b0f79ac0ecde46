"""What only a GPU can check: the model on CUDA against transformers, NCCL collectives in the
tensor-parallel layers, and the verifier's law with its tensors on the device. CI has no GPU and
skips these; benchmarks/gpu_check.sh runs them (and the engine suites with SAGUARO_TEST_DEVICE=cuda)
on a lent one."""
from __future__ import annotations

import socket

import pytest
import torch
from scipy.stats import chisquare

from test_model_tp import workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cuda_logits_match_transformers(tiny_checkpoint, kind):
    from transformers import AutoModelForCausalLM

    from saguaro_dist.model import ModelRunner
    path = tiny_checkpoint(kind)
    tokens = [3, 17, 5, 42, 8, 1, 60, 2]
    runner = ModelRunner(path, device="cuda")
    runner.add("s")
    [ours] = runner.extend(["s"], [tokens], [len(tokens)])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()(torch.tensor([tokens])).logits[0]
    assert ours.device.type == "cuda"
    assert _relative_error(ours, ref) < 1e-4


def test_nccl_tensor_parallel_layers_match_the_plain_model(tiny_checkpoint):
    """One GPU holds one NCCL rank: the collectives of every parallel layer run for real (a world of
    one), and the logits equal the unsplit model's. Two ranks need two GPUs (NCCL refuses two ranks
    on one device); the gloo suite (test_model_tp.py) checks the splitting itself on the CPU."""
    import torch.distributed as dist

    from saguaro_dist.model import ModelRunner
    path = tiny_checkpoint("llama")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    try:
        split = workload(ModelRunner(path, device="cuda", tp_group=dist.group.WORLD))
    finally:
        dist.destroy_process_group()
    plain = workload(ModelRunner(path, device="cuda"))
    for a, b in zip(split, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_verify_on_cuda_samples_the_target_distribution():
    """Rejection sampling with p and q on the GPU (the generators stay on the CPU, as the engine's
    do): the first emitted token of 200k rows follows p, and a verifier that keeps every draft fails."""
    from saguaro_dist.spec import verify
    gen = torch.Generator().manual_seed(0)
    v, k, rows = 8, 2, 200_000
    p = torch.softmax(torch.randn(v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(v, generator=gen) * 1.5, -1)
    draft = torch.multinomial(q, rows * k, replacement=True, generator=gen).view(rows, k)
    p_all = p.expand(rows, k + 1, v).cuda()
    q_all = q.expand(rows, k, v).cuda()
    result = verify(p_all, draft.cuda(), q_all, [torch.Generator().manual_seed(1)] + [None] * (rows - 1))
    assert result.accepted.device.type == "cuda"
    first = torch.where(result.accepted > 0, draft[:, 0].cuda(), result.bonus).cpu()
    counts = torch.bincount(first, minlength=v).double()
    assert chisquare(counts.numpy(), (p.double() * rows).numpy()).pvalue > 1e-4
    keep_all = draft[:, 0]  # what a verifier that never rejects would emit: q's law, not p's
    wrong = torch.bincount(keep_all, minlength=v).double()
    assert chisquare(wrong.numpy(), (p.double() * rows).numpy()).pvalue < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_steps_replay_the_static_forward(tiny_checkpoint, dtype):
    """Decode and verify steps replayed from captured graphs (padded batches, a pool that grows and
    drops them, rows out of order) against the same static forward run without a capture (same
    kernels: equal up to rounding) and, in fp32, against the ordinary eager forward."""
    from test_step_graphs import static_runner, steps

    from saguaro_dist.model import ModelRunner
    path = tiny_checkpoint("llama")
    graphed = ModelRunner(path, device="cuda", dtype=dtype, cuda_graphs=True)
    got = steps(graphed)
    assert graphed.graphs._steps and all(s.graph is not None for s in graphed.graphs._steps.values())
    for a, b in zip(got, steps(static_runner(path, device="cuda", dtype=dtype))):
        torch.testing.assert_close(a, b)
    if dtype == torch.float32:
        for a, b in zip(got, steps(ModelRunner(path, device="cuda", dtype=dtype))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_cpu_draft_beside_a_cuda_target_keeps_greedy_exact(tiny_llama_pair, mode):
    """draft_device="cpu": proposals cross to the target's device; the tokens stay the target's own."""
    from saguaro_dist import LLM, SamplingParams
    target, draft = tiny_llama_pair
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[3, 17, 5, 42], [8, 1, 60, 2, 9]]
    outs = {}
    for name, kw in (("ar", dict(mode="ar")), (mode, dict(mode=mode, draft=draft, draft_device="cpu", k=3))):
        with LLM(model=target, device="cuda", draft_executor="thread", **kw) as llm:
            outs[name] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert outs[mode] == outs["ar"]


def test_a_draft_thread_runs_on_its_own_stream_and_stays_exact(tiny_llama_pair):
    """The one-host draft thread queues its kernels on a stream of its own (so a tree build can overlap
    the target's verify on one GPU), and the cross-stream hand-offs keep greedy ssd equal to ar."""
    from saguaro_dist import LLM, SamplingParams
    target, draft = tiny_llama_pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[3, 17, 5, 42], [8, 1, 60, 2, 9]]
    with LLM(model=target, device="cuda", mode="ar") as llm:
        want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    with LLM(model=target, draft=draft, device="cuda", mode="ssd", k=3, draft_executor="thread",
             tree_policy="always") as llm:
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        backend = llm._thread.engine.loop.draft
        seen = backend.submit(lambda _: torch.cuda.current_stream(), None).result()
    assert got == want
    assert seen == backend.stream.stream and seen != torch.cuda.default_stream()


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["split", "process", "thread"])
def test_truncated_sampling_on_one_gpu_follows_the_target(tmp_path, executor):
    """SSD with trees every round, top-k 4 at T = 0.8, target and draft on one GPU: the joint of the first
    three tokens is the target's (test_engine_sampling's chi-square), whichever executor holds the draft.
    Session 64 (an H200): under thread 3-24 of 20000 sequences held tokens the target gives no probability,
    in 5 runs of 5: both models' graphs shared one capture stream's cuBLAS workspace (CaptureStreams since).
    Session 65: it passed there."""
    from saguaro_dist import SamplingParams
    from test_engine_sampling import chi_square_pvalue, exact_joint, sample_joint, sampling_pair, ALPHA
    target, draft, model = sampling_pair(tmp_path)
    params = SamplingParams(temperature=0.8, top_k=4)
    counts, metrics = sample_joint(target, draft, params, k=1, fan_out=4, draft_executor=executor, tree_policy="always",
                                   device="cuda")
    assert metrics.cache_hits > 0, metrics
    p = chi_square_pvalue(counts, exact_joint(model, params))
    assert p > ALPHA, f"{executor}: chi-square p = {p:.2e}"


def test_each_runner_captures_its_graphs_on_streams_of_its_own(tiny_llama_pair):
    """A graph keeps the cuBLAS workspace of the stream it was captured on: the target's and the draft's
    graphs must not share one (as they did on torch.cuda.graph's process-wide capture stream;
    model/cuda_graphs.py: CaptureStreams), or their replays at once on one GPU race on it."""
    from saguaro_dist.model import ModelRunner
    target, draft = tiny_llama_pair
    runners = [ModelRunner(path, device="cuda", cuda_graphs=True) for path in (target, draft)]
    streams = [s for r in runners for s in (r.graphs._streams.capture, r.graphs._streams.warm_up)]
    assert len({s.cuda_stream for s in streams}) == 4
