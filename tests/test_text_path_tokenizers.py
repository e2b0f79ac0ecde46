"""The text path (incremental decode, stop strings, streamed deltas) against vLLM's, with real offline
tokenizers: a byte-level BPE and a SentencePiece-like BPE with byte fallback (tests/offline_tokenizers.py).

vLLM's reference here is its FastIncrementalDetokenizer's algorithm: tokenizers' DecodeStream primed with the
prompt's end, one token at a time (the shortest end of 4..23 tokens that decodes whole)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from offline_tokenizers import BYTE_LEVEL_SPECIALS, SPM_ADDED, byte_level_bpe, sentencepiece_bpe, wordpiece
from tokenizers.decoders import DecodeStream

from saguaro_dist.engine.detokenizer import DecodeState, Detokenizer, find_stop, stable_prefix
from saguaro_dist.engine.engine import Engine
from saguaro_dist.engine.metrics import EngineMetrics
from saguaro_dist.engine.sequence import OutputKind, Sequence
from saguaro_dist.sampling_params import SamplingParams

PROMPT = "Hello world, the user said"
ADDED = BYTE_LEVEL_SPECIALS[1:] + SPM_ADDED  # the tokenizers' added special tokens, not their EOS
CJK_EMOJI = " 日本語 🙂 naïve \u2013 end"


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tok(request):
    return byte_level_bpe() if request.param == "byte_level" else sentencepiece_bpe()


@pytest.fixture(scope="module")
def spm():
    return sentencepiece_bpe()


def vllm_text(tokenizer, prompt: list[int], output: list[int], skip_special_tokens: bool = True) -> str:
    """vLLM's output text of `output` after `prompt`: DecodeStream primed with the prompt's end."""
    raw, suffix = tokenizer.backend_tokenizer, prompt
    if len(prompt) > 4:
        suffix = next((prompt[-n:] for n in range(4, min(len(prompt) + 1, 24)) if "\ufffd" not in raw.decode(prompt[-n:])), prompt)
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    for t in suffix:
        stream.step(raw, t)
    return "".join(_protected_step(stream, raw, t, skip_special_tokens) or "" for t in output)


def _protected_step(stream: DecodeStream, raw, token: int, skip_special_tokens: bool) -> str | None:
    """vLLM's: a stream whose next text would not extend its prefix (an output completing the prompt's last
    character) starts afresh, without context. Resets the stream in place (its state is the ids it holds)."""
    try:
        return stream.step(raw, token)
    except Exception as err:
        if "Invalid prefix" not in str(err):
            raise
        stream.__init__(skip_special_tokens=skip_special_tokens)
        return stream.step(raw, token)


def text_engine(tokenizer, eos: set[int]) -> Engine:
    """The engine's text path alone (_append, stop strings, deltas) over a real tokenizer; rounds are
    handed their tokens by the test instead of a model."""
    engine = Engine.__new__(Engine)
    engine.metrics, engine.detok, engine.eos_token_ids, engine._emitted = EngineMetrics(), Detokenizer(tokenizer), eos, {}
    engine.context_len = 1 << 20  # no context end inside these texts
    engine.eos_token_id = tokenizer.eos_token_id  # the EOS that ends with no stop_reason
    return engine


def run_rounds(engine: Engine, prompt: list[int], output: list[int], params: SamplingParams, per_round: int,
               kind: OutputKind = OutputKind.DELTA) -> tuple[Sequence, list[str]]:
    """Feed output to a sequence `per_round` tokens a round (a speculative round's K + 1 at most) and
    collect the streamed text deltas. max_tokens ends the output with its last token at the latest."""
    params = replace(params, max_tokens=min(params.max_tokens, len(output)))
    s, deltas = Sequence(0, "r", list(prompt), params, output_kind=kind), []
    for i in range(0, len(output), per_round):
        engine._append(s, output[i:i + per_round], now=0.0)
        if engine._due(s, 0.0):
            deltas.append(engine._delta(s).text_delta)
        if s.finished:
            break
    return s, deltas


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 200), ignore_eos=kw.pop("ignore_eos", True), **kw)


# ---- incremental decode ---------------------------------------------------------------------------------

@pytest.mark.parametrize("per_round", [1, 2, 5])
def test_streamed_text_is_vllms_and_joins_to_the_final_text(tok, per_round):
    """CJK and emoji split over byte tokens, one or several tokens a round: the deltas join to the final text,
    which is vLLM's (for SentencePiece: with the first word's leading space, decoded after the prompt)."""
    prompt, output = tok.encode(PROMPT), tok.encode(CJK_EMOJI, add_special_tokens=False)
    s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(), per_round)
    assert "".join(deltas) == s.text == vllm_text(tok, prompt, output)
    assert all("\ufffd" not in d for d in deltas)  # no partial character is ever streamed


@pytest.mark.parametrize("seed", range(6))
def test_random_text_in_random_rounds_is_vllms(tok, seed):
    """Words of ASCII, accents, CJK, emoji and special tokens, in rounds of 1..5 tokens: vLLM's text."""
    import random
    rng = random.Random(seed)
    words = ["the", "fox", "caf\u00e9", "\u65e5\u672c\u8a9e", "\U0001f642", "\u2013", "\ufffd", *ADDED[:2], "\n", "a,b"]
    text = "".join(rng.choice(["", " "]) + rng.choice(words) for _ in range(30))
    prompt, output = tok.encode(PROMPT), tok.encode(text, add_special_tokens=False)
    engine, s, deltas = text_engine(tok, set()), Sequence(0, "r", prompt, params(max_tokens=len(output))), []
    while len(s.output_token_ids) < len(output):
        done = len(s.output_token_ids)
        engine._append(s, output[done:done + rng.randint(1, 5)], now=0.0)
        deltas.append(engine._delta(s).text_delta)
    assert "".join(deltas) == s.text == vllm_text(tok, prompt, output, skip_special_tokens=True)


