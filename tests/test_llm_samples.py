"""vLLM's output shape and n samples per prompt offline: RequestOutput.outputs (CompletionOutput per sample,
index order) beside the flat fields of earlier releases (sample 0's), SamplingParams.n (sample i of a seeded
request draws from seed + i, as the HTTP server's n), all samples aborted on Ctrl-C, and the server's own n
untouched (its SamplingParams keep n = 1: nothing is expanded twice)."""
from __future__ import annotations

import time

import pytest

from saguaro_dist import LLM, CompletionOutput, RequestOutput, SamplingParams
from saguaro_dist.serve.protocol import ChatCompletionRequest, CompletionRequest
from test_llm_progress import CtrlC
from test_serve_fixtures import make_tokenizer, write_llama

PROMPTS = [[3, 4, 5], [6, 7, 8, 9]]


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def ar(tiny_checkpoint):
    with LLM(model=tiny_checkpoint("llama"), mode="ar", max_model_len=64) as llm:
        yield llm


def generate(llm, params, prompts=PROMPTS):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def test_seeded_samples_differ_repeat_and_are_the_seed_plus_i_requests(ar):
    """n = 4 with a seed: four different samples per prompt, in input and index order, the same on a rerun,
    and sample i is the n = 1 request of seed + i (the server's rule)."""
    first, again = generate(ar, sampled(n=4, seed=7)), generate(ar, sampled(n=4, seed=7))
    assert [o.prompt_token_ids for o in first] == PROMPTS
    for out, rerun in zip(first, again):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3] and all(isinstance(c, CompletionOutput) for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) == 4
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in rerun.outputs]
    for i in range(4):
        single = generate(ar, sampled(seed=7 + i))
        assert [o.outputs[i].token_ids for o in first] == [o.token_ids for o in single]


def test_unseeded_samples_differ(ar):
    out = generate(ar, sampled(n=3, max_tokens=12), PROMPTS[:1])[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_greedy_samples_are_identical_and_plain_ar_under_speculation(tiny_llama_pair, ar):
    """Greedy n = 2 (as vLLM): two identical samples, token for token the plain AR decode, under SD."""
    target, draft = tiny_llama_pair
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in generate(ar, greedy)]
    with LLM(model=target, draft=draft, mode="sd", k=2, max_model_len=64) as sd:
        outs = generate(sd, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]


def test_sample_zero_is_the_flat_fields_and_logprobs_add_up(ar):
    """outputs[0] is what the flat fields (README, example.py) read; cumulative_logprob is the chosen
    tokens' log p summed when logprobs are asked for, None otherwise (vLLM's); the prompt is scored once."""
    out = generate(ar, sampled(n=2, seed=3, logprobs=2, prompt_logprobs=1, stop_token_ids=[9]), PROMPTS[:1])[0]
    first = out.outputs[0]
    assert out.finished and first.finished()
    assert (first.text, first.token_ids, first.finish_reason, first.logprobs, first.stop_reason) == (
        out.text, out.token_ids, out.finish_reason, out.logprobs, out.stop_reason)
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
        assert c.cumulative_logprob < 0 and len(c.logprobs) == len(c.token_ids)
    single = generate(ar, sampled(seed=3, logprobs=2, prompt_logprobs=1, stop_token_ids=[9]), PROMPTS[:1])[0]
    assert out.prompt_logprobs == single.prompt_logprobs and len(out.prompt_logprobs) == len(PROMPTS[0])
    assert single.outputs[0].token_ids == first.token_ids and single.request_id != out.request_id
    plain = generate(ar, sampled(n=2), PROMPTS[:1])[0]
    assert [c.cumulative_logprob for c in plain.outputs] == [None, None] and plain.logprobs is None


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2", None])
def test_n_is_validated(ar, n):
    with pytest.raises(ValueError, match=r"n \(samples per prompt\) must be an integer >= 1"):
        SamplingParams(n=n)
    assert SamplingParams(n=1).n == 1 and SamplingParams().n == 1


def test_a_seed_near_int64_max_takes_any_n(ar):
    """Sample i draws from seed + i wrapped into int64 (as the server's n): the last samples wrap to -2**63 ..."""
    outs = generate(ar, SamplingParams(seed=2**63 - 1, n=3, temperature=1.0, max_tokens=4), PROMPTS[:1])
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    wrapped = generate(ar, SamplingParams(seed=-2**63, temperature=1.0, max_tokens=4), PROMPTS[:1])
    assert outs[0].outputs[1].token_ids == wrapped[0].outputs[0].token_ids


def test_chat_takes_n(tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("h12_worded"), make_tokenizer(), hidden=32, layers=1, seed=3)
    with LLM(model=path, mode="ar") as llm:
        outs = llm.chat([[{"role": "user", "content": "hello world"}]] * 2, sampled(n=3, seed=1, max_tokens=6),
                        use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3] and [c.index for c in outs[1].outputs] == [0, 1, 2]
    assert all(isinstance(c.text, str) for o in outs for c in o.outputs)


def test_an_interrupt_aborts_every_sample(tiny_checkpoint):
    """Ctrl-C in generate() with n = 64 samples of one prompt, two at a time: none runs on afterwards."""
    long = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, n=64, seed=0)
    with LLM(model=tiny_checkpoint("llama"), mode="ar", max_batch_size=2, max_model_len=256) as llm:
        with CtrlC(llm), pytest.raises(KeyboardInterrupt):
            generate(llm, long, PROMPTS[:1])
        deadline = time.monotonic() + 2.0
        while (llm.load.num_running or llm.load.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.load.num_running == llm.load.num_waiting == 0


@pytest.mark.parametrize("request_type, body", [(CompletionRequest, {"prompt": "x"}),
                                                (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})])
def test_the_servers_sampling_params_keep_n_1(request_type, body):
    """The server expands its n into n jobs itself (serve/state.py); the SamplingParams it builds must
    not carry n, or LLM would expand it again."""
    request = request_type(**body, n=3, seed=5, temperature=1.0)
    assert request.n == 3 and request.sampling_params(8).n == 1


def test_the_old_flat_constructor_still_builds_a_whole_output(ar):
    """RequestOutput(request_id, prompt, prompt_token_ids, text, token_ids, finish_reason, metrics, logprobs, ...)
    as before: its outputs are that one sample (callers and tests rebuild outputs this way)."""
    out = generate(ar, sampled(seed=2, logprobs=0), PROMPTS[:1])[0]
    rebuilt = RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, out.text, out.token_ids,
                            out.finish_reason, out.metrics, out.logprobs, out.prompt_logprobs, out.stop_reason)
    assert rebuilt.outputs == out.outputs and rebuilt.finished and rebuilt == out
