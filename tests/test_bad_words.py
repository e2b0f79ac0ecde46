"""vLLM's bad_words: the mask (spec/bad_words.py) against transformers' NoBadWordsLogitsProcessor, the
tokenization (vLLM's rule), and the engine: greedy output identical to transformers' generate(bad_words_ids=...)
in ar, sd and ssd, and the sampled first tokens following the masked target exactly (chi-square)."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer, NoBadWordsLogitsProcessor

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.bad_word_ids import bad_word_ids
from saguaro_dist.spec.bad_words import bad_words_mask
from test_engine_sampling import ALPHA, CASES, PROMPT, VOCAB, chi_square_pvalue, sample_joint, sampling_pair


def hf_mask(context: list[int], words, vocab: int) -> torch.Tensor:
    """transformers' rule on the same context: [V] bool, True where banned. A sentinel id no word holds
    goes first (the context may be empty; no prompt counts)."""
    processor = NoBadWordsLogitsProcessor([list(w) for w in words])
    scores = processor(torch.tensor([[vocab] + context]), torch.zeros(1, vocab + 1))
    return torch.isinf(scores[0, :vocab])


def test_mask_rows_follow_the_output_and_the_drafted_tokens():
    """Row t is transformers' mask after output + drafted[:t], on random words and contexts."""
    rng = random.Random(0)
    vocab = 7
    for _ in range(300):
        words = tuple(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4)))
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        drafted = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        mask = bad_words_mask(output, drafted, len(drafted) + 1, words, vocab)
        for t in range(len(drafted) + 1):
            assert torch.equal(mask[t], hf_mask(output + drafted[:t], words, vocab)), (words, output, drafted, t)


def test_a_word_longer_than_the_output_bans_nothing():
    """Only the output counts (vLLM's rule): (4, 5) bans 5 after a 4 that was generated, never at the start."""
    assert not bad_words_mask([], [], 1, ((4, 5),), 8).any()
    assert bad_words_mask([], [4], 2, ((4, 5),), 8)[1].nonzero().flatten().tolist() == [5]
    assert bad_words_mask([1], [], 1, ((3,),), 8)[0].nonzero().flatten().tolist() == [3]


def test_tokenization_follows_vllm():
    """Each word left-stripped, then " " + word where that starts with another token and is as long."""
    vocab = {"cat": [1], " cat": [2], "ab": [3, 4], " ab": [5, 6, 4], "x": [7], " x": [7]}
    assert bad_word_ids(["  cat", "ab", "x"], vocab.__getitem__) == ((1,), (2,), (3, 4), (7,))
    with pytest.raises(ValueError, match="at least one token"):
        bad_word_ids(["cat"], lambda text: [])


@pytest.mark.parametrize("bad", ["", 3, "word"])
def test_bad_words_are_checked_at_the_edge(bad):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=bad if bad == "word" else ["ok", bad])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sampling_pair(tmp_path_factory.mktemp("bad_words_pair"))


def banned_for(pair) -> tuple[list[str], list[list[int]]]:
    """Bad words that bite on this pair's greedy output: its commonest token alone, and a bigram it
    generates whose first token is not the prompt's last (only the output counts; transformers reads the
    prompt too)."""
    target, _, model = pair
    plain = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    commonest = max(set(plain), key=plain.count)
    rest = [t for t in plain if t != commonest] or [t for t in range(VOCAB - 1) if t != commonest]
    bigram = next(((a, b) for a, b in zip(rest, rest[1:]) if a != PROMPT[-1]), (rest[0], rest[0]))
    tokenizer = AutoTokenizer.from_pretrained(target)
    words = [tokenizer.decode([commonest]), tokenizer.decode(list(bigram))]
    return words, [[commonest], list(bigram)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_matches_transformers_bad_words_ids(pair, mode):
    target, draft, model = pair
    words, ids = banned_for(pair)
    want = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          pad_token_id=0, eos_token_id=None, bad_words_ids=ids)[0, len(PROMPT):].tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    with LLM(model=target, draft=None if mode == "ar" else draft, mode=mode, k=2, draft_executor="thread") as llm:
        assert llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0].outputs[0].token_ids == want
    assert ids[0][0] not in want


def masked_joint(model, ids: list[list[int]], depth: int = 3) -> dict[tuple[int, ...], float]:
    """The first tokens' exact law at T = 1 with transformers' bad-words processor (the prompt does not
    end a banned prefix here, so its reading of the prompt changes nothing)."""
    processor = NoBadWordsLogitsProcessor(ids)
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in joint.items():
            tokens = torch.tensor([PROMPT + list(prefix)])
            with torch.no_grad():
                logits = processor(tokens, model(tokens).logits[:, -1].double())
            for t, q in enumerate(logits[0].softmax(-1).tolist()):
                if q > 0:
                    nxt[prefix + (t,)] = mass * q
        joint = nxt
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("case, draft_knows", [("sd", False), ("ssd_k2", False), ("ssd_miss_neural", False),
                                               ("ssd_k2", True)])
def test_sampled_first_tokens_follow_the_masked_target(pair, case, draft_knows, monkeypatch):
    """Token 1 ("b") banned everywhere and "ca" (2, 0) after a c. A draft that knows neither (an older draft
    server's; here its draws' rule switched off) proposes banned tokens, which must be rejected and row t
    masked after the drafted tokens before it; a draft told them (DraftSampling.bad_words) proposes none."""
    if not draft_knows:
        from saguaro_dist.engine.draft_constraints import DraftConstraints
        monkeypatch.setattr(DraftConstraints, "bad_words", staticmethod(lambda owners, paths: None))
    target, draft, model = pair
    ids = [[1], [2, 0]]
    params = SamplingParams(temperature=1.0, bad_words=["b", "ca"])
    settings, took_path = CASES[case]
    counts, metrics = sample_joint(target, draft, params, **settings)
    assert took_path(metrics), metrics
    assert not any(1 in seq or any(seq[i:i + 2] == (2, 0) for i in range(2)) for seq in counts)
    p = chi_square_pvalue(counts, masked_joint(model, ids))
    assert p > ALPHA, f"{case}: chi-square p = {p:.2e}"
