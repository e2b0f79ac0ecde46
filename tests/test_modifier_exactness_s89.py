"""The sampling modifiers that read the tokens generated so far (presence / frequency / repetition penalties,
logit bias and allowed tokens, bad words, min_tokens) stay exact through every speculative path, in the cases
the other suites leave out: greedy tokens (and their raw log-probabilities) equal to mode ar on every mode and
draft backend with each modifier and all at once, on prompts that repeat themselves; and rounds that really
hold the awkward cases (spied on the target's verify, calling through): a draft that repeats a token within its
round under penalties, a multi-token bad word whose prefix is drafted in the same round, min_tokens ending
inside a round. A draft that is the target itself, told the modifiers, is accepted throughout (its q follows
the modified target). For sampling, the joint of the first 3 tokens at K = 3 (min_tokens and a bad word end
inside the first round) against a reference written apart from saguaro_dist.spec. The power checks break the
verifier's per-position context on purpose and show the greedy comparison sees it.

Reviewed in session 89 (tests/test_engine_greedy.py, test_bad_words.py, test_draft_*.py,
test_engine_sampling*.py and test_exactness_paths.py cover the rest)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import saguaro_dist.engine.target as target_module
from engine_helpers import llama_config, save_model, save_perturbed, self_drafting_target
from saguaro_dist import LLM, SamplingParams
from test_engine_sampling import PROMPT as SAMPLING_PROMPT
from test_engine_sampling import chi_square_pvalue, reference_probs, sample_joint, save_tiny_tokenizer

VOCAB, K = 6, 3  # the tiny tokenizer's a..e are ids 0..4, <eos> is 5
PROMPTS = [[1, 2, 3], [0, 4], [3, 3, 1, 0, 3, 3, 1, 0], [2, 2, 2, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
# bigrams and a trigram of the target's greedy loop (1 2 0 4 5): they bite, and their prefixes get drafted
MODIFIERS = {
    "penalties": dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.4),
    "repetition": dict(repetition_penalty=1.5),
    "bias_allowed": dict(logit_bias={1: 1.0, 3: -0.5}, allowed_token_ids=[0, 1, 2, 3, 4]),
    "bad_words": dict(bad_words=["bc", "cae"]),
    "min_tokens": dict(min_tokens=6, ignore_eos=False, stop_token_ids=[1]),
    "all": dict(presence_penalty=0.3, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={0: 0.5},
                bad_words=["bc", "dda"], min_tokens=4),  # eos barred for 4 tokens (under ignore_eos too)
}
RUNS = {  # the target as its own draft (generate)
    "sd": dict(mode="sd"),
    "ssd": dict(mode="ssd"),
    "ssd_trees": dict(mode="ssd", fan_out=8, tree_policy="always"),
    "ngram": dict(mode="ngram"),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return self_drafting_target(tmp_path_factory.mktemp("modifiers_target"), VOCAB)


def generate(target: str, params: SamplingParams, **kwargs):
    mode = kwargs["mode"]
    if mode == "ssd":  # every proposal the draft's: the neural backup, no n-gram rounds
        kwargs = dict(fallback="neural", ngram_rounds=False) | kwargs
    if mode in ("sd", "ssd"):
        kwargs = dict(draft=target, draft_executor="thread") | kwargs
    if kwargs.get("draft_executor") in ("process", "split"):
        kwargs.update(draft_threads=1, target_threads=1)  # one torch thread each on the shared box
    with LLM(model=target, k=K, **kwargs) as llm:
        return llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)


class VerifySpy:
    """Calls through the target's per-position modifiers, noting the rounds that hold the awkward cases."""

    def __init__(self, monkeypatch):
        self.repeats = self.drafted_prefix = self.min_tokens_inside = 0
        penalize, mask, hold = target_module.penalize_batch, target_module.bad_words_mask, \
            target_module.TargetScorer._hold_back_ends

        def penalize_batch(logits, in_prompt, outputs, drafted, settings):
            self.repeats += sum(len(set(d)) < len(d) for d in drafted)
            return penalize(logits, in_prompt, outputs, drafted, settings)

        def bad_words_mask(output_ids, drafted, rows, words, vocab_size):
            banned = mask(output_ids, drafted, rows, words, vocab_size)
            self.drafted_prefix += int(banned[1:].any())  # every word here is 2+ tokens: a drafted token began it
            return banned

        def hold_back_ends(scorer, logits, seqs, early):
            self.min_tokens_inside += sum(0 < n < logits.shape[1] for _, n in early if logits.shape[1] > 1)
            return hold(scorer, logits, seqs, early)
        monkeypatch.setattr(target_module, "penalize_batch", penalize_batch)
        monkeypatch.setattr(target_module, "bad_words_mask", bad_words_mask)
        monkeypatch.setattr(target_module.TargetScorer, "_hold_back_ends", hold_back_ends)


