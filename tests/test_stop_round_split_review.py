"""The text path gives the same output however rounds split the tokens (AR: one a round; SD / SSD: up to K + 1):
text, stop strings, min_tokens and what is kept are the token sequence's alone, decoded one token at a time.
Real offline tokenizers (byte-level BPE; SentencePiece-like with byte fallback); the engine's text path alone
(text_engine), rounds handed their tokens by the test, and one real AR / SD pair at the end."""
from __future__ import annotations

import random
import shutil

import pytest
from offline_tokenizers import byte_level_bpe, sentencepiece_bpe
from test_text_path_tokenizers import PROMPT, text_engine

from saguaro_dist.engine.sequence import OutputKind, Sequence
from saguaro_dist.sampling_params import SamplingParams

WORDS = ["the", " fox", " caf\u00e9", "\u65e5\u672c\u8a9e", " \U0001f642", "\u2013", "STOP", " END", "\n", "a,b"]


@pytest.fixture(scope="module")
def spm():
    return sentencepiece_bpe()


@pytest.fixture(scope="module")
def tokenizers(spm):
    return {"byte_level": byte_level_bpe(), "sentencepiece": spm}


def feed(tok, output: list[int], params: SamplingParams, sizes: list[int], kind=OutputKind.DELTA) -> dict:
    """Hand `output` to one sequence in rounds of sizes[0], sizes[1], ... (cycled), each token with a
    logprob entry, until it ends; what the request would report, and its streamed deltas joined."""
    engine = text_engine(tok, {tok.eos_token_id})
    engine.eos_token_id = tok.eos_token_id
    s, deltas, done, r = Sequence(0, "r", tok.encode(PROMPT), params, output_kind=kind), [], 0, 0
    while done < len(output) and not s.finished:
        round_ = output[done:done + sizes[r % len(sizes)]]
        s.round_logprobs = [{t: -1.0} for t in round_]
        engine._append(s, round_, now=0.0)
        done, r = done + len(round_), r + 1
        if engine._due(s, 0.0):
            deltas.append(engine._delta(s).text_delta)
    return dict(text=s.text, token_ids=list(s.output_token_ids), finish_reason=s.finish_reason,
                stop_reason=s.stop_reason, logprobs=len(s.output_logprobs), counted=engine.metrics.generated_tokens,
                num_generated=s.metrics.num_generated_tokens,
                joined="".join(deltas) if kind is OutputKind.DELTA else s.text)


def random_case(rng: random.Random, tokenizers: dict):
    """Words with accents, CJK, emoji and special tokens, a few random tokens (byte tokens, EOS) among them;
    stop strings cut from the text, random min_tokens, max_tokens, stop_token_ids and flags."""
    name = rng.choice(sorted(tokenizers))
    tok = tokenizers[name]
    special = "<|im_end|>" if name == "byte_level" else "<tool_call>"
    text = "".join(rng.choice(["", " "]) + rng.choice(WORDS + [special]) for _ in range(12))
    output = tok.encode(text, add_special_tokens=False)
    for _ in range(rng.randint(0, 4)):
        output.insert(rng.randrange(len(output) + 1), rng.randrange(len(tok)))
    plain = feed(tok, output, SamplingParams(max_tokens=len(output), ignore_eos=True), [1])["text"]
    starts = [rng.randrange(len(plain) - 1) for _ in range(rng.randint(0, 2))] if len(plain) > 2 else []
    stops = [plain[a:a + rng.randint(1, 4)] for a in starts]
    max_tokens = rng.randint(1, len(output))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.randint(0, min(max_tokens, 6)), stop=stops,
                            include_stop_str_in_output=rng.random() < 0.4, ignore_eos=rng.random() < 0.3,
                            skip_special_tokens=rng.random() < 0.7,
                            stop_token_ids=[rng.choice(output)] if rng.random() < 0.3 else [])
    return tok, output, params, rng.choice(list(OutputKind))


@pytest.mark.parametrize("seed0", [0, 150])
def test_random_outputs_in_any_rounds_are_ars(tokenizers, seed0):
    """Rounds of 2, 3, 5 tokens and mixed sizes report exactly what one token a round does: tokens, text,
    finish and stop reasons, logprobs, counts, and the streamed deltas joined to the text."""
    for seed in range(seed0, seed0 + 150):
        rng = random.Random(seed)
        tok, output, params, kind = random_case(rng, tokenizers)
        ar = feed(tok, output, params, [1], kind)
        assert ar["joined"] == ar["text"]
        for sizes in ([2], [3], [5], [rng.randint(1, 6) for _ in range(8)]):
            assert feed(tok, output, params, sizes, kind) == ar, (seed, sizes, params)


