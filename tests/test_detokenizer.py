"""Incremental detokenization gives the full decode, piece by piece, with no partial characters."""
from __future__ import annotations

import random
from dataclasses import replace

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


def test_a_stop_string_is_cut_or_kept_and_named(demo_llm):
    """vLLM's include_stop_str_in_output and stop_reason: the text ends before the stop string (the first
    listed, where one token completes two), or after it when asked, whole and streamed alike; the output names the string that ended it."""
    import asyncio

    from saguaro_dist import SamplingParams
    prompt, plain = "def add(a, b):", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = demo_llm.generate([prompt], plain)[0].text
    stop = full[5:8]
    at = full.index(stop)
    for keep, want in ((False, full[:at]), (True, full[:at + len(stop)])):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["\x00never", stop],
                                include_stop_str_in_output=keep)
        out = demo_llm.generate([prompt], params)[0]
        assert (out.text, out.stop_reason, out.finish_reason) == (want, stop, "stop")

        async def streamed():
            return [d async for d in demo_llm.stream(prompt, params)]
        deltas = asyncio.run(streamed())
        assert "".join(d.text for d in deltas) == want and deltas[-1].stop_reason == stop
    assert demo_llm.generate([prompt], plain)[0].stop_reason is None  # ended by length


def test_the_token_that_ends_a_request_is_not_text_unless_asked(demo_llm, tokenizer):
    """A stop_token_id ends the request and stays in token_ids, but its text is left out (vLLM's rule, so a
    stop token never leaks into the reply) unless include_stop_str_in_output; stop_reason names it."""
    from saguaro_dist import SamplingParams
    prompt = "def add(a, b):"
    tokens = demo_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    end = tokens[3]
    upto = tokens[:tokens.index(end) + 1]
    for keep, text_ids in ((False, upto[:-1]), (True, upto)):
        params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[end], include_stop_str_in_output=keep)
        out = demo_llm.generate([prompt], params)[0]
        assert out.token_ids == upto and out.stop_reason == end
        assert out.text == tokenizer.decode(text_ids, skip_special_tokens=True)


def test_a_prompt_ending_mid_character_gives_no_text_where_no_output_token_has_any(demo_llm, tokenizer):
    """A token-id prompt ending inside a character (the first byte of 語), whose only output token is a
    stop_token_id left out of the text: the text is "" (vLLM's), not the prompt's unfinished byte as U+FFFD."""
    from saguaro_dist import SamplingParams
    prompt = tokenizer.encode("Hello 日本") + tokenizer.encode("語", add_special_tokens=False)[:1]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    first = demo_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=1))
    end = first[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[end])
    out = demo_llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.token_ids == [end] and out.stop_reason == end and out.text == ""


def test_special_tokens_are_text_when_not_skipped(demo_llm, tokenizer):
    """skip_special_tokens=False (vLLM's) keeps special tokens in the text; the default leaves them out."""
    from saguaro_dist import SamplingParams
    eos = tokenizer.eos_token_id
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    skipped = demo_llm.generate(["x = 1"], SamplingParams(**forced))[0]
    kept = demo_llm.generate(["x = 1"], SamplingParams(**forced, skip_special_tokens=False))[0]
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text == tokenizer.eos_token * 3


def test_truncate_prompt_tokens_keeps_the_prompts_end(demo_llm, tokenizer):
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens are what the engine sees."""
    from saguaro_dist import SamplingParams
    ids = tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    return 0\n")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cut = demo_llm.generate(prompt_token_ids=[ids], sampling_params=replace(params, truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.token_ids == demo_llm.generate(prompt_token_ids=[ids[-5:]], sampling_params=params)[0].token_ids
    whole = demo_llm.generate(prompt_token_ids=[ids], sampling_params=replace(params, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == ids  # -1: the model's max length, longer than this prompt
