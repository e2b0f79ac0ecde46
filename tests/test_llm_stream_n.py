"""LLM.stream with SamplingParams.n > 1 (vLLM's AsyncLLM with n): RequestOutput items whose CompletionOutput
index names the sample, each sample's deltas adding up to what generate() returns for the same params (seeded
sample i draws from seed + i; greedy samples are the plain decode, under speculation too), FINAL_ONLY as one
RequestOutput of every sample, and closing early or abort() ending every sample. n = 1 streams StreamDeltas
as before."""
from __future__ import annotations

import asyncio
import time

import pytest

from saguaro_dist import LLM, RequestOutput, SamplingParams
from saguaro_dist.engine.llm import StreamDelta
from test_serve_fixtures import make_tokenizer, write_llama

PROMPT = "the cat sat on the mat"
# A closed or aborted stream's samples: so long that none ends by length while the abort is on its way, even on
# a loaded box (~11 ms a step here: each of two running samples has ~10 s before it could end).
LONG_MAX_TOKENS, LONG_MODEL_LEN = 2000, 2048


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) tiny Llamas with a word-level tokenizer: streamed text, not only ids."""
    tokenizer = make_tokenizer()
    target = write_llama(tmp_path_factory.mktemp("h1n_target"), tokenizer, hidden=32, layers=1, seed=3,
                         max_positions=LONG_MODEL_LEN)
    draft = write_llama(tmp_path_factory.mktemp("h1n_draft"), tokenizer, hidden=32, layers=1, seed=4,
                        max_positions=LONG_MODEL_LEN)
    return target, draft


@pytest.fixture(scope="module")
def sd(pair):
    target, draft = pair
    with LLM(model=target, draft=draft, mode="sd", k=2, max_model_len=128) as llm:
        yield llm


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 10, "ignore_eos": True, **kw})


def collect(llm: LLM, params: SamplingParams, **kw) -> list:
    async def run():
        return [item async for item in llm.stream(PROMPT, params, **kw)]
    return asyncio.run(run())


def by_sample(items: list[RequestOutput], n: int) -> list[dict]:
    """Each sample's deltas joined: text, token ids, logprobs, and its last delta's fields."""
    samples = [{"text": "", "token_ids": [], "logprobs": [], "last": None} for _ in range(n)]
    for item in items:
        assert isinstance(item, RequestOutput) and len(item.outputs) == 1
        c = item.outputs[0]
        s = samples[c.index]
        assert s["last"] is None, "a delta after the sample's last one"
        s["text"] += c.text
        s["token_ids"] += c.token_ids
        s["logprobs"] += c.logprobs or []
        if c.finish_reason is not None:
            s["last"] = c
    return samples


def test_seeded_samples_stream_what_generate_returns(sd):
    """n = 3 seeded, with logprobs: every sample's deltas add up to generate()'s sample (text, tokens, logprobs,
    finish, cumulative log p); only the very last item is finished; the request id is the stream's."""
    params = sampled(n=3, seed=11, logprobs=1, stop_token_ids=[7])
    items = collect(sd, params, request_id="three")
    want = sd.generate(PROMPT, params, use_tqdm=False)[0]
    assert [item.finished for item in items] == [False] * (len(items) - 1) + [True]
    assert {item.request_id for item in items} == {"three"} and {item.prompt for item in items} == {PROMPT}
    assert all(item.prompt_token_ids == want.prompt_token_ids for item in items)
    for got, c in zip(by_sample(items, 3), want.outputs):
        assert (got["text"], got["token_ids"], got["logprobs"]) == (c.text, c.token_ids, c.logprobs)
        last = got["last"]
        assert (last.finish_reason, last.stop_reason) == (c.finish_reason, c.stop_reason)
        assert last.cumulative_logprob == pytest.approx(c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in want.outputs}) > 1  # the samples differ: the indices matter
    assert all((item.metrics is not None) == item.outputs[0].finished() for item in items)  # a sample's, at its end


