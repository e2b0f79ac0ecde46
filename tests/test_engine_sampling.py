"""Sampling exactness through the whole engine: the joint law of the first three generated tokens
under SD and every SSD path equals the target's, computed by enumeration.

Test: Pearson chi-square over the V^3 joint (cells with expected count < 5 pooled), false-alarm
rate ALPHA per case. With N = 10000 samples, a 1% (absolute) shift of probability mass between two of
the likeliest cells (p ~ 0.01 each, of 216) is seen with power > 0.999 at this alpha (noncentral
chi-square, 216 cells: a 0.5% shift 0.08-0.5; 20000 samples, which the suite could not afford in
time, saw that 0.7-1.0); broken verifiers (tested below) are rejected at once; the verifier alone is
tested with 10^5+ samples in tests/test_spec_*. A case that runs the same rounds as a thread-executor
twin with its draft in a child process ("process", "split") samples N_TWIN = 5000 (a 1% shift: power
0.7 between the likeliest cells, about 0.995 between upper-quartile ones; 2%: 1.000): its twin carries the
power, it proves the transport changes nothing (as the distributed cases do,
tests/test_distributed_sampling.py).
"""
from __future__ import annotations

import copy
import gc
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from scipy.stats import chi2
from transformers import LlamaForCausalLM

import saguaro_dist.engine.ssd_loop as ssd_loop
import saguaro_dist.spec.coupled as coupled_module
import saguaro_dist.engine.target as target_module
from engine_helpers import (DEVICE, CyclingGate, JustInTimeLookupGate, LookupFavouringGate, every_lookup_length,
                            llama_config, save_model, save_perturbed, trusting_picker)
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.spec import VerifyResult, verify
from saguaro_dist.spec.sampling import sample_with_uniforms
from saguaro_dist.spec.lookup_length import LookupLengths
from saguaro_dist.spec.tree_gate import RoundMode

VOCAB, PROMPT, N, N_TWIN, ALPHA = 6, [1, 2, 3], 10000, 5000, 1e-4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sampling_pair(tmp_path_factory.mktemp("sampling_pair"))


def sampling_pair(root):
    """(target path, draft path, target model): the tiny pair every case samples (draft perturbed)."""
    torch.set_num_threads(1)
    target = save_model(root / "target", llama_config(VOCAB, 32, 1), seed=3, sharpen=2.0)
    save_tiny_tokenizer(root / "target")
    save_perturbed(root / "draft", target, seed=4, noise=0.6)
    return str(root / "target"), str(root / "draft"), target


# Structured outputs over the tiny vocabulary a..e (0-4) and <eos> (5): this regex allows {a, b}, then
# {a, b, c, d}, then {b, c, d} (never the end within 3 tokens), written out by hand as GRAMMAR_STEPS.
TINY_VOCAB = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "<eos>": 5}
GRAMMAR = StructuredOutputsParams(regex="[ab][a-d][bcd]+")
GRAMMAR_STEPS = [{0, 1}, {0, 1, 2, 3}, {1, 2, 3}]
EOS_IDS = {TINY_VOCAB["<eos>"]}  # the pair's only eos id (its config.json names none)