def spm_ids(spm, pieces: list[str]) -> list[int]:
    return spm.convert_tokens_to_ids(pieces)


def test_a_round_ending_mid_character_still_stops_where_its_stop_string_is(spm):
    """A stop string completed early in a round that ends inside a character (a byte-fallback lead byte): the
    round released no text, so the stop string was found rounds later, with the tokens between kept."""
    output = spm_ids(spm, ["\u2581a", ",", "<0xE6>", "<0x97>", "<0xA5>", "b", "b"])
    for keep in (False, True):
        params = SamplingParams(max_tokens=7, ignore_eos=True, stop=[","], include_stop_str_in_output=keep)
        ar = feed(spm, output, params, [1])
        assert ar["token_ids"] == output[:2] and ar["stop_reason"] == "," and ar["text"] == (" a," if keep else " a")
        assert feed(spm, output, params, [3]) == feed(spm, output, params, [5]) == ar


def test_min_tokens_counts_text_token_by_token(spm):
    """min_tokens 2 over ",", a lead byte: the first two tokens' text is "," whatever the rounds released, so a
    round of two (which released nothing) does not let that "," stop the request three tokens early."""
    output = spm_ids(spm, [",", "<0xE6>", "<0x97>", "<0xA5>", ",", "b"])
    params = SamplingParams(max_tokens=6, ignore_eos=True, stop=[","], min_tokens=2)
    ar = feed(spm, output, params, [1])
    assert ar["token_ids"] == output[:5] and ar["text"] == ",\u65e5"
    assert feed(spm, output, params, [2]) == feed(spm, output, params, [2, 3]) == ar


def test_byte_fallback_text_does_not_depend_on_the_rounds(spm):
    """A character's bytes then a stray continuation byte: one token at a time that is "é" and U+FFFD, all at
    once three U+FFFD. The text is the one-at-a-time one in every round split and output kind, so a stop "é"
    ends every mode; also where max_tokens ends the output there (the final flush)."""
    output = spm_ids(spm, ["\u2581a", "<0xC3>", "<0xA9>", "<0x97>", "\u2581b"])
    for max_tokens in (5, 4):
        plain = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        ar = feed(spm, output, plain, [1])
        assert ar["text"].startswith(" a\u00e9\ufffd")
        for kind in OutputKind:
            assert feed(spm, output, plain, [5], kind) == feed(spm, output, plain, [2, 3], kind) == ar
    stop = SamplingParams(max_tokens=5, ignore_eos=True, stop=["\u00e9"])
    ar = feed(spm, output, stop, [1])
    assert ar["text"] == " a" and ar["token_ids"] == output[:3] and ar["stop_reason"] == "\u00e9"
    for kind in OutputKind:
        assert feed(spm, output, stop, [4], kind) == feed(spm, output, stop, [1], kind)


def test_a_step_a_stop_token_ended_is_not_searched_for_stop_strings(spm):
    """vLLM: a stop token (or EOS) ends the request with stop_reason its id, even where its own text, kept by
    include_stop_str_in_output, holds a stop string; a stop string in the text before it still ends it there."""
    output = spm_ids(spm, ["\u2581a", "S", "TOP", "\u2581b"])
    top = output[2]
    params = SamplingParams(max_tokens=4, stop=["T"], stop_token_ids=[top], include_stop_str_in_output=True)
    for sizes in ([1], [4]):
        got = feed(spm, output, params, sizes)
        assert (got["text"], got["token_ids"], got["stop_reason"]) == (" aSTOP", output[:3], top)
    params = SamplingParams(max_tokens=4, stop=["S"], stop_token_ids=[top], include_stop_str_in_output=True)
    for sizes in ([1], [4]):
        got = feed(spm, output, params, sizes)
        assert (got["text"], got["token_ids"], got["stop_reason"]) == (" aS", output[:2], "S")


# ---- through LLM: greedy AR and SD (draft = the target's copy: whole rounds accepted) ----------------------

@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory, spm):
    from engine_helpers import llama_config, save_model
    root = tmp_path_factory.mktemp("spm_copy_pair")
    save_model(root / "target", llama_config(len(spm), 32, 2), seed=3, sharpen=1.0)
    shutil.copytree(root / "target", root / "draft")
    for path in ("target", "draft"):
        spm.save_pretrained(root / path)
    return root


