"""Sampled (T > 0) exactness of the knob combinations and later rounds that tests/test_engine_sampling*.py leave out.

Those suites count the first 3 generated tokens: the prefill's token, a just-in-time draft's round and at most
one round from a tree built after that draft. No speculation from a tree built after a hit (adopted branch KV,
hit_glue), no adapted budget, no steady state of two cohorts, no sequence leaving the draft, no restarted draft
child ever decides a counted token; and every batch there shares one SamplingParams, mostly T = 1. Here:
batches whose rows differ (temperatures, filters, penalties, prompts, greedy rows beside sampled ones) on every
loop; Saguaro sampling (C < 1) with the paper's top-F bonus, at C = 0, after truncation and proposal_top_k,
on the split draft at T = 1.8; the tree's shape knobs (fan_out_kind, explicit fan-out, adaptive budget,
hit_glue skip) under coupled draws; SSD without trees in one and two cohorts over the child process; penalties,
logit bias, min-p, top-p and structured outputs on coupled / Saguaro trees, the random and fast backups and over
the child process; sequences outgrowing the draft's context; the scripted tree-gate transitions over 10 tokens;
a draft child SIGKILLed mid-generation.

Method: the pair of tests/test_engine_sampling.py (V = 6, the draft the target plus 60% weight noise), seeded
requests of 10 tokens, two tests per request kind (ALPHA, the false-alarm rate of a test function, is split
over them, Bonferroni): (1) Pearson chi-square of the joint of the first 3 tokens against the target's exact
joint, enumerated with transformers (cells expected under 5 pooled), as test_engine_sampling.py does; (2)
conditional_pvalue: every token after the first against the target's exact distribution given the tokens
before it (teacher-forced), a chi-square that sees every round. The reference (reference_probs) is written
apart from saguaro_dist.spec. Each test also checks that its path was taken (metrics). The last tests break the
engine on purpose and show these tests reject it (p-values in the report / printed with -s).

A child-process twin of a thread case with the same groups and engine path samples N_TWIN requests (as
tests/test_engine_sampling.py's twins): the thread case carries the power, the twin proves the transport changes
nothing. The killed-child cases sample N_KILLED: a bug of the restarted sequences touches only the rows in flight
at the 3 kills (at most 3 x 64, whatever n), so fewer rows in all dilute them less, and the test sees it better.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chi2
from transformers import LlamaForCausalLM

import saguaro_dist.engine.draft_worker as draft_worker_module
import saguaro_dist.engine.target as target_module
from engine_helpers import DEVICE, assert_greedy_equal, llama_config, save_model, save_perturbed
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.spec import VerifyResult

VOCAB, ALPHA = 6, 1e-4
N = 4000  # requests per test (split over its groups)
N_TWIN = 1500  # a child-process twin of a thread case (see above)
N_KILLED = 1500  # the killed-child cases: enough rounds for the 75th message to the child (see above)
DEPTH = 10  # tokens generated per request: the joint of the first 3 tested, and each one after the first
# Rows a step. Every request samples from its own seeded streams, so its tokens (and whether its lookups hit) do
# not depend on its batch mates: 256 rows a step give the very tokens of 64 (checked case by case on 600
# requests: the same tokens, cache hits, misses, coupled draws) at about 2/3 of the CPU (fewer, fuller rounds).
# Cases whose point needs 64 rows a step, or whose tokens depend on the batch, say max_batch_size=64: the killed
# child's (its 75th message, 3 x 64 rows in flight), whole batches that must all hit (hit_glue_skip), a 3 ms tree
# timeout (late trees beside hits), chunked prefill, n-gram rounds (lookup lengths chosen from the whole batch's
# acceptances), the cycling tree gate and the scripted budget (their cycles count rounds and builds).
BATCH = 256
PROMPT_A, PROMPT_B, PROMPT_C = [1, 2, 3], [4, 0, 5, 2, 1, 3, 3], [2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target path, draft path, target model): test_engine_sampling's pair (V = 6, a 1-layer target and a
    draft of the target's weights plus 60% noise)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("exactness_paths")
    target = save_model(root / "target", llama_config(VOCAB, 32, 1), seed=3, sharpen=2.0)
    save_perturbed(root / "draft", target, seed=4, noise=0.6)
    draft = LlamaForCausalLM.from_pretrained(root / "draft").eval()
    return str(root / "target"), str(root / "draft"), target, draft


# ---- the reference: plain sampling of the target, written apart from saguaro_dist.spec ----------------------

def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt: list[int], outputs: torch.Tensor) -> torch.Tensor:
    """Plain sampling's next-token distribution [R, V] after each of R outputs so far ([R, L] token ids), in
    vLLM's order: logit bias and allowed tokens, repetition (prompt and output), presence and frequency
    (output), temperature, min-p, top-k, top-p (ties at a cut-off: the lower id first)."""
    logits = logits.double().clone()
    r, v = logits.shape
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), v).double()
    for t, bias in p.logit_bias:
        logits[:, t] += bias
    if p.allowed_token_ids is not None:
        logits[:, [t for t in range(v) if t not in p.allowed_token_ids]] = float("-inf")
    counts = torch.zeros(r, v, dtype=torch.float64)
    if outputs.shape[1]:
        counts.scatter_add_(1, outputs, torch.ones(outputs.shape, dtype=torch.float64))
    seen = counts > 0
    seen[:, prompt] = True
    logits = torch.where(seen, torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty),
                         logits)
    logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    logits = logits / p.temperature
    if p.min_p:
        tempered = logits.softmax(-1)
        logits = logits.masked_fill(tempered < p.min_p * tempered.amax(-1, keepdim=True), float("-inf"))
    if p.top_k:
        order = logits.sort(dim=-1, descending=True, stable=True).indices
        logits = logits.scatter(1, order[:, p.top_k:], float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < p.top_p
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The argmax of a whole forward at each step (transformers' generate, which decodes over its KV cache,
    chose otherwise at a 0.004 top-2 gap of PROMPT_B's continuation)."""
    tokens = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def exact_joint(model, prompt: list[int], params: SamplingParams, depth: int) -> torch.Tensor:
    """P(first `depth` tokens) under plain sampling of `model`, by enumeration: a tensor [V] * depth."""
    joint = torch.ones(())
    for d in range(depth):
        # every output so far, row-major as joint's cells (cartesian_prod of one range is that range, flat)
        prefixes = (torch.cartesian_prod(*[torch.arange(VOCAB)] * d).reshape(-1, d) if d
                    else torch.zeros(1, 0, dtype=torch.long))
        with torch.no_grad():
            logits = model(torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)).logits[:, -1]
        step = reference_probs(logits, params, prompt, prefixes)
        joint = joint.double().reshape(-1, 1) * step
        joint = joint.reshape([VOCAB] * (d + 1))
    return joint


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of counts against probs (same shape). Cells expected under 5 are pooled, in
    order of probability, into bins expected at 5 or more (one pool of them all left no cell at all for a
    near-uniform joint of 216 cells over 400 samples). A count in a cell of probability 0 is a rejection
    outright (p = 0)."""
    counts, probs = counts.flatten().double(), probs.flatten()
    n = float(counts.sum())
    if bool((counts[probs <= 0] > 0).any()):
        return 0.0
    order = probs.argsort(descending=True)
    counts, probs = counts[order], probs[order]
    observed, expected = [], []
    for o, e in zip(counts.tolist(), (probs * n).tolist()):
        if expected and expected[-1] < 5:
            observed[-1], expected[-1] = observed[-1] + o, expected[-1] + e
        else:
            observed.append(o)
            expected.append(e)
    if len(expected) > 1 and expected[-1] < 5:  # the last bin, short of 5, joins the one before it
        observed[-2:], expected[-2:] = [sum(observed[-2:])], [sum(expected[-2:])]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 1e-9)
    return float(chi2.sf(stat, len(expected) - 1)) if len(expected) > 1 else 1.0


def conditional_pvalue(model, prompt: list[int], params: SamplingParams, outputs: list[list[int]]) -> float:
    """Every generated token after the first, against the target's exact distribution given the request's
    own tokens before it (one teacher-forced forward of all outputs). At position j, with p_i the reference
    distribution of row i there, r = sum_i (onehot(t_ij) - p_i) has mean 0 and covariance
    S = sum_i (diag(p_i) - p_i p_i^T) under exactness, and the positions' r are martingale differences
    (uncorrelated): sum_j r_j^T S_j^+ r_j is chi-square with sum_j rank(S_j) degrees of freedom (CLT over the
    independent rows). Unlike a joint over the first tokens, it sees every round of a long request: those
    after trees built after hits, adapted budgets, sequences that left the draft. A token of probability 0
    is a rejection outright (p = 0)."""
    outs = torch.tensor(outputs)
    n, depth = outs.shape
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(n, -1), outs[:, :-1]], 1)).logits[:, len(prompt) - 1:]
    stat, df = 0.0, 0
    for j in range(1, depth):
        p = reference_probs(logits[:, j], params, prompt, outs[:, :j])
        if bool((p.gather(1, outs[:, j:j + 1]) <= 0).any()):
            return 0.0
        r = torch.nn.functional.one_hot(outs[:, j], p.shape[1]).double().sum(0) - p.sum(0)
        cov = torch.diag(p.sum(0)) - p.T @ p
        stat += float(r @ torch.linalg.pinv(cov, hermitian=True) @ r)
        df += int(torch.linalg.matrix_rank(cov, hermitian=True))
    return float(chi2.sf(stat, df))


def request_pvalues(model, prompt: list[int], params: SamplingParams, outputs: list[list[int]]) -> list[float]:
    """[the chi-square p of the joint of the first 3 tokens (test_engine_sampling.py's test), conditional_pvalue]"""
    counts = torch.zeros([VOCAB] * 3)
    counts.index_put_(tuple(torch.tensor([o[:3] for o in outputs]).T), torch.ones(len(outputs)), accumulate=True)
    return [chi_square_pvalue(counts, exact_joint(model, prompt, params, 3)),
            conditional_pvalue(model, prompt, params, outputs)]


# ---- running the engine ------------------------------------------------------------------------------------

def generate(target: str, draft: str | None, requests: list[tuple[list[int], SamplingParams]], **engine):
    """Each request's output tokens, the engine's metrics and each request's; BATCH rows at a time (or
    max_batch_size), continuously batched, or in whole batches of 64 (whole_batches: every row of a round admitted
    together, none after)."""
    mode, whole = engine.pop("mode", "ssd"), engine.pop("whole_batches", False)
    batch = engine.pop("max_batch_size", BATCH)
    if mode in ("ngram", "ar"):
        draft = None
    else:
        engine.setdefault("draft_executor", "thread")
    if engine.get("draft_executor") in ("process", "split"):
        # one torch thread each: on the shared 2-core box a child on every core ran 5-20x slower
        engine.setdefault("draft_threads", 1)
        engine.setdefault("target_threads", 1)
    calls = [requests[i:i + 64] for i in range(0, len(requests), 64)] if whole else [requests]
    with LLM(device=DEVICE, model=target, draft=draft, mode=mode, max_batch_size=batch, **engine) as llm:
        outs = [o for call in calls for o in llm.generate(prompt_token_ids=[p for p, _ in call],
                                                          sampling_params=[s for _, s in call], use_tqdm=False)]
        return [o.token_ids for o in outs], llm.metrics, [o.metrics for o in outs]


def seeded(groups: list[tuple[list[int], SamplingParams]], n: int, max_tokens: int = DEPTH):
    """n requests cycling through the groups (so every batch mixes them), seeds 0..n-1."""
    return [(groups[i % len(groups)][0], replace(groups[i % len(groups)][1], max_tokens=max_tokens, ignore_eos=True,
                                                  seed=i)) for i in range(n)]


def group_pvalues(model, groups, outputs) -> list[float]:
    """Per group (requests cycling through them, as seeded's), its request_pvalues."""
    return [p for g, (prompt, params) in enumerate(groups)
            for p in request_pvalues(model, prompt, params, outputs[g::len(groups)])]


def check(pair, groups, took_path, n: int = N, **engine) -> list[float]:
    """Run the groups mixed in one call; assert the path was taken and every group follows the target (ALPHA
    split over the groups' two tests)."""
    target, draft, model, _ = pair
    outputs, metrics, _ = generate(target, draft, seeded(groups, n), **engine)
    assert took_path(metrics), f"the path under test was not taken: {metrics}"
    pvalues = group_pvalues(model, groups, outputs)
    print(f"p per group [first-3 joint, conditional]: {['%.3g' % p for p in pvalues]} (hits {metrics.cache_hits}, misses "
          f"{metrics.cache_misses}, fallbacks {dict(metrics.fallbacks)}, coupled {metrics.coupled_draws})")
    assert min(pvalues) > ALPHA / len(pvalues), f"p per group [first-3 joint, conditional]: {pvalues}"
    return pvalues


T1 = SamplingParams(temperature=1.0)
MISSES = (2, 1, 1)  # k = 2's fan-out: 2 of the 5 bonus tokens of k* = 0 cached, 1 of k* = 1, 2: hits and misses
HITS_AND_MISSES = lambda m: m.cache_hits > 0 and m.fallbacks["neural"] > 0
TREES = dict(tree_policy="always", hit_glue="always", fallback="neural")  # no timing-driven choice of path


# ---- 1. batches whose rows differ ----------------------------------------------------------------------------

MIXED = [
    (PROMPT_A, SamplingParams(temperature=1.0)),
    (PROMPT_B, SamplingParams(temperature=0.6, top_k=3)),
    (PROMPT_A, SamplingParams(temperature=1.5, top_p=0.8)),
    (PROMPT_C, SamplingParams(temperature=0.9, min_p=0.3, presence_penalty=0.8, repetition_penalty=1.5)),
]
GREEDY_ROWS = [(PROMPT_A, SamplingParams(temperature=0)), (PROMPT_B, SamplingParams(temperature=0))]

MIXED_CASES = {
    "sd": (dict(mode="sd", k=2), lambda m: m.rounds > 0),
    "ssd_coupled": (dict(k=2, fan_out=MISSES, **TREES), lambda m: HITS_AND_MISSES(m) and m.coupled_draws > 0),
    "ssd_top_f_saguaro": (dict(k=2, fan_out=MISSES, bonus_draw="top_f", saguaro_c=0.4, **TREES), HITS_AND_MISSES),
    "ssd_cohorts": (dict(k=1, tree_policy="never", jit_cohorts=2), lambda m: m.cohort_rounds > 0),
    "ssd_process": (dict(k=2, fan_out=MISSES, draft_executor="process", n=3000, **TREES),
                    lambda m: HITS_AND_MISSES(m) and m.coupled_draws > 0),
    "ngram": (dict(mode="ngram", k=2, max_batch_size=64), lambda m: m.rounds > 0),  # (its lookup lengths: the batch's)
    # 24 prompt tokens a step: prompts split over steps, prefilled between the running rows' rounds
    "ssd_chunked_prefill": (dict(k=2, fan_out=MISSES, max_num_batched_tokens=24, n=2400, max_batch_size=64,
                                 **TREES), HITS_AND_MISSES),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MIXED_CASES))
def test_a_batch_of_different_requests_follows_each_ones_target(pair, case):
    """Four kinds of sampled request (three prompts; T 0.6..1.5; top-k, top-p, min-p with penalties) and two
    greedy ones, interleaved so that every batch holds them all: each sampled kind's joint is its own target's,
    and each greedy row is the target's greedy continuation (no batch-mate's settings leak into a row)."""
    target, draft, model, _ = pair
    settings, took_path = MIXED_CASES[case]
    settings = dict(settings)
    groups = MIXED + GREEDY_ROWS
    outputs, metrics, _ = generate(target, draft, seeded(groups, settings.pop("n", 4800)), **settings)
    assert took_path(metrics), metrics
    for g, (prompt, _) in enumerate(GREEDY_ROWS, start=len(MIXED)):
        want = greedy_reference(model, prompt, DEPTH)
        for got in {tuple(o) for o in outputs[g::len(groups)]}:
            assert_greedy_equal(list(got), want, prompt, model)
    sampled = [o for i, o in enumerate(outputs) if i % len(groups) < len(MIXED)]
    pvalues = group_pvalues(model, MIXED, sampled)
    print(f"p per group [first-3 joint, conditional]: {['%.3g' % p for p in pvalues]}")
    assert min(pvalues) > ALPHA / len(pvalues), f"{case}: p per group [first-3 joint, conditional] {pvalues}"


# ---- 2. Saguaro sampling (C < 1) beyond the coupled default ------------------------------------------------

SAGUARO_CASES = {
    # the paper's configuration: top-F candidates, sigma_{F,C} on the trees' draws and the neural backup's
    "top_f_c0.3_k2": (dict(k=2, fan_out=MISSES, saguaro_c=0.3, bonus_draw="top_f", **TREES), T1),
    # C = 0: the draft never proposes its top-F tokens; q is zero there and the ratio test sees tokens q lacks
    "top_f_c0_k1": (dict(k=1, fan_out=(2, 2), saguaro_c=0.0, bonus_draw="top_f", **TREES), T1),
    # sigma after the request's truncation, then the draft's top-3 proposal: three rescalings of q in a row
    "coupled_c0.5_proposal_top_k_truncated": (dict(k=2, fan_out=MISSES, saguaro_c=0.5, proposal_top_k=3, **TREES),
                                              SamplingParams(temperature=0.7, top_k=5, top_p=0.95)),
    # the target waits at most 3 ms for a tree or a plan: late trees (misses), late plans (no coupling), trees
    # of earlier rounds arriving late; which rows are late is timing's choice (p-values vary run to run)
    "process_late_trees": (dict(k=2, fan_out=MISSES, saguaro_c=0.5, draft_executor="process", tree_timeout_s=0.003,
                                n=2500, max_batch_size=64, **TREES), T1),
    "split_c0.5_hot": (dict(k=1, fan_out=(2, 2), saguaro_c=0.5, draft_executor="split", n=3000, **TREES),
                       SamplingParams(temperature=1.8)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SAGUARO_CASES))
def test_saguaro_sampling_follows_the_target(pair, case):
    settings, params = SAGUARO_CASES[case]
    late = (lambda m: m.late_trees > 0) if "tree_timeout_s" in settings else (lambda m: True)
    check(pair, [(PROMPT_A, params)], lambda m: HITS_AND_MISSES(m) and late(m), **settings)


# ---- 3. the tree's shape under coupled draws ---------------------------------------------------------------

COUPLED_HITS_AND_MISSES = lambda m: HITS_AND_MISSES(m) and m.coupled_draws > 0
SHAPE_CASES = {
    "geometric": (dict(fan_out_kind="geometric", fan_out=4), COUPLED_HITS_AND_MISSES),
    "uniform": (dict(fan_out_kind="uniform", fan_out=5), COUPLED_HITS_AND_MISSES),
    "explicit_fan_out": (dict(fan_out=(1, 3, 2)), COUPLED_HITS_AND_MISSES),
    # the budget rescaled after every measured build (BudgetController scripted: 1, 1/2, 1/3 of 9 branches)
    "adaptive_budget": (dict(fan_out=9, adaptive_fan_out=True, max_batch_size=64), COUPLED_HITS_AND_MISSES),
    # k = 1, every outcome covered (5 + 6 branches): trees built after a hit leave k = K out, so the misses
    # are exactly those k = K outcomes. Whole batches: a glue skips x_K only when every row in it hit.
    "hit_glue_skip": (dict(k=1, fan_out=(5, 6), hit_glue="skip", whole_batches=True, max_batch_size=64),
                      lambda m: COUPLED_HITS_AND_MISSES(m) and m.late_trees == 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_tree_shapes_follow_the_target_under_coupled_draws(pair, case, monkeypatch):
    """k = 2 (hit_glue_skip: 1), trees every round, coupled bonus draws at T = 0.8: each knob changes which
    outcomes have branches and how many candidates each outcome's bonus is drawn against. Over 10 tokens, most
    are decided by speculations from trees built after hits (adopted branches: the trees hit_glue skips)."""
    from saguaro_dist.spec.budget import BudgetController
    scales = []

    def scripted(self, target_wait_s=0.0):  # in place of the idle-time measurement, which timing decides
        scales.append(self.scale)
        self.scale, self._built_at = max(self.floor, (1.0, 0.5, 0.3)[len(scales) % 3]), None
    if case == "adaptive_budget":
        monkeypatch.setattr(BudgetController, "outcomes_arrived", scripted)
    extra, took = SHAPE_CASES[case]
    check(pair, [(PROMPT_A, SamplingParams(temperature=0.8))], took, **(TREES | dict(k=2) | extra))
    assert case != "adaptive_budget" or len(set(scales)) == 3, set(scales)


# ---- 4. SSD without trees ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("cohorts, executor", [(1, "thread"), (2, "process")])
def test_rounds_without_trees_follow_the_target(pair, cohorts, executor):
    """tree_policy "never": SD's rounds on SSD's placement, the batch whole (jit_cohorts 1) or in two cohorts
    drafted by the child process beside the other's verify (no coupling, no cache)."""
    took = (lambda m: m.cohort_rounds > 0) if cohorts == 2 else (lambda m: m.cohort_rounds == 0 and m.jit_rounds > 0)
    check(pair, [(PROMPT_A, SamplingParams(temperature=0.9, top_k=4))], took, k=2, tree_policy="never",
          jit_cohorts=cohorts, draft_executor=executor)


# ---- 5. request constraints on more paths ------------------------------------------------------------------

PENALIZED_BIASED = SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=1.6,
                                  logit_bias={0: 1.5, 2: -1.0, 4: 0.8}, allowed_token_ids=[0, 1, 2, 4, 5])
CONSTRAINED_CASES = {
    # penalties counted over each branch's own path, k = 2 deep, with candidates drawn for a coupled bonus
    "coupled_k2_penalties_bias": (dict(k=2, fan_out=MISSES, **TREES), PENALIZED_BIASED,
                                  lambda m: HITS_AND_MISSES(m) and m.coupled_draws > 0),
    "saguaro_top_f_penalties": (dict(k=2, fan_out=MISSES, saguaro_c=0.4, bonus_draw="top_f", **TREES),
                                replace(PENALIZED_BIASED, logit_bias={}, allowed_token_ids=None), HITS_AND_MISSES),
    "process_coupled_min_p_penalties": (dict(k=2, fan_out=MISSES, draft_executor="process", **TREES),
                                        SamplingParams(temperature=1.0, min_p=0.5, repetition_penalty=1.6,
                                                       frequency_penalty=0.5),
                                        lambda m: HITS_AND_MISSES(m) and m.coupled_draws > 0),
    # random tokens on a miss (q uniform) against a target whose top-k leaves half the vocabulary at 0
    "random_backup_k2_top_k": (dict(k=2, fan_out=MISSES, tree_policy="always", fallback="random"),
                               SamplingParams(temperature=0.8, top_k=3),
                               lambda m: m.cache_hits > 0 and m.fallbacks["random"] > 0),
    "fast_backup_k3_bias_top_p": (dict(k=3, fan_out=(1, 1, 1, 1), tree_policy="always", fallback="fast"),
                                  replace(PENALIZED_BIASED, top_p=0.9),
                                  lambda m: m.cache_hits > 0 and m.fallbacks["fast"] > 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CONSTRAINED_CASES))
def test_constrained_requests_follow_the_constrained_target(pair, case):
    settings, params, took = CONSTRAINED_CASES[case]
    check(pair, [(PROMPT_A, params)], took, **settings)


# ---- 6. sequences outgrowing the draft's context -----------------------------------------------------------

DRAFT_CONTEXT = 10  # sequences of up to 10 tokens stay on the draft (its trees run in its position slack past them)
PROMPT_LONG = [3, 1, 4, 1, 5, 0, 2, 3, 5, 4, 1, 2]  # 12 tokens: past the draft's room from the start


@pytest.fixture(scope="module")
def short_draft(pair, tmp_path_factory):
    """The pair's draft, its context cut to DRAFT_CONTEXT positions (tests/test_draft_context.py's case)."""
    path = tmp_path_factory.mktemp("short_draft") / "draft"
    draft = LlamaForCausalLM.from_pretrained(pair[1])
    draft.config.max_position_embeddings = DRAFT_CONTEXT
    draft.save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("mode, executor", [("sd", "thread"), ("ssd", "thread"), ("ssd", "process")])
def test_sequences_outgrowing_the_draft_follow_the_target(pair, short_draft, mode, executor):
    """Sampled rows that leave the draft mid-request (PROMPT_B: 7 tokens, 8 after the prefill; it leaves once
    past 10), rows that never had it (PROMPT_LONG) and rows that stay (PROMPT_A), in one batch: the leavers'
    tokens switch from the draft's proposals (trees, coupled draws) to the fast backup's at T > 0."""
    target, _, model, _ = pair
    groups = [(PROMPT_B, SamplingParams(temperature=1.0)), (PROMPT_LONG, SamplingParams(temperature=0.8, top_k=4)),
              (PROMPT_A, SamplingParams(temperature=1.0))]
    settings = dict(mode=mode, k=2, draft_executor=executor) | (dict(fan_out=MISSES, **TREES) if mode == "ssd" else {})
    n = 3000 if executor == "thread" else N_TWIN  # (ssd, process): the twin of (ssd, thread)
    outputs, metrics, per_request = generate(target, short_draft, seeded(groups, n), **settings)
    assert metrics.fallbacks["fast"] > 0 and metrics.accepted_tokens > 0, metrics
    # PROMPT_B's rows: some drafted by the draft first, then by the fast backup (the only fast proposals
    # here: misses take the neural backup); PROMPT_LONG's: the fast backup throughout
    left = [m for m in per_request[0::3] if 0 < m.fallbacks.get("fast", 0) < m.rounds]
    assert len(left) > 100, [(m.rounds, m.fallbacks) for m in per_request[0:30:3]]
    assert all(m.fallbacks.get("fast", 0) == m.rounds for m in per_request[1::3])
    assert mode == "sd" or (metrics.cache_hits > 0 and metrics.coupled_draws > 0), metrics
    pvalues = group_pvalues(model, groups, outputs)
    print(f"p per group [first-3 joint, conditional]: {['%.3g' % p for p in pvalues]}")
    assert min(pvalues) > ALPHA / len(pvalues), pvalues


# ---- 7. structured outputs on the coupled, Saguaro-sampled trees ------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(saguaro_c=0.5), dict(bonus_draw="top_f", draft_executor="process")],
                         ids=["coupled_saguaro", "top_f_process"])
def test_structured_outputs_follow_the_masked_target_on_trees(pair, tmp_path_factory, settings):
    """test_engine_sampling_constraints.py's grammar ([ab][a-d][bcd]+ over a..e, <eos>) on k = 2 trees: each
    branch's draws masked along its own path, the coupled candidates drawn from a masked guess, sigma_{F,C}
    applied after the mask; its reference (GRAMMAR_STEPS) covers 3 tokens."""
    from test_engine_sampling import GRAMMAR, sample_joint, save_tiny_tokenizer
    from test_engine_sampling import chi_square_pvalue as pooled_pvalue, exact_joint as grammar_joint
    target, draft, model, _ = pair
    root = tmp_path_factory.mktemp("grammar_pair")
    for name, path in (("target", target), ("draft", draft)):
        LlamaForCausalLM.from_pretrained(path).save_pretrained(root / name)
        save_tiny_tokenizer(root / name)
    params = SamplingParams(temperature=1.0, structured_outputs=GRAMMAR)
    engine = TREES | dict(k=2, fan_out=MISSES) | settings
    if engine.get("draft_executor") == "process":
        engine |= dict(draft_threads=1, target_threads=1)
    counts, metrics = sample_joint(str(root / "target"), str(root / "draft"), params, n=3000, **engine)
    assert metrics.cache_hits > 0 and metrics.fallbacks["neural"] > 0, metrics
    p = pooled_pvalue(counts, grammar_joint(model, params))
    print(f"p = {p:.3g}")
    assert p > ALPHA, f"chi-square p = {p:.2e}"


# ---- 8. round-mode transitions and n-gram proposals, over 10 tokens ----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("gate, executor", [("cycling", "thread"), ("cycling", "split"), ("lookup_favouring", "thread"),
                                            ("early_lookup_rounds", "thread")])