def test_the_first_sentencepiece_word_keeps_its_space_after_the_prompt(spm):
    """vLLM decodes the first output tokens after the prompt's end: "▁world" there is " world", where a decode
    of the output alone drops the space (Llama-2's decoder strips a string's first space)."""
    prompt, output = spm.encode("Hello"), spm.encode(" world is here", add_special_tokens=False)
    assert spm.convert_ids_to_tokens(output[:1]) == ["\u2581wor"]
    for kind in OutputKind:
        s, deltas = run_rounds(text_engine(spm, set()), prompt, output, params(), 1, kind)
        assert s.text == "".join(deltas) == " world is here" == vllm_text(spm, prompt, output)


@pytest.mark.parametrize("per_round", [1, 3])
def test_a_prompt_ending_mid_character(tok, per_round):
    """A prompt ending inside a character, as vLLM's stream reads it: the output's first piece completes
    that character, or shows its bytes as U+FFFD."""
    char = tok.encode(" \u65e5", add_special_tokens=False)
    prompt = tok.encode("Hi") + char[:-1]  # the last byte left off
    output = tok.encode(" ok then", add_special_tokens=False)
    s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(), per_round)
    assert s.text == "".join(deltas) == vllm_text(tok, prompt, output) and s.text.endswith("\ufffd ok then")
    output = char[-1:] + tok.encode(" ok", add_special_tokens=False)
    s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(), per_round)
    assert s.text == vllm_text(tok, prompt, output) == "".join(deltas) and s.text.endswith("\u65e5 ok")


def test_no_output_text_after_a_prompt_ending_mid_character_is_empty(tok):
    """A prompt ending inside a character, then no output token with text (an EOS or a stop_token_id, left out
    of the text; only skipped special tokens): the text is vLLM's "", not the prompt's unfinished bytes as
    U+FFFD (old: "\\ufffd"). An output byte completing that character is still the output's text, and one
    continuing it, cut by max_tokens, still ends the text as U+FFFD (as any output cut mid-character)."""
    char = tok.encode(" \u65e5", add_special_tokens=False)  # " " and the three bytes of 日
    prompt, eos = tok.encode("Hi") + char[:-1], tok.eos_token_id
    special = tok.convert_tokens_to_ids([t for t in tok.all_special_tokens if t in ADDED][0])
    for output, p, text_ids in (([eos], params(ignore_eos=False), []),
                                ([char[-1], eos], params(stop_token_ids=[char[-1]]), []),
                                ([special, special], params(), [special, special])):
        s, deltas = run_rounds(text_engine(tok, {eos}), prompt, output, p, 1)
        assert s.text == "".join(deltas) == vllm_text(tok, prompt, text_ids) == ""
    s, deltas = run_rounds(text_engine(tok, {eos}), prompt, [char[-1], eos], params(ignore_eos=False), 1)
    assert s.text == "".join(deltas) == vllm_text(tok, prompt, [char[-1]]) and s.text.endswith("\u65e5")
    s, deltas = run_rounds(text_engine(tok, {eos}), prompt[:-1], [char[-2]], params(max_tokens=1), 1)
    assert s.text == "".join(deltas) and set(s.text) == {"\ufffd"} and vllm_text(tok, prompt[:-1], [char[-2]]) == ""