@pytest.mark.slow
def test_greedy_sd_stops_where_ar_does_over_byte_fallback_tokens(spm_pair, spm):
    """Greedy over ",", "b", "x" and bytes of CJK characters (rounds of K + 1 ending inside a character):
    SD gives AR's tokens, text, logprobs and reasons, with a stop string and with min_tokens."""
    from saguaro_dist import LLM
    allowed = spm_ids(spm, [",", "b", "x", "<0xE6>", "<0x97>", "<0xA5>", "<0xE8>", "<0xAA>"])
    base = dict(temperature=0, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed, logprobs=1)
    cases = [SamplingParams(stop=[",,,,,,,"], **base),
             SamplingParams(stop=[",,,,,,,"], include_stop_str_in_output=True, **base),
             SamplingParams(stop=[","], min_tokens=6, **base)]
    got = {}
    for mode, kw in (("ar", {}), ("sd", dict(draft=str(spm_pair / "draft"), k=4, draft_executor="thread"))):
        with LLM(model=str(spm_pair / "target"), mode=mode, max_batch_size=2, **kw) as llm:
            outs = llm.generate([PROMPT] * len(cases), cases)
        samples = [o.outputs[0] for o in outs]
        got[mode] = [(c.text, c.token_ids, c.finish_reason, c.stop_reason, len(c.logprobs)) for c in samples]
    assert got["sd"] == got["ar"]
    assert all(reason == "stop" and len(ids) < 40 for _, ids, reason, _, _ in got["ar"])


def count_decoded_ids(engine) -> list[int]:
    """Wrap the engine's detokenizer decode: the ids it hands the tokenizer, summed in the returned list."""
    decoded, decode = [0], engine.detok.decode
    def counting(ids, skip_special_tokens=True):
        decoded[0] += len(ids)
        return decode(ids, skip_special_tokens)
    engine.detok.decode = counting
    return decoded


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("run", ["skipped_eos", "lone_bytes"])
@pytest.mark.parametrize("kind,per_round", [(OutputKind.FINAL_ONLY, 1), (OutputKind.DELTA, 5)])
def test_a_long_run_of_tokens_without_text_decodes_a_bounded_window(tokenizers, name, run, kind, per_round):
    """2000 skipped EOS (ignore_eos) or lone continuation bytes after a few words: each token's step decodes
    O(1) ids (the whole held run again at each token was O(n^2): ~2M ids, a 400 ms step), and the text is
    the one token by token always gave: the words, then nothing or one U+FFFD a byte."""
    tok, n = tokenizers[name], 2000
    lone = tok.convert_tokens_to_ids("\u0122" if name == "byte_level" else "<0x80>")  # byte 0x80 alone
    filler, tail_text = (tok.eos_token_id, "") if run == "skipped_eos" else (lone, "\ufffd" * n)
    words = tok.encode(" the fox caf\u00e9", add_special_tokens=False)
    engine = text_engine(tok, {tok.eos_token_id})
    engine.eos_token_id = tok.eos_token_id
    decoded = count_decoded_ids(engine)
    s, output = Sequence(0, "r", tok.encode(PROMPT), SamplingParams(max_tokens=len(words) + n, ignore_eos=True),
                         output_kind=kind), words + [filler] * n
    for i in range(0, len(output), per_round):
        engine._append(s, output[i:i + per_round], now=0.0)
        if engine._due(s, 0.0):
            engine._delta(s)
    words_text = feed(tok, words, SamplingParams(max_tokens=len(words)), [1])["text"]
    assert s.finished and s.text == words_text + tail_text
    assert decoded[0] < 20 * len(output), decoded[0]


def test_stop_strings_scan_each_character_of_a_long_text_once(tokenizers, monkeypatch):
    """A request with stop strings none of its text holds: each token's search looks at what the token added
    (plus a stop string's length - 1 before it, where one may start), so the scan is linear in the text. The
    whole text since min_tokens at every token was O(n^2) (a 4000-token request: ~16k chars read 4000 times)."""
    import saguaro_dist.engine.committing as committing
    scanned, real_find_stop = [0], committing.find_stop

    def counting(text, stops, keep=False, after=0):
        scanned[0] += len(text) - max(0, after - max(map(len, stops)) + 1)
        return real_find_stop(text, stops, keep, after)

    monkeypatch.setattr(committing, "find_stop", counting)
    tok, stops = tokenizers["byte_level"], ("NEVER", "nope")
    output = tok.encode(" the fox caf\u00e9 \u65e5\u672c\u8a9e" * 150, add_special_tokens=False)
    got = feed(tok, output, SamplingParams(max_tokens=len(output), stop=list(stops), min_tokens=5), [5])
    assert got["token_ids"] == output and got["stop_reason"] is None
    assert scanned[0] <= len(got["text"]) + len(output) * max(map(len, stops)), (scanned[0], len(got["text"]))