def test_greedy_samples_stream_the_plain_decode_under_speculation(sd, pair):
    """Greedy n = 2 under SD: both samples' streams are token for token the autoregressive decode."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model=pair[0], mode="ar", max_model_len=128) as ar:
        want = ar.generate(PROMPT, greedy, use_tqdm=False)[0]
    items = collect(sd, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2), stream_interval_s=0.0)
    assert [(s["text"], s["token_ids"]) for s in by_sample(items, 2)] == [(want.text, want.token_ids)] * 2


def test_final_only_is_one_output_of_every_sample_as_generate_returns(sd):
    params = sampled(n=4, seed=3)
    items = collect(sd, params, output_kind="final_only")
    want = sd.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(items) == 1 and items[0].finished and [c.index for c in items[0].outputs] == [0, 1, 2, 3]
    assert [(c.text, c.token_ids, c.finish_reason) for c in items[0].outputs] == [
        (c.text, c.token_ids, c.finish_reason) for c in want.outputs]


def test_one_sample_still_streams_stream_deltas(sd):
    """n = 1 (the server's streams, bench, every caller before n): StreamDelta items, as before."""
    items = collect(sd, sampled(seed=5))
    want = sd.generate(PROMPT, sampled(seed=5), use_tqdm=False)[0]
    assert all(isinstance(item, StreamDelta) for item in items)
    assert "".join(d.text for d in items) == want.text and items[-1].finished


async def settled(llm: LLM, timeout_s: float = 5.0) -> bool:
    """Until the engine holds nothing, with the event loop still running: once asyncio.run returns, a closed
    loop fails the listeners, and the engine drops their requests whether or not the stream aborted them."""
    deadline = time.monotonic() + timeout_s
    while (llm.load.num_running or llm.load.num_waiting) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return llm.load.num_running == llm.load.num_waiting == 0


@pytest.fixture(scope="module")
def narrow(pair):
    """Two batch slots: of n = 4 samples, two wait while two run."""
    with LLM(model=pair[0], mode="ar", max_batch_size=2, max_model_len=LONG_MODEL_LEN) as llm:
        yield llm


def test_closing_the_stream_early_aborts_every_sample(narrow):
    """Not one of the four samples runs to its end: together they make fewer tokens than one would."""
    long = sampled(n=4, max_tokens=LONG_MAX_TOKENS)
    before = narrow.metrics.generated_tokens

    async def first_only():
        stream = narrow.stream(PROMPT, long, request_id="closed")
        first = await anext(stream)
        await stream.aclose()
        return first, await settled(narrow, timeout_s=20)
    first, done = asyncio.run(first_only())
    assert first.outputs[0].token_ids and done, "samples of a closed stream ran on"
    assert narrow.metrics.generated_tokens - before < long.max_tokens
    assert len(collect(narrow, sampled(n=2), request_id="closed")) >= 2  # the id is free again


def test_abort_ends_every_sample_and_the_id_is_held_meanwhile(narrow):
    """abort(request id): each sample's last delta says "abort"; a second stream of the id is refused while
    the first runs."""
    async def run():
        stream = narrow.stream(PROMPT, sampled(n=3, max_tokens=LONG_MAX_TOKENS), request_id="held")
        items = [await anext(stream)]
        with pytest.raises(ValueError, match="already running"):
            await anext(narrow.stream(PROMPT, sampled(n=2), request_id="held"))
        narrow.abort("held")
        items += [item async for item in stream]
        return items, await settled(narrow)
    items, done = asyncio.run(run())
    assert [s["last"].finish_reason for s in by_sample(items, 3)] == ["abort"] * 3 and done


@pytest.mark.slow
def test_samples_stream_on_ray_and_a_closed_stream_aborts_them_all(ray_cluster, pair):
    """On the Ray engine each sample is submitted by an actor call of its own (awaited, in index order): the
    streams add up to generate()'s samples, and closing one stream early aborts every sample there too."""
    params = sampled(n=3, seed=21)
    with LLM(model=pair[0], mode="ar", cluster="auto", max_batch_size=2, max_model_len=LONG_MODEL_LEN) as llm:
        want = [(c.text, c.token_ids) for c in llm.generate(PROMPT, params, use_tqdm=False)[0].outputs]
        assert [(s["text"], s["token_ids"]) for s in by_sample(collect(llm, params), 3)] == want

        before = llm.metrics.generated_tokens

        async def first_only():
            stream = llm.stream(PROMPT, sampled(n=4, max_tokens=LONG_MAX_TOKENS))
            first = await anext(stream)
            await stream.aclose()
            return first, await settled(llm, timeout_s=20)
        first, done = asyncio.run(first_only())
        assert first.outputs[0].token_ids and done, "samples of a closed stream ran on"
        assert llm.metrics.generated_tokens - before < LONG_MAX_TOKENS  # not one sample ran to its end