def save_tiny_tokenizer(path) -> None:
    """A byte-level BPE tokenizer of the six tokens (what llguidance needs to read token bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(vocab=TINY_VOCAB, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)


def reference_probs(logits: torch.Tensor, p: SamplingParams, output: tuple[int, ...] = ()) -> torch.Tensor:
    """Plain sampling's distribution, written independently of saguaro_dist.spec: the logit bias and
    allowed tokens, vLLM's penalties (output: the tokens generated before this one), then temperature,
    the eos ids and stop tokens held back while fewer than min_tokens are out, min-p, top-k, top-p (vLLM's order)."""
    logits = logits.double()
    if p.structured_outputs is not None:
        logits[[t for t in range(len(logits)) if t not in GRAMMAR_STEPS[len(output)]]] = float("-inf")
    for t, bias in p.logit_bias:
        logits[t] += bias
    if p.allowed_token_ids is not None:
        logits[[t for t in range(len(logits)) if t not in p.allowed_token_ids]] = float("-inf")
    for t in set(PROMPT) | set(output):  # repetition: tokens of the prompt or the output
        logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
    for t in set(output):
        logits[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    logits = logits / p.temperature
    if len(output) < p.min_tokens:  # the eos ids too, under ignore_eos as well (vLLM's all_stop_token_ids)
        logits[sorted(EOS_IDS | set(p.stop_token_ids))] = float("-inf")
    if p.min_p:  # below min_p x the likeliest's tempered probability: out
        tempered = logits.softmax(-1)
        logits = logits.masked_fill(tempered < p.min_p * tempered.max(), float("-inf"))
    if p.top_k:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < p.top_p  # smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        probs /= probs.sum()
    return probs


def exact_joint(model, params: SamplingParams, depth: int = 3) -> dict[tuple[int, ...], float]:
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            for t, q in enumerate(reference_probs(logits, params, prefix).tolist()):
                if q > 0:
                    nxt[prefix + (t,)] = mass * q
        joint = nxt
    return joint


def sample_joint(target: str, draft: str | None, params: SamplingParams, n: int = N, **kwargs):
    """Counts of the generated 3-token sequences, and the engine's metrics (to check the path taken).
    EOS is ignored (a grammar's own end is never allowed within 3 tokens here). `max_tokens` (a kwarg)
    generates longer and counts the first 3, for paths that only later rounds take. `whole_batches` (a kwarg):
    generate 64 at a time, so that the rounds after the first admit no sequence (each one a whole batch)."""
    mode, max_tokens, whole = kwargs.pop("mode", "ssd"), kwargs.pop("max_tokens", 3), kwargs.pop("whole_batches", False)
    device = kwargs.pop("device", DEVICE)
    if mode == "ngram":
        draft = None  # it proposes from the sequence's own tokens
    elif "cluster" not in kwargs:  # (on Ray the drafts are actors: "process", or "split" with a copy beside the target)
        kwargs.setdefault("draft_executor", "thread")  # the process carries the same messages: one case below
        if kwargs["draft_executor"] != "thread":  # torch on one thread in the child too, as here (sampling_pair):
            kwargs.setdefault("draft_threads", 1)  # its default, every core, ran these cases 4x slower on 2 cores
    with LLM(device=device, model=target, draft=draft, mode=mode, max_batch_size=64, **kwargs) as llm:
        ignore_eos = params.structured_outputs is None
        seeded = seeded_params(params, n, max_tokens=max_tokens, ignore_eos=ignore_eos)
        calls = [seeded[i:i + 64] for i in range(0, n, 64)] if whole else [seeded]
        with gc_paused():
            outs = [o for call in calls
                    for o in llm.generate(prompt_token_ids=[PROMPT] * len(call), sampling_params=call, use_tqdm=False)]
        metrics = llm.metrics
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids[:3])] = counts.get(tuple(o.token_ids[:3]), 0) + 1
    return counts, metrics


def seeded_params(params: SamplingParams, n: int, **fields) -> list[SamplingParams]:
    """replace(params, seed=i, **fields) for i in range(n): one replace (its __post_init__ checks every field),
    then copies that differ from it in the seed alone (a replace each cost ~60 us: 0.6 s of CPU per 10000)."""
    first = replace(params, seed=0, **fields)
    seeded = [first]
    for i in range(1, n):
        seeded.append(p := copy.copy(first))
        object.__setattr__(p, "seed", i)
    assert seeded[-1] == replace(first, seed=n - 1)  # (what replace makes, checks and all)
    return seeded


