"""finish_reason / stop_reason as vLLM v1 gives them (vllm/v1/core/sched/utils.py check_stop), in AR, SD and
SSD alike. vLLM's engine core checks a new token for EOS first ("stop", no stop_reason), then stop_token_ids
("stop", the id as stop_reason), then length (max_tokens, or the context's end: "length"); its output processor
then looks for stop strings in the text (a stop-terminated request's last token left out), and one found there
makes it "stop" (the string as stop_reason) even where length ended it. A speculative round that gains tokens
past the end is cut back to AR's answer."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import PAIR_DIR

PROMPT = "def add(a, b):"
AT = 6  # the token the forced end lands on
MODES = ("ar", "sd", "ssd")
FORCE = 100.0  # a logit bias no other token beats


@pytest.fixture(scope="module")
def engines():
    target, draft = str(PAIR_DIR / "target"), str(PAIR_DIR / "draft")
    # one context for all (a speculative engine once kept K + 1 = 5 positions of it: 64 stood for ar's 59)
    with (LLM(model=target, mode="ar", max_model_len=59) as ar,
          LLM(model=target, draft=draft, mode="sd", k=4, max_model_len=59) as sd,
          LLM(model=target, draft=draft, mode="ssd", k=4, max_model_len=59) as ssd):
        yield {"ar": ar, "sd": sd, "ssd": ssd}


def eos(llm: LLM) -> int:
    return min(llm.eos_token_ids)


def plain_token(llm: LLM) -> int:
    """A token with text of its own, neither EOS nor special: a stop_token_id whose text can show."""
    return llm.tokenizer.encode(" the", add_special_tokens=False)[-1]


def forced(token: int, max_tokens: int | None, **kw) -> SamplingParams:
    """`token` barred for the first AT - 1 tokens (min_tokens), then chosen: it lands exactly at token AT."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=AT - 1, logit_bias={token: FORCE}, **kw)


def run(llm: LLM, params: SamplingParams, prompt_token_ids: list[int] | None = None):
    if prompt_token_ids is not None:
        return llm.generate(prompt_token_ids=[prompt_token_ids], sampling_params=params, use_tqdm=False)[0]
    return llm.generate([PROMPT], params, use_tqdm=False)[0]


def in_every_mode(engines, make_params, want: tuple[str, int | str | None], length: int, prompt_ids=None):
    """Each mode's output ends as `want` (finish_reason, stop_reason) after `length` tokens, and SD / SSD give
    AR's tokens and text (prompt_ids(llm): a prompt of token ids, per engine)."""
    outs = {}
    for mode in MODES:
        llm = engines[mode]
        out = run(llm, make_params(llm), None if prompt_ids is None else prompt_ids(llm))
        assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == (*want, length), mode
        outs[mode] = out
    ar = outs["ar"]
    for mode in MODES[1:]:
        assert (outs[mode].token_ids, outs[mode].text) == (ar.token_ids, ar.text), mode
    return ar


def test_eos_as_the_max_tokens_th_token_is_stop(engines):
    """vLLM checks EOS before length: an EOS that is also the last allowed token ends it as "stop"."""
    out = in_every_mode(engines, lambda llm: forced(eos(llm), AT), ("stop", None), AT)
    assert out.token_ids[-1] == eos(engines["ar"])


def test_eos_before_max_tokens_is_stop(engines):
    out = in_every_mode(engines, lambda llm: forced(eos(llm), AT + 3), ("stop", None), AT)
    assert out.token_ids[-1] == eos(engines["ar"])


def test_ignored_eos_runs_to_length(engines):
    out = in_every_mode(engines, lambda llm: forced(eos(llm), AT + 2, ignore_eos=True), ("length", None), AT + 2)
    assert out.token_ids[AT - 1:] == [eos(engines["ar"])] * 3


def test_a_stop_token_as_the_max_tokens_th_token_is_stop_naming_it(engines):
    """Stop tokens come before length too: "stop", the id as stop_reason, its text left out."""
    llm = engines["ar"]
    token = plain_token(llm)
    out = in_every_mode(engines, lambda llm: forced(token, AT, stop_token_ids=[token]), ("stop", token), AT)
    assert out.token_ids[-1] == token
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])


def test_a_stop_token_before_max_tokens_is_stop_naming_it(engines):
    llm = engines["ar"]
    token = plain_token(llm)
    out = in_every_mode(engines, lambda llm: forced(token, AT + 3, stop_token_ids=[token]), ("stop", token), AT)
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])  # a stop token's text is not output


def test_a_stop_string_completed_by_the_max_tokens_th_token_is_stop(engines):
    """The output processor's stop-string check comes after the engine core's length check, and overrides it."""
    llm = engines["ar"]
    tokens = run(llm, SamplingParams(temperature=0, max_tokens=3 * AT, ignore_eos=True)).token_ids
    m, stop = next((m, text[-2:]) for m in range(AT, 3 * AT) if (text := llm.tokenizer.decode(tokens[:m]))
                   and len(text.strip()) >= 2 and text[-2:] not in text[:-1])
    out = in_every_mode(engines, lambda llm: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop=[stop]),
                        ("stop", stop), m)
    assert out.token_ids == tokens[:m] and not out.text.endswith(stop)


def test_a_stop_token_whose_text_holds_a_stop_string_ends_as_the_token(engines):
    """A stop-terminated request's last token is left out of the text (vLLM's detokenizer skips it), so a stop
    string only its text would complete is never found: the stop token names the end."""
    llm = engines["ar"]
    token = plain_token(llm)
    stop = llm.tokenizer.decode([token]).strip()
    out = in_every_mode(engines, lambda llm: forced(token, AT, stop_token_ids=[token], stop=[stop]),
                        ("stop", token), AT)
    assert out.token_ids[-1] == token


def test_eos_that_fills_the_context_is_stop(engines):
    """max_tokens=None runs to the context's end (LLM.max_model_len, every mode's: a speculative round's
    positions past it run in the target's position slack); an EOS that fills it is still "stop" (EOS comes
    before vLLM's max_model_len check)."""
    def prompt(llm: LLM) -> list[int]:
        ids = llm.tokenizer.encode(PROMPT * 20, add_special_tokens=False)
        return ids[:llm.max_model_len - AT]
    out = in_every_mode(engines, lambda llm: forced(eos(llm), None), ("stop", None), AT, prompt)
    assert out.token_ids[-1] == eos(engines["ar"])


def test_a_streams_last_delta_carries_it(engines):
    """LLM.stream's last delta, what the HTTP server's finish_reason is read from."""
    import asyncio
    llm = engines["sd"]

    async def last():
        return [d async for d in llm.stream(PROMPT, forced(eos(llm), AT))][-1]
    delta = asyncio.run(last())
    assert (delta.finish_reason, delta.stop_reason) == ("stop", None)