def tokens_and_logprobs(outs):
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_logprobs_close(got, want) -> None:
    for g_seq, w_seq in zip(got, want):
        for g, w in zip(g_seq, w_seq):
            assert g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) < 1e-5 for t in w), (g, w)


@pytest.fixture(scope="module")
def ar(target):
    """mode ar's greedy tokens and log-probabilities under each modifier."""
    return {name: tokens_and_logprobs(generate(target, replace(GREEDY, **m), mode="ar")) for name, m in MODIFIERS.items()}


def test_the_modifiers_bite(target, ar):
    plain, _ = tokens_and_logprobs(generate(target, GREEDY, mode="ar"))
    assert all(ar[name][0] != plain for name in MODIFIERS)


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("name", sorted(MODIFIERS))
def test_greedy_is_ar_with_each_modifier(target, ar, monkeypatch, run, name):
    """The same tokens and raw log-probabilities as mode ar; the self-draft, told the modifiers, is accepted
    throughout (ngram: its proposals are text's, no such bound); and the rounds held the case the modifier
    makes awkward."""
    spy = VerifySpy(monkeypatch)
    outs = generate(target, replace(GREEDY, **MODIFIERS[name]), **RUNS[run])
    tokens, logprobs = tokens_and_logprobs(outs)
    assert tokens == ar[name][0]
    assert_logprobs_close(logprobs, ar[name][1])
    drafted = sum(o.metrics.drafted_tokens for o in outs)
    assert drafted > 0
    if run != "ngram":
        assert sum(o.metrics.accepted_tokens for o in outs) / drafted > 0.95
    seen = {"penalties": spy.repeats, "repetition": spy.repeats, "bad_words": spy.drafted_prefix,
            "min_tokens": spy.min_tokens_inside, "all": spy.repeats and spy.drafted_prefix and spy.min_tokens_inside}
    assert seen.get(name, 1), (name, vars(spy))


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["process", "split"])
def test_greedy_is_ar_with_every_modifier_on_the_child_draft(target, ar, executor):
    """All modifiers at once, the draft in a child process (sd) / split beside the target (ssd trees)."""
    run = dict(mode="sd") if executor == "process" else dict(RUNS["ssd_trees"])
    outs = generate(target, replace(GREEDY, **MODIFIERS["all"]), draft_executor=executor, **run)
    tokens, logprobs = tokens_and_logprobs(outs)
    assert tokens == ar["all"][0]
    assert_logprobs_close(logprobs, ar["all"][1])
    assert sum(o.metrics.accepted_tokens for o in outs) / sum(o.metrics.drafted_tokens for o in outs) > 0.95


@pytest.fixture(scope="module")
def far_pair(tmp_path_factory):
    """(target, a draft of its weights plus 60% noise): rejections inside rounds, bonus tokens from residuals."""
    root = tmp_path_factory.mktemp("modifiers_far_pair")
    model = save_model(root / "target", llama_config(VOCAB, 32, 1), seed=3, sharpen=2.0)
    save_tiny_tokenizer(root / "target")
    save_perturbed(root / "draft", model, seed=4, noise=0.6)
    return str(root / "target"), str(root / "draft"), model