@contextmanager
def gc_paused():
    """Python's cyclic GC off while the engine runs 10^4 sequences: its collections, which walk every live
    object, cost ~10% of a case's CPU (what is sampled is the same: nothing here frees resources through GC)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def chi_square_pvalue(counts: dict, joint: dict, allow_impossible: bool = False) -> float:
    n = sum(counts.values())
    impossible = {c: n for c, n in counts.items() if c not in joint}
    if impossible and allow_impossible:
        return 0.0  # impossible sequences: rejected outright
    assert not impossible, f"sequences with zero target probability were generated: {impossible}"
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * n >= 5]
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    expected = [joint[c] * n for c in big] + [n * (1 - sum(joint[c] for c in big))]
    pairs = [(o, e) for o, e in zip(observed, expected) if e > 1e-9]
    stat = sum((o - e) ** 2 / e for o, e in pairs)
    return float(chi2.sf(stat, len(pairs) - 1))


# case -> (engine settings, a check that the path under test was really taken)
CASES = {
    "sd": (dict(mode="sd", k=1), lambda m: m.rounds > 0),
    # The paper's top-F candidates covering every outcome: every round hits (coupled candidates cover a guess's support).
    "ssd_hit_path": (dict(k=1, fan_out=VOCAB * 2 - 1, adaptive_fan_out=False, bonus_draw="top_f"),
                     lambda m: m.cache_hits > 0 and m.cache_misses == 0),
    "ssd_miss_neural": (dict(k=1, fan_out=2, fallback="neural"), lambda m: m.fallbacks["neural"] > 0),
    "ssd_miss_fast": (dict(k=1, fan_out=2, fallback="fast"), lambda m: m.fallbacks["fast"] > 0),
    "ssd_miss_random": (dict(k=1, fan_out=2, fallback="random"), lambda m: m.fallbacks["random"] > 0),
    # Full coverage hits every round, so every glue after a hit skips x_K: k = K then always misses.
    "ssd_hit_glue_skip": (dict(k=1, fan_out=VOCAB * 2 - 1, adaptive_fan_out=False, hit_glue="skip", fallback="neural",
                               tree_policy="always", max_tokens=5),
                          lambda m: m.cache_hits > 0 and m.fallbacks["neural"] > 0),
    # The cases below that check the hit path build a tree every round: with the tree gate ("auto") a
    # case whose trees rarely hit may run without trees soon and end with none (the padded pair below:
    # 0.1-0.3% of lookups hit, and one CI run made 0 hits in 392 rounds).
    "ssd_saguaro_c": (dict(k=1, fan_out=4, saguaro_c=0.3, tree_policy="always"), lambda m: m.cache_hits > 0),
    "ssd_k2": (dict(k=2, fan_out=9, tree_policy="always"), lambda m: m.cache_hits > 0),
    # The draft proposes from its 2 likeliest of 6 tokens: any q is exact when the verifier is given it.
    "ssd_proposal_top_k": (dict(k=2, fan_out=6, proposal_top_k=2, fallback="neural", tree_policy="always"), lambda m: m.cache_hits > 0),
    "sd_proposal_top_k": (dict(mode="sd", k=2, proposal_top_k=2), lambda m: m.rounds > 0),
    # Prompt lookup: deterministic proposals (a one-hot q), no draft model.
    "ngram": (dict(mode="ngram", k=2), lambda m: m.accepted_tokens > 0),
    "ssd_draft_process": (dict(k=1, fan_out=3, fallback="neural", draft_executor="process", tree_policy="always", n=N_TWIN),
                          lambda m: m.cache_hits > 0 and m.fallbacks["neural"] > 0),
    "ssd_split_draft": (dict(k=1, fan_out=3, fallback="neural", draft_executor="split", tree_policy="always", n=N_TWIN),
                        lambda m: m.cache_hits > 0 and m.fallbacks["neural"] > 0),
    # Coupled bonus draws (spec/coupled.py): the bonus drawn against candidates drawn from the draft's guess.
    "ssd_coupled": (dict(k=2, fan_out=5, bonus_draw="coupled", fallback="neural", tree_policy="always", max_tokens=4),
                    lambda m: m.coupled_draws > 0 and m.cache_hits > 0 and m.fallbacks["neural"] > 0),
    "ssd_coupled_one_candidate": (dict(k=1, fan_out=2, bonus_draw="coupled", fallback="neural", tree_policy="always"),
                                  lambda m: m.coupled_draws > 0 and m.cache_hits > 0),
    "ssd_coupled_k1_hits_all": (dict(k=1, fan_out=VOCAB * 2 - 1, adaptive_fan_out=False, bonus_draw="coupled",
                                     tree_policy="always"), lambda m: m.coupled_draws > 0 and m.cache_hits > 0),
    "ssd_coupled_process": (dict(k=2, fan_out=5, bonus_draw="coupled", fallback="neural", draft_executor="process",
                                 tree_policy="always", n=N_TWIN), lambda m: m.coupled_draws > 0 and m.cache_hits > 0),
    # No trees: two cohorts, one drafted (on the draft's thread / in the child) while the other verifies.
    "ssd_cohorts": (dict(k=1, tree_policy="never"), lambda m: m.cohort_rounds > 0),
    "ssd_cohorts_split": (dict(k=1, tree_policy="never", draft_executor="split", n=N_TWIN), lambda m: m.cohort_rounds > 0),
}
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.8_topk4": SamplingParams(temperature=0.8, top_k=4),
    "t1_topp0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "t1_minp0.85": SamplingParams(temperature=1.0, min_p=0.85),  # this near-uniform target: about half its tokens stay
    "t1_penalties": SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=1.6),
    # the bias before the repetition penalty (vLLM's order): the penalty divides a biased logit
    "t1_bias": SamplingParams(temperature=1.0, logit_bias={0: 1.5, 2: -1.0, 4: 0.8}, allowed_token_ids=[0, 1, 2, 4, 5],
                              repetition_penalty=1.6),
}


def check_case(pair, case: str, params: SamplingParams) -> None:
    """The case's path is taken, and the joint it samples is the target's under params."""
    target, draft, model = pair
    settings, took_path = CASES[case]
    counts, metrics = sample_joint(target, draft, params, **settings)
    assert took_path(metrics), f"{case}: the path under test was not taken: {metrics}"
    p = chi_square_pvalue(counts, exact_joint(model, params))
    assert p > ALPHA, f"{case}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_tokens_follow_the_target(pair, case):
    check_case(pair, case, PARAMS["t1"])


@pytest.fixture(scope="module")
def padded_pairs(tmp_path_factory):
    """Qwen2.5's case in small: one tokenizer of VOCAB ids; the target has two padding rows more
    (random, so it samples them), one draft has none, another four (tests/test_vocab_padding.py)."""
    root = tmp_path_factory.mktemp("padded_sampling_pair")
    target = save_model(root / "target", llama_config(VOCAB + 2, 32, 1), seed=5, sharpen=2.0)
    save_tiny_tokenizer(root / "target")
    for rows in (VOCAB, VOCAB + 4):
        save_perturbed(root / f"draft{rows}", target, seed=6, noise=0.6)
        resized = LlamaForCausalLM.from_pretrained(root / f"draft{rows}")
        resized.resize_token_embeddings(rows, mean_resizing=False)
        resized.save_pretrained(root / f"draft{rows}")
        save_tiny_tokenizer(root / f"draft{rows}")
    return {rows: (str(root / "target"), str(root / f"draft{rows}"), target) for rows in (VOCAB, VOCAB + 4)}


@pytest.mark.parametrize("case,draft_rows", [("ssd_draft_process", VOCAB), ("ssd_miss_neural", VOCAB + 4)])
def test_a_draft_with_other_padding_rows_follows_the_target(padded_pairs, case, draft_rows):
    """The draft's q is zero on the target's padding ids, which the target still samples (and the draft
    then reads as a placeholder): the joint over every id the target has is the target's."""
    target, draft, model = padded_pairs[draft_rows]
    # The full N even over the child process: no thread-executor twin runs this draft of fewer rows.
    counts, metrics = sample_joint(target, draft, PARAMS["t1"], **(CASES[case][0] | {"n": N}))
    assert CASES[case][1](metrics), metrics
    assert any(t >= VOCAB for seq in counts for t in seq), "the target never sampled a padding id"
    p = chi_square_pvalue(counts, exact_joint(model, PARAMS["t1"]))
    assert p > ALPHA, f"{case}, draft of {draft_rows} rows: chi-square p = {p:.2e}"