@pytest.mark.parametrize("per_round", [1, 3])
def test_a_prompt_with_a_whole_then_an_unfinished_byte_fallback_character(spm, per_round):
    """A byte-fallback decode shows a run of bytes not yet valid as one U+FFFD a byte, so a held step's text
    (the output's first byte of 3 after the prompt's) does not start with the context " 日": that is no
    token merged across the prompt's end, and must not reset the decode (old: dropped the prompt's first
    byte of 柙, giving "\\ufffd\\ufffdk"; vLLM's stream checks only a text it gives, as a whole decode reads)."""
    ids = spm.encode(" \u65e5\u67d9k", add_special_tokens=False)  # " ", 日's 3 bytes, 柙's 3 bytes, "k"
    prompt, output = spm.encode("Hi") + ids[:5], ids[5:]
    s, deltas = run_rounds(text_engine(spm, set()), prompt, output, params(), per_round)
    assert s.text == "".join(deltas) == vllm_text(spm, prompt, output) == "\u67d9k"
    assert spm.decode(prompt + output).endswith(" \u65e5\u67d9k")


def test_a_real_replacement_character_is_text(tok):
    """U+FFFD in the text itself (its three bytes) waits one token as a possible partial character, then is
    text like any other, mid-text and at the end."""
    prompt = tok.encode(PROMPT)
    for tail in (" a\ufffdb c", " a\ufffd"):
        output = tok.encode(tail, add_special_tokens=False)
        for per_round in (1, 3):
            s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(), per_round)
            assert "".join(deltas) == s.text and s.text.lstrip(" ") == tail.lstrip(" ")


def test_a_partial_character_cut_by_max_tokens_ends_the_text_as_u_fffd(tok):
    """Where max_tokens ends the output inside a character, the text ends with U+FFFD, as a whole decode
    has it (vLLM drops it instead: it never flushes what waits at the end); the deltas still join to it."""
    prompt, output = tok.encode(PROMPT), tok.encode(" \U0001f642", add_special_tokens=False)
    s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(max_tokens=len(output) - 1), 1)
    assert s.text.endswith("\ufffd") and "".join(deltas) == s.text
    assert vllm_text(tok, prompt, output[:-1]) == s.text.rstrip("\ufffd")


@pytest.mark.parametrize("per_round", [1, 3])
def test_no_whole_text_clean_up_of_tokenization_spaces(per_round):
    """A tokenizer configured with clean_up_tokenization_spaces (BERT's) rewrites " ' " as "'" in a whole
    decode, which a piece-by-piece one cannot: vLLM's text has no such clean-up, and neither does ours, so a
    stream and a whole (FINAL_ONLY) decode of one output agree."""
    tok = wordpiece()
    prompt, output = tok.encode("the user said", add_special_tokens=False), tok.encode("isn't it", add_special_tokens=False)
    streamed, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(), per_round)
    whole, _ = run_rounds(text_engine(tok, set()), prompt, output, params(), per_round, OutputKind.FINAL_ONLY)
    assert whole.text == streamed.text == "".join(deltas) == vllm_text(tok, prompt, output) == " isn ' t it"


# ---- special tokens -------------------------------------------------------------------------------------

def test_special_tokens_mid_text_kept_or_skipped(tok):
    """skip_special_tokens False keeps added special tokens mid-text, adjacent ones with no space between
    (a fast tokenizer's decode; vLLM's spaces_between_special_tokens changes nothing there); True drops them."""
    specials = [t for t in tok.all_special_tokens if t in ADDED]
    text = f" one{specials[0]}{specials[0]}{specials[1]} two"
    prompt, output = tok.encode(PROMPT), tok.encode(text, add_special_tokens=False)
    for skip in (False, True):
        s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(skip_special_tokens=skip), 2)
        assert "".join(deltas) == s.text == vllm_text(tok, prompt, output, skip_special_tokens=skip)
    assert specials[0] * 2 + specials[1] in vllm_text(tok, prompt, output, skip_special_tokens=False)


# ---- stop strings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("per_round", [1, 4])
def test_a_stop_string_over_several_tokens(tok, keep, per_round):
    """A stop string spanning tokens (here "語 🙂", bytes of two characters) ends the text before it, or after
    it with include_stop_str_in_output; what streamed before joins to the final text."""
    prompt, output = tok.encode(PROMPT), tok.encode(CJK_EMOJI, add_special_tokens=False)
    want = vllm_text(tok, prompt, output)
    stop = "\u8a9e \U0001f642"
    at = want.index(stop)
    s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(stop=[stop], include_stop_str_in_output=keep),
                           per_round)
    assert s.text == want[:at + len(stop) if keep else at] == "".join(deltas)
    assert s.stop_reason == stop and s.finish_reason.value == "stop"