def test_round_modes_mixed_follow_the_target_over_ten_tokens(pair, monkeypatch, gate, executor):
    """test_engine_sampling.py's scripted tree gates (trees, trees, just in time, n-gram rounds; rows taking
    their n-gram proposal; early rounds of n-gram proposals of every length), whose transitions it checks on
    the first 3 tokens only: here every token of 10, with T = 0.9, top-p and penalties (counted over n-gram
    proposals up to 3K = 6 tokens long)."""
    import saguaro_dist.engine.ssd_loop as ssd_loop
    from engine_helpers import CyclingGate, LookupFavouringGate, every_lookup_length, trusting_picker
    from saguaro_dist.spec.lookup_length import LookupLengths
    from test_engine_sampling import EarlyLookupRoundsGate
    chosen = []
    monkeypatch.setattr(ssd_loop, "TreeGate", {"cycling": CyclingGate, "lookup_favouring": LookupFavouringGate,
                                               "early_lookup_rounds": EarlyLookupRoundsGate}[gate])
    if gate == "lookup_favouring":
        monkeypatch.setattr(ssd_loop, "LookupPicker", trusting_picker())
    if gate == "early_lookup_rounds":
        monkeypatch.setattr(LookupLengths, "choose", every_lookup_length(chosen))
    took = {"cycling": lambda m: m.just_in_time_rounds > 0 and m.cache_hits > 0 and m.fast_rounds > 0,
            "lookup_favouring": lambda m: m.lookup_rows > 0,
            "early_lookup_rounds": lambda m: m.fast_rounds > 0}[gate]
    params = SamplingParams(temperature=0.9, top_p=0.9, frequency_penalty=0.4, repetition_penalty=1.3)
    check(pair, [(PROMPT_A, params)], took, n=3000 if executor == "thread" else N_TWIN, k=2, fan_out=MISSES,
          draft_executor=executor, whole_batches=gate == "early_lookup_rounds",
          max_batch_size=64 if gate in ("cycling", "lookup_favouring") else BATCH)  # (fallback auto: neural or fast by batch size)
    assert gate != "early_lookup_rounds" or max(chosen) == 6, chosen