@pytest.mark.parametrize("executor", ["thread", "split"])
def test_tree_gate_transitions_follow_the_target(pair, monkeypatch, executor):
    """Rounds with and without trees mixed, and rounds of n-gram proposals alone: each sequence's 3 tokens
    span a transition (split: the rounds without trees drafted on the thread, the others' trees built in
    the child)."""
    chosen = Counter()

    class CountingGate(CyclingGate):
        def mode(self, batch_size: int, sampled: bool = False, fast_estimate: float | None = None):
            chosen[mode := super().mode(batch_size, sampled)] += 1
            return mode
    monkeypatch.setattr(ssd_loop, "TreeGate", CountingGate)
    target, draft, model = pair
    counts, metrics = sample_joint(target, draft, PARAMS["t1"], k=1, fan_out=4, draft_executor=executor,
                                   n=N if executor == "thread" else N_TWIN)
    assert metrics.just_in_time_rounds > 0 and metrics.cache_hits > 0, metrics
    assert chosen[RoundMode.FAST] > 0, chosen  # (every such round also drafted for sequences admitted in it)
    p = chi_square_pvalue(counts, exact_joint(model, PARAMS["t1"]))
    assert p > ALPHA, f"chi-square p = {p:.2e}"


class EarlyLookupRoundsGate(CyclingGate):
    """Rounds 1 and 2 of n-gram proposals alone (a sequence's first round drafts just in time, its second is
    then a whole round of lookups), then just-in-time drafts and trees: long lookups decide the first tokens."""

    def __init__(self, modes=None):
        self.cycle, self.rounds = [RoundMode.TREES, RoundMode.FAST, RoundMode.FAST, RoundMode.JUST_IN_TIME], 0