def test_a_kept_stop_string_holds_no_text_back(tok):
    """include_stop_str_in_output: the text up to a stop string's end is output whatever follows, so nothing
    waits for the stop string to complete (vLLM holds nothing back then); without it, len(stop) - 1 waits."""
    prompt, output = tok.encode(PROMPT), tok.encode(" alpha beta gamma delta", add_special_tokens=False)
    stop = "a never-matching stop string"
    for keep, held in ((True, 0), (False, len(stop) - 1)):
        engine = text_engine(tok, set())
        s = Sequence(0, "r", list(prompt), params(stop=[stop], include_stop_str_in_output=keep))
        engine._append(s, output, now=0.0)
        assert len(s.text) - len(engine._delta(s).text_delta) == min(held, len(s.text))


def test_a_stop_string_inside_a_character_boundary(tok):
    """A stop string that is the tail of one character and the head of the next ("本語"'s bytes straddle
    tokens) matches only once both characters are whole; the partial bytes are never matched as U+FFFD."""
    prompt, output = tok.encode(PROMPT), tok.encode(CJK_EMOJI, add_special_tokens=False)
    s, deltas = run_rounds(text_engine(tok, set()), prompt, output, params(stop=["\u672c\u8a9e"]), 1)
    assert s.text.rstrip(" ").endswith("\u65e5") and "".join(deltas) == s.text and s.stop_reason == "\u672c\u8a9e"
    s, _ = run_rounds(text_engine(tok, set()), prompt, output, params(stop=["\ufffd"]), 1)
    assert s.stop_reason is None and s.text == vllm_text(tok, prompt, output)


def test_stop_and_no_stop_requests_read_the_same_text(spm):
    """A stop string that never matches changes nothing in the text, the first word's space included."""
    prompt, output = spm.encode("Hello"), spm.encode(" world is here", add_special_tokens=False)
    plain, _ = run_rounds(text_engine(spm, set()), prompt, output, params(), 2)
    stopped, _ = run_rounds(text_engine(spm, set()), prompt, output, params(stop=["\x00never"]), 2)
    assert stopped.text == plain.text == " world is here"


# ---- pure parts -----------------------------------------------------------------------------------------

def test_find_stop_and_stable_prefix_on_text():
    assert find_stop("ab STOP cd", ("STOP",)) == (3, "STOP")
    assert find_stop("ab STOP cd", ("STOP",), keep=True) == (7, "STOP")
    assert stable_prefix("abc\ufffd", ()) == "abc"
    assert stable_prefix("abcST", ("STOP",)) == "ab"


def test_decode_more_reads_after_the_prompt_tail(spm):
    detok = Detokenizer(spm)
    prompt, output = spm.encode("Hello"), spm.encode(" world", add_special_tokens=False)
    state = DecodeState.after_prompt(prompt)
    assert detok.decode_more(output, state, final=True) == " world"
    assert detok.decode_more(output, DecodeState(), final=True) == "world"  # no prompt: a string's start


# ---- through LLM: a real engine (SD: several tokens a round) over a model with the SentencePiece tokenizer ----

@pytest.fixture(scope="module")
def spm_llm(tmp_path_factory, spm):
    from engine_helpers import llama_config, save_model, save_perturbed

    from saguaro_dist import LLM
    root = tmp_path_factory.mktemp("spm_pair")
    target = save_model(root / "target", llama_config(len(spm), 32, 2), seed=3, sharpen=1.0)
    save_perturbed(root / "draft", target, seed=4, noise=0.05)
    for path in ("target", "draft"):
        spm.save_pretrained(root / path)
    with LLM(model=str(root / "target"), draft=str(root / "draft"), mode="sd", k=4, draft_executor="thread",
             max_batch_size=2) as llm:
        yield llm


@pytest.mark.parametrize("seed", [0, 1])
def test_llm_text_is_vllms_streamed_or_whole(spm_llm, spm, seed):
    """Sampled output, several tokens a round, special tokens kept: generate's text, the stream's deltas
    joined, and vLLM's text of the same tokens agree, the first word's space after the prompt included.
    The output is words ("▁..." tokens) and special tokens: a random model strings invalid bytes together,
    which a ByteFallback decoder renders differently whole and piece by piece (vLLM's text is piece by piece
    always; generate's is whole)."""
    import asyncio
    pieces = spm.convert_ids_to_tokens(list(range(len(spm))))
    allowed = [t for t, piece in enumerate(pieces) if piece.startswith("\u2581") or t in spm.all_special_ids]
    p = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True, skip_special_tokens=False,
                       allowed_token_ids=allowed)
    (out,) = spm_llm.generate([PROMPT], p)

    async def streamed() -> str:
        return "".join([d.text async for d in spm_llm.stream(PROMPT, p)])
    assert asyncio.run(streamed()) == out.text
    assert out.text == vllm_text(spm, out.prompt_token_ids, out.token_ids, skip_special_tokens=False)
    assert out.text.startswith(" ") == (out.token_ids[0] not in spm.all_special_ids)
