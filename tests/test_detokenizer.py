"""Incremental detokenization gives the full decode, piece by piece, with no partial characters."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from saguaro_dist.demo import PAIR_DIR
from saguaro_dist.engine.detokenizer import DecodeState, Detokenizer

TEXT = 'def café(x):\n    return "naïve ✓ 日本語 🙂" + x  # ok\n'


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(PAIR_DIR / "target"))


def pieces(detok: Detokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Decode ids as the engine does: a few tokens a round, the last round final."""
    state, out, end = DecodeState(), [], 0
    for n in chunks:
        end = min(end + n, len(ids))
        out.append(detok.decode_more(ids[:end], state, final=end == len(ids)))
        if end == len(ids):
            break
    return out


@pytest.mark.parametrize("seed", range(5))
def test_pieces_join_to_the_full_decode_and_are_never_taken_back(tokenizer, seed):
    rng = random.Random(seed)
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ids += [rng.randrange(len(tokenizer)) for _ in range(40)]  # arbitrary ids: partial UTF-8 bytes too
    got, full = pieces(detok, ids, [rng.randint(1, 5) for _ in range(len(ids))]), detok.decode(ids)
    assert "".join(got) == full
    for i in range(1, len(got)):  # what was streamed is never taken back: each prefix stays a prefix
        assert full.startswith("".join(got[:i]))


def test_the_engine_streams_what_the_full_decode_says(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert "".join(pieces(detok, ids, [1] * len(ids))) == TEXT


@pytest.fixture(scope="module")
def demo_llm():
    from saguaro_dist import LLM
    with LLM(model=str(PAIR_DIR / "target"), mode="ar", max_batch_size=2) as llm:
        yield llm


def count_decodes(llm) -> list[int]:
    """Calls of the engine's incremental decode from now on (one entry per call)."""
    detok, calls = llm._thread.engine.detok, []
    decode_more = detok.decode_more

    def spy(*args, **kwargs):
        calls.append(1)
        return decode_more(*args, **kwargs)
    detok.decode_more = spy
    return calls


def test_generate_decodes_once_at_the_end_streams_and_stop_strings_every_round(demo_llm, tokenizer):
    import asyncio

    from saguaro_dist import SamplingParams
    prompt, params = "def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = count_decodes(demo_llm)
    (out,) = demo_llm.generate([prompt], params)
    assert len(calls) == 1  # AR: 12 rounds, one decode
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)

    async def streamed() -> str:
        return "".join([d.text async for d in demo_llm.stream(prompt, params)])
    calls.clear()
    assert asyncio.run(streamed()) == out.text and len(calls) == 12
    calls.clear()
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["\x00never"])
    assert demo_llm.generate([prompt], stop)[0].text == out.text and len(calls) == 12


def test_a_final_only_stream_is_one_delta_decoded_once(demo_llm):
    """What the server's non-streamed requests read: generate()'s one decode, through the async API."""
    import asyncio

    from saguaro_dist import SamplingParams
    prompt, params = "def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = demo_llm.generate([prompt], params)
    calls = count_decodes(demo_llm)

    async def final_only() -> list:
        return [d async for d in demo_llm.stream(prompt, params, output_kind="final_only")]
    (delta,) = asyncio.run(final_only())
    assert len(calls) == 1
    assert delta.finished and delta.text == out.text and delta.token_ids == out.token_ids
    assert delta.metrics.time_to_first_token_s < delta.metrics.total_time_s


def test_a_stream_interval_holds_deltas_back_after_the_first_text(demo_llm):
    """Rounds closer than the interval share one delta once text went out; the text adds up the same."""
    import asyncio

    from saguaro_dist import SamplingParams
    prompt, params = "def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = demo_llm.generate([prompt], params)
    calls = count_decodes(demo_llm)

    async def streamed() -> list:
        return [d async for d in demo_llm.stream(prompt, params, stream_interval_s=60)]
    deltas = asyncio.run(streamed())
    first_text = next(i for i, d in enumerate(deltas) if d.text)
    assert deltas[first_text + 1:] == deltas[-1:] and deltas[-1].finished  # then only the end
    assert "".join(d.text for d in deltas) == out.text and sum((d.token_ids for d in deltas), []) == out.token_ids
    assert len(calls) == len(deltas)  # one decode per delta, not per round