@pytest.mark.parametrize("mode, executor, n", [("ngram", None, N), ("ssd", "thread", N), ("ssd", "split", N_TWIN)])
def test_lookup_rounds_of_every_length_follow_the_target(pair, monkeypatch, mode, executor, n):
    """Rounds of n-gram proposals alone at every candidate length in turn (engine/lookup_rounds.py; 8 tokens
    generated, 64 sequences at a time, so that whole rounds of lookups come early): a one-hot proposal of any
    length is verified exactly."""
    chosen = []
    monkeypatch.setattr(LookupLengths, "choose", every_lookup_length(chosen))
    monkeypatch.setattr(ssd_loop, "TreeGate", EarlyLookupRoundsGate)
    target, draft, model = pair
    settings = dict(mode="ngram", k=2) if mode == "ngram" else dict(k=1, fan_out=4, draft_executor=executor)
    counts, metrics = sample_joint(target, draft, PARAMS["t1"], max_tokens=8, n=n, whole_batches=True, **settings)
    assert max(chosen) == 3 * settings["k"] and 1 in chosen, Counter(chosen)
    assert mode == "ngram" or metrics.fast_rounds > 0, metrics
    p = chi_square_pvalue(counts, exact_joint(model, PARAMS["t1"]))
    assert p > ALPHA, f"chi-square p = {p:.2e}"


@pytest.mark.parametrize("gate, executor, n", [(LookupFavouringGate, "thread", N), (LookupFavouringGate, "split", N_TWIN),
                                               (JustInTimeLookupGate, "split", N)])