# ---- 9. a draft process that dies mid-generation -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("executor, tree_policy", [("process", "always"), ("split", "always"), ("process", "never")])
def test_a_draft_process_killed_mid_generation_costs_speed_not_the_distribution(pair, monkeypatch, executor, tree_policy):
    """The child is SIGKILLed three times while it builds trees (or drafts a cohort): its trees and drafts in
    flight are lost (misses; a cohort's drafts fall to the fast backup), its sequences are prefilled again on
    a new child (round 0 again: the substreams keyed by length must not repeat a draw that already shaped the
    output) and go on; every token still the target's."""
    import os
    import signal

    from saguaro_dist.engine.draft_process import DraftProcess
    calls, kills = [], []

    def killing(method):  # the 15th, 45th and 75th message to the child (outcomes, cohorts' drafts) finds it dead
        def call(self, msgs):
            calls.append(1)
            if len(calls) in (15, 45, 75) and not self._gone:
                os.kill(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
                kills.append(self._proc.pid)
            return method(self, msgs)
        return call
    restart, restarts = DraftProcess._restart, []

    def counted_restart(self, seq_ids):
        restarts.append(len(seq_ids))
        return restart(self, seq_ids)
    for name in ("send_outcomes", "start_jit_draft"):
        monkeypatch.setattr(DraftProcess, name, killing(getattr(DraftProcess, name)))
    monkeypatch.setattr(DraftProcess, "_restart", counted_restart)
    settings = dict(k=2, draft_executor=executor, tree_policy=tree_policy, fallback="neural")
    settings |= dict(fan_out=MISSES, hit_glue="always") if tree_policy == "always" else dict(jit_cohorts=2)
    check(pair, [(PROMPT_A, SamplingParams(temperature=1.0))], lambda m: m.rounds > 0, n=N_KILLED,
          max_batch_size=64, **settings)
    # (a kill late in the run may find one sequence left: at least one restart must re-prefill several)
    assert len(kills) == 3 and len(restarts) == 3 and min(restarts) >= 1 and max(restarts) > 1, (kills, restarts)


# ---- 10. the test's power: deliberately broken engines ---------------------------------------------------------

def always_accept(target_probs, draft_tokens, draft_probs, generators, coupling=None):
    """A broken verifier: every draft token accepted, the bonus from p_{K+1}."""
    b, k = draft_tokens.shape
    bonus = torch.stack([torch.multinomial(target_probs[i, k], 1, generator=g)[0] for i, g in enumerate(generators)])
    return VerifyResult(accepted=torch.full((b,), k, dtype=torch.long), bonus=bonus)


def broken_pvalues(pair, groups, n: int = N, **engine) -> list[float]:
    target, draft, model, _ = pair
    outputs, _, _ = generate(target, draft, seeded(groups, n), **engine)
    pvalues = group_pvalues(model, groups, outputs)
    print("broken: p per group [first-3 joint, conditional]:", ["%.3g" % p for p in pvalues])
    return pvalues


@pytest.mark.slow
def test_the_test_catches_a_verifier_that_accepts_everything(pair, monkeypatch):
    monkeypatch.setattr(target_module, "verify", always_accept)
    settings, params = SAGUARO_CASES["top_f_c0.3_k2"]
    pvalues = broken_pvalues(pair, [(PROMPT_A, params)], **settings)
    assert max(pvalues) < ALPHA, pvalues


@pytest.mark.slow
def test_the_test_catches_saguaro_draws_verified_against_the_unscaled_q(pair, monkeypatch):
    """The draft samples from sigma_{F,C} but hands the verifier its plain distribution as q."""
    scaled = []
    proposal_probs, sample = draft_worker_module.DraftWorker._proposal_probs, draft_worker_module.sample

    def unscaled_q(self, logits, rows, top_f):
        scaled.append(proposal_probs(self, logits, rows, top_f))
        return target_module.sampling_probs(logits, rows)

    def sample_scaled(probs, generators=None):
        return sample(scaled.pop(), generators)
    monkeypatch.setattr(draft_worker_module.DraftWorker, "_proposal_probs", unscaled_q)
    monkeypatch.setattr(draft_worker_module, "sample", sample_scaled)
    settings, params = SAGUARO_CASES["top_f_c0.3_k2"]
    pvalues = broken_pvalues(pair, [(PROMPT_A, params)], **settings)
    assert min(pvalues) < ALPHA / len(pvalues), pvalues


@pytest.mark.slow
def test_the_test_catches_rows_sampled_with_their_batch_mates_settings(pair, monkeypatch):
    """Every row of a batch sampled (target and draft alike) with the first row's temperature and filters."""
    of = target_module.RowSampling.of

    def first_rows_settings(settings, device="cpu", rows_per_seq=1):
        return of([settings[0]] * len(settings), device, rows_per_seq)
    monkeypatch.setattr(target_module.RowSampling, "of", staticmethod(first_rows_settings))
    settings, _ = MIXED_CASES["ssd_coupled"]
    pvalues = broken_pvalues(pair, MIXED, n=4000, **settings)
    assert min(pvalues) < ALPHA / len(pvalues), pvalues


@pytest.mark.slow
def test_only_the_conditional_test_sees_a_bug_of_the_trees_built_after_hits(pair, monkeypatch):
    """A tree built after a hit (its sequence's last speculation came from a tree: adopted branch KV, x_K run
    alone) hands the target a q of zeros for its branches' tokens, so that the ratio test accepts every one
    of them. The first 3 tokens, all that tests/test_engine_sampling.py counts, are decided by the prefill, a
    just-in-time draft and at most one tree built after it, so their joint cannot see this bug (p stays
    as without it); conditional_pvalue over 10 tokens does."""
    from saguaro_dist.spec import ProposalSource
    decode = draft_worker_module.DraftWorker._decode_branches
    broken = []

    def zero_q_after_hits(self, states, *args, **kwargs):
        trees = decode(self, states, *args, **kwargs)
        for s, tree in zip(states, trees):
            if s.source is ProposalSource.CACHE and tree.proposals is not None:
                tree.proposals.probs = torch.zeros_like(tree.proposals.probs)
                broken.append(s.seq_id)
        return trees
    monkeypatch.setattr(draft_worker_module.DraftWorker, "_decode_branches", zero_q_after_hits)
    first_three, conditional = broken_pvalues(pair, [(PROMPT_A, T1)], k=1, fan_out=(5, 6), bonus_draw="top_f", **TREES)
    assert broken and conditional < ALPHA / 2, (first_three, conditional)


def test_the_reference_tells_the_draft_from_the_target(pair):
    """The pair differs where it matters: the draft's exact joint is far from the target's (total variation
    distance over 5 tokens), so a verifier that let the draft's distribution through would be seen."""
    _, _, model, draft = pair
    for params in (T1, SamplingParams(temperature=0.7, top_k=5, top_p=0.95)):
        want, got = exact_joint(model, PROMPT_A, params, 5), exact_joint(draft, PROMPT_A, params, 5)
        tv = 0.5 * float((want - got).abs().sum())
        assert tv > 0.1, tv
