"""LLM.beam_search (vLLM's offline beam search over generate) against an independent brute force over
transformers' log-softmax on a tiny real checkpoint: the same candidates (the top 2 * beam_width a step), the
same length-penalised score (the prompt counted, a final EOS not), beams ended by the tokenizer's EOS (only)
kept as completed."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaForCausalLM

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.beam_search import BeamSearchParams, get_beam_search_score

PROMPTS = [[5, 9, 2, 7], [1, 2, 3, 4, 5, 6]]
STEPS = 5


def reference(model, prompt: list[int], width: int, steps: int, eos: int | None, length_penalty: float = 1.0,
              room: int = 10**9) -> list[tuple[list[int], float]]:
    """Beam search written out over transformers' logits: (tokens incl. the prompt, cumulative log p), best first."""
    def score(beam):
        tokens, cum = beam
        return cum / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        done += [b for b in beams if len(b[0]) >= room]
        beams = [b for b in beams if len(b[0]) < room]
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = logp.topk(2 * width)
            candidates += [(tokens + [t], cum + lp) for t, lp in zip(top.indices.tolist(), top.values.tolist())]
        done += [c for c in candidates if c[0][-1] == eos]
        beams = sorted([c for c in candidates if c[0][-1] != eos], key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return path, LlamaForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(model=str(checkpoint[0]), mode="ar") as llm:
        yield llm


def ranked_after(model, prompt: list[int], rank: int) -> int:
    """The token ranked `rank` (0: the top) after `prompt`."""
    with torch.no_grad():
        return int(model(torch.tensor([prompt])).logits[0, -1].topk(rank + 1).indices[rank])


def with_tokenizer(path, copy, eos: int, generation_eos: list[int]):
    """A copy of the tiny checkpoint with a word-level tokenizer ("t<id>" each id) whose eos_token is `eos`,
    and a generation config (and config.json) naming `generation_eos`: what ends a beam is the tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(path, copy, dirs_exist_ok=True)
    vocab_size = json.loads((copy / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{eos}").save_pretrained(copy)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((copy / name).read_text()) if (copy / name).is_file() else {}
        (copy / name).write_text(json.dumps({**config, "eos_token_id": generation_eos}))
    return copy


@pytest.fixture(scope="module")
def with_eos(checkpoint, tmp_path_factory):
    """The same model whose tokenizer's EOS is the token ranked second after PROMPTS[0] (a step-one candidate
    of every width)."""
    path, model = checkpoint
    eos = ranked_after(model, PROMPTS[0], 1)
    with LLM(model=str(with_tokenizer(path, tmp_path_factory.mktemp("eos_ckpt"), eos, [eos])), mode="ar") as llm:
        yield llm, eos


@pytest.fixture(scope="module")
def with_generation_eos(checkpoint, tmp_path_factory):
    """The tokenizer's EOS as with_eos's; the generation config also names the top token after PROMPTS[0],
    `extra`, an EOS for generate but not for beam search (current vLLM's: the tokenizer's eos_token_id only)."""
    path, model = checkpoint
    eos, extra = ranked_after(model, PROMPTS[0], 1), ranked_after(model, PROMPTS[0], 0)
    copy = with_tokenizer(path, tmp_path_factory.mktemp("gen_eos_ckpt"), eos, [eos, extra])
    with LLM(model=str(copy), mode="ar") as llm:
        yield llm, eos, extra


@pytest.mark.parametrize("width", [1, 2, 3])
def test_beams_match_the_brute_force(llm, checkpoint, width):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(beam_width=width, max_tokens=STEPS))
    for out, prompt in zip(outs, PROMPTS):
        want = reference(checkpoint[1], prompt, width, STEPS, eos=None)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for s, (_, cum) in zip(out.sequences, want):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(s.logprobs) == STEPS and (s.finish_reason, s.text) == ("length", None)  # no tokenizer: no text


def test_width_one_is_greedy(llm):
    greedy = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=STEPS),
                          use_tqdm=False)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(beam_width=1, max_tokens=STEPS))
    assert [o.sequences[0].tokens for o in outs] == [p + g.token_ids for p, g in zip(PROMPTS, greedy)]


@pytest.mark.parametrize("length_penalty", [0.0, 2.0])
def test_length_penalty_ranks_as_the_brute_force(with_eos, checkpoint, length_penalty):
    """With EOS-completed (shorter) beams competing, the penalty changes the ranking as the reference's does."""
    llm, eos = with_eos
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                          BeamSearchParams(beam_width=3, max_tokens=STEPS, length_penalty=length_penalty))[0]
    want = reference(checkpoint[1], PROMPTS[0], 3, STEPS, eos, length_penalty)
    assert [s.tokens for s in out.sequences] == [t for t, _ in want]