def test_rows_that_take_their_ngram_proposal_over_the_drafts_follow_the_target(pair, monkeypatch, gate, executor, n):
    """Rounds whose rows take their n-gram proposal instead of their tree or a draft made now
    (spec/lookup_pick.py; the draft's rows scripted to gain nothing and every proposal trusted before it
    is scored, so from the second round on): a one-hot proposal chosen from the tokens so far, verified
    exactly. With k = 1 a row that rejected in round 1 decides its third token in round 2."""
    monkeypatch.setattr(ssd_loop, "TreeGate", gate)
    monkeypatch.setattr(ssd_loop, "LookupPicker", trusting_picker())
    target, draft, model = pair
    counts, metrics = sample_joint(target, draft, PARAMS["t1"], k=1, fan_out=4, draft_executor=executor, n=n)
    assert metrics.lookup_rows > 0, metrics  # (every row that could look its tree up took its n-gram proposal)
    p = chi_square_pvalue(counts, exact_joint(model, PARAMS["t1"]))
    assert p > ALPHA, f"chi-square p = {p:.2e}"


def always_accept(target_probs, draft_tokens, draft_probs, generators, coupling=None):
    """A broken verifier: accepts every draft token, bonus from p_{K+1}."""
    b, k = draft_tokens.shape
    bonus = torch.stack([torch.multinomial(target_probs[i, k], 1, generator=g)[0] for i, g in enumerate(generators)])
    return VerifyResult(accepted=torch.full((b,), k, dtype=torch.long), bonus=bonus)


def bonus_from_p(target_probs, draft_tokens, draft_probs, generators, coupling=None):
    """A broken verifier: the right acceptance test, but the bonus drawn from p instead of the residual."""
    result = verify(target_probs, draft_tokens, draft_probs, generators)
    rows = torch.arange(len(draft_tokens))
    p = target_probs[rows, result.accepted]
    bonus = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i, g in enumerate(generators)])
    return VerifyResult(accepted=result.accepted, bonus=bonus)


def coupling_without_the_residual_step(residual, guess, candidates, uniforms):
    """A broken coupled draw: a candidate accepted with min(1, r / g) as it should be, but after a rejection
    the bonus drawn from r itself instead of the residual norm(max(0, r - g)): candidates come out too often."""
    rows = torch.arange(len(residual))
    y = candidates[:, 0].clamp_min(0)
    g = guess / guess.sum(-1, keepdim=True).clamp_min(1e-30)
    accept = (candidates[:, 0] >= 0) & (uniforms[:, 0] * g[rows, y] < residual[rows, y])
    return torch.where(accept, y, sample_with_uniforms(residual, uniforms[:, -1]))


def test_the_test_catches_a_broken_coupled_draw(pair, monkeypatch):
    monkeypatch.setattr(coupled_module, "coupled_bonus", coupling_without_the_residual_step)
    target, draft, model = pair
    settings, took_path = CASES["ssd_coupled_one_candidate"]  # a bonus in every round's first two tokens
    counts, metrics = sample_joint(target, draft, PARAMS["t1"], **settings)
    assert took_path(metrics)
    assert chi_square_pvalue(counts, exact_joint(model, PARAMS["t1"]), allow_impossible=True) < ALPHA


@pytest.mark.parametrize("broken", [always_accept, bonus_from_p], ids=["always_accept", "bonus_from_p"])
def test_the_test_catches_a_broken_verifier(pair, monkeypatch, broken):
    target, draft, model = pair
    monkeypatch.setattr(target_module, "verify", broken)
    params = PARAMS["t1"]
    counts, _ = sample_joint(target, draft, params, k=1, fan_out=4)
    p = chi_square_pvalue(counts, exact_joint(model, params), allow_impossible=True)
    assert p < ALPHA, f"broken verifier {broken.__name__} went unnoticed (p = {p:.2e})"