@pytest.mark.parametrize("run", ["sd", "ssd_trees"])
def test_greedy_is_ar_with_every_modifier_under_rejections(far_pair, run):
    target, draft, _ = far_pair
    params = replace(GREEDY, **MODIFIERS["all"])
    with LLM(model=target, mode="ar") as llm:
        want = tokens_and_logprobs(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params))
    with LLM(model=target, draft=draft, k=K, draft_executor="thread", **RUNS[run]) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    got = tokens_and_logprobs(outs)
    assert got[0] == want[0]
    assert_logprobs_close(got[1], want[1])
    assert 0 < sum(o.metrics.accepted_tokens for o in outs) < sum(o.metrics.drafted_tokens for o in outs)


@pytest.mark.parametrize("broken", ["penalties", "bad_words"])
def test_the_comparison_sees_a_verifier_that_ignores_the_drafted_tokens(target, ar, monkeypatch, broken):
    """Power: row t scored with the output alone (not output + x_1..x_t) gives other greedy tokens."""
    if broken == "penalties":
        penalize = target_module.penalize_batch
        monkeypatch.setattr(target_module, "penalize_batch",
                            lambda lg, p, outs, drafted, s: penalize(lg, p, outs, [[] for _ in drafted], s))
    else:
        mask = target_module.bad_words_mask
        monkeypatch.setattr(target_module, "bad_words_mask", lambda out, drafted, *a: mask(out, [], *a))
    outs = generate(target, replace(GREEDY, **MODIFIERS[broken]), mode="sd")
    assert tokens_and_logprobs(outs)[0] != ar[broken][0]


# ---- sampling: the joint of the first 3 tokens at K = 3 --------------------------------------------------------

SAMPLED = SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=0.3,
                         logit_bias={0: 1.0, 3: -0.5}, bad_words=["bc", "ae"], min_tokens=2)
SAMPLED_IDS = [[1, 2], [0, 4]]  # the bad words' ids (the tiny tokenizer: one letter a token)
SAMPLED_CASES = {
    "sd": dict(mode="sd", k=K),
    "ssd_coupled_trees": dict(k=K, fan_out=8, tree_policy="always", bonus_draw="coupled", fallback="neural"),
    "ngram": dict(mode="ngram", k=K),
}


def banned_then_reference(logits: torch.Tensor, params: SamplingParams, prefix: tuple[int, ...]) -> torch.Tensor:
    """test_engine_sampling's reference (bias, penalties, temperature, min_tokens' held-back eos) after the
    bad words' mask (vLLM's rule: a word's last token is barred where the output ends with the rest)."""
    logits = logits.clone()
    for word in SAMPLED_IDS:
        if len(word) - 1 <= len(prefix) and tuple(prefix[len(prefix) - len(word) + 1:]) == tuple(word[:-1]):
            logits[word[-1]] = float("-inf")
    return reference_probs(logits, params, prefix)


def sampled_joint(model, depth: int = 3) -> dict[tuple[int, ...], float]:
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([SAMPLING_PROMPT + list(prefix)])).logits[0, -1]
            for t, q in enumerate(banned_then_reference(logits, SAMPLED, prefix).tolist()):
                if q > 0:
                    nxt[prefix + (t,)] = mass * q
        joint = nxt
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SAMPLED_CASES))
def test_sampled_first_tokens_follow_the_modified_target(far_pair, case):
    """Every modifier at once, K = 3: the first round's rows 0 and 1 decide tokens 2 and 3, so min_tokens = 2
    ends inside it and a drafted 'b' (or 'a') bars 'c' (or 'e') in the same round."""
    target, draft, model = far_pair
    counts, metrics = sample_joint(target, draft, SAMPLED, n=3000, **SAMPLED_CASES[case])
    assert metrics.accepted_tokens > 0 and (case != "ssd_coupled_trees" or metrics.cache_hits > 0), metrics
    p = chi_square_pvalue(counts, sampled_joint(model))
    assert p > 1e-4, f"{case}: chi-square p = {p:.2e}"