@pytest.mark.parametrize("width", [1, 2, 3])
def test_eos_ends_a_beam_as_completed(with_eos, checkpoint, width):
    llm, eos = with_eos
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=width, max_tokens=STEPS))[0]
    want = reference(checkpoint[1], PROMPTS[0], width, STEPS, eos)
    assert [s.tokens for s in out.sequences] == [t for t, _ in want]
    ended = [s for s in out.sequences if s.tokens[-1] == eos]
    assert all(s.finish_reason == "stop" and len(s.tokens) < len(PROMPTS[0]) + STEPS for s in ended)
    if width > 1:
        assert ended  # the EOS candidate of step one is among the best
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)


def test_ignore_eos_grows_through_it(with_eos, checkpoint):
    llm, eos = with_eos
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                          BeamSearchParams(beam_width=3, max_tokens=STEPS, ignore_eos=True))[0]
    want = reference(checkpoint[1], PROMPTS[0], 3, STEPS, eos=None)
    # (ranked by the score, which leaves a final EOS out of the length either way, as vLLM's)
    assert sorted(s.tokens for s in out.sequences) == sorted(t for t, _ in want)
    assert all(len(s.tokens) == len(PROMPTS[0]) + STEPS for s in out.sequences)


def test_beams_stop_at_the_contexts_end(checkpoint):
    with LLM(model=str(checkpoint[0]), mode="ar", max_model_len=8) as short:
        out = short.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=10))[0]
    want = reference(checkpoint[1], PROMPTS[0], 2, 10, eos=None, room=8)
    assert [s.tokens for s in out.sequences] == [t for t, _ in want]
    assert all(len(s.tokens) == 8 and s.finish_reason == "length" for s in out.sequences)


def test_a_prompt_with_no_room_is_refused_as_generate_refuses_it(checkpoint):
    """Not a zero-token beam reported as "length": vLLM's search raises through its generate."""
    with LLM(model=str(checkpoint[0]), mode="ar", max_model_len=8) as short:
        with pytest.raises(ValueError, match="leaves 0 of the model's max length"):
            short.beam_search([{"prompt_token_ids": list(range(1, 9))}], BeamSearchParams(beam_width=2, max_tokens=2))


@pytest.mark.parametrize("width", [1, 2, 3])
def test_only_the_tokenizers_eos_ends_a_beam(with_generation_eos, checkpoint, width):
    """A generation-config-only EOS (which ends generate's samples) grows on inside a beam, as vLLM's."""
    llm, eos, extra = with_generation_eos
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=width, max_tokens=STEPS))[0]
    want = reference(checkpoint[1], PROMPTS[0], width, STEPS, eos)
    assert [s.tokens for s in out.sequences] == [t for t, _ in want]
    assert all(s.finish_reason == ("stop" if s.tokens[-1] == eos else "length") for s in out.sequences)
    if width > 1:  # the beam through `extra` grew on
        assert any(s.tokens[len(PROMPTS[0])] == extra and len(s.tokens) > len(PROMPTS[0]) + 1 for s in out.sequences)
    greedy = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(temperature=0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0]
    assert (greedy.token_ids, greedy.finish_reason) == ([extra], "stop")  # generate ends there


def test_text_is_the_decoded_beam():
    from saguaro_dist.demo import PAIR_DIR
    with LLM(model=str(PAIR_DIR / "target"), mode="ar") as demo:
        out = demo.beam_search(["def add(a, b):"], BeamSearchParams(beam_width=2, max_tokens=4))[0]
        tokenizer = demo.tokenizer
    assert len(out.sequences) == 2
    for s in out.sequences:
        assert s.text == tokenizer.decode(s.tokens) and "def add(a, b):" in s.text  # prompt included, as vLLM's


@pytest.mark.parametrize("fields, name", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=True, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos")])
def test_params_are_checked_at_the_edge(fields, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**fields)


def test_beam_search_refuses_other_params(llm):
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(["x"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([{"prompt_token_ids": [1, 2]}], BeamSearchParams(beam_width=1, max_tokens=1), lora_request="a")
