"""Greedy exactness: every mode and path gives the target's own greedy tokens."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

import saguaro_dist.engine.ssd_loop as ssd_loop
from engine_helpers import (BF16_NEAR_TIE, BIAS, DEVICE, PENALTIES, PROMPTS, CyclingGate, JustInTimeLookupGate,
                            LookupFavouringGate, every_lookup_length, trusting_picker,
                            assert_greedy_equal, close_pair,
                            biased_reference, hf_greedy, llama_config, penalized_reference,
                            save_model)
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.draft_process import DraftProcess
from saguaro_dist.engine.draft_worker import DraftWorker
from saguaro_dist.engine.sequence import OutputKind, Sequence, SeqStatus
from saguaro_dist.spec.lookup_length import LookupLengths

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("greedy_pair")
    pair = close_pair(root)
    save_model(root / "far_draft", llama_config(96, 32, 1), seed=2)
    return pair | {"far": str(root / "far_draft")}


@pytest.fixture(scope="module")
def reference(pair):
    return [hf_greedy(pair["model"], p, GREEDY.max_tokens) for p in PROMPTS]


def run(pair, batch: int, **kwargs) -> list[list[int]]:
    """Variants run the draft on a thread (no child start-up per test): the DraftWorker and the round
    loop are the same whatever carries their messages; test_draft_process_matches_ar covers the process."""
    draft = pair[kwargs.pop("draft", "close")] if kwargs.get("mode", "ssd") not in ("ar", "ngram") else None
    kwargs.setdefault("draft_executor", "thread")
    with LLM(device=DEVICE, model=pair["target"], draft=draft, max_batch_size=batch, **kwargs) as llm:
        return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def check(pair, reference, outputs):
    for prompt, got, want in zip(PROMPTS, outputs, reference):
        assert_greedy_equal(got, want, prompt, pair["model"])


def test_ar_matches_transformers_generate(pair, reference):
    check(pair, reference, run(pair, batch=4, mode="ar"))


@pytest.mark.parametrize("batch", [1, 4])
def test_sd_matches_ar(pair, reference, batch):
    check(pair, reference, run(pair, batch=batch, mode="sd", k=3))


@pytest.mark.parametrize("batch, lookup", [(1, {}), (4, {}), (4, dict(prompt_lookup_max=5, prompt_lookup_min=2))])
def test_ngram_matches_ar_and_its_proposals_are_taken(pair, reference, batch, lookup):
    """Prompt lookup: no draft model; what it proposes is verified as a draft's, and accepted where the
    text repeats itself (a prompt that repeats, and this tiny model's greedy loops)."""
    with LLM(device=DEVICE, model=pair["target"], mode="ngram", k=3, max_batch_size=batch, **lookup) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        m = llm.metrics
    check(pair, reference, [o.token_ids for o in outs])
    assert m.drafted_tokens > 0 and m.accepted_tokens > 0, m


SSD_VARIANTS = {
    "geometric": dict(fan_out=12, fan_out_kind="geometric"),
    "uniform": dict(fan_out=12, fan_out_kind="uniform"),
    "outcome": dict(fan_out=12),  # the default kind
    "explicit_fanout": dict(fan_out=[3, 2, 2, 5]),
    "neural_fallback": dict(fan_out=4, fallback="neural"),
    "fast_fallback": dict(fan_out=4, fallback="fast"),
    "random_fallback": dict(fan_out=4, fallback="random"),
    "auto_fallback": dict(fan_out=4, fallback="auto"),
    "saguaro_c": dict(fan_out=12, saguaro_c=0.5),
    "far_draft": dict(fan_out=8, draft="far"),
    "late_trees": dict(fan_out=12, tree_timeout_s=0.0),  # every tree arrives too late: all misses
}


# ("outcome", 1) is left out: test_tree_gate_leaves_out_rounds_that_captured_a_graph[None-thread] runs that
# very engine (ssd, k 3, fan_out 12, batch 1, thread, the default gate) on the same prompts and checks its tokens.
SSD_CASES = [(variant, batch) for variant in sorted(SSD_VARIANTS) for batch in (1, 4) if (variant, batch) != ("outcome", 1)]


@pytest.mark.parametrize("variant, batch", SSD_CASES)
def test_ssd_matches_ar(pair, reference, variant, batch):
    check(pair, reference, run(pair, batch=batch, mode="ssd", k=3, **SSD_VARIANTS[variant]))


def test_trees_later_than_the_timeout_are_counted_and_said_once(pair, reference, monkeypatch, caplog):
    """A draft side that stalls (here every tree build sleeps 50 ms, the timeout is 10 ms): each late tree
    is a miss, counted, and one warning says so; the tokens stay the target's."""
    plan = DraftWorker.plan_trees

    def stalled(self, *args, **kwargs):
        time.sleep(0.05)
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(DraftWorker, "plan_trees", stalled)
    caplog.set_level("WARNING", logger="saguaro_dist.engine.ssd_loop")
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=4,
             draft_executor="thread", tree_policy="always", tree_timeout_s=0.01) as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        m = llm.metrics
    check(pair, reference, outputs)
    assert m.late_trees > 0 and m.late_trees <= m.cache_misses, m
    warnings = [r for r in caplog.records if "did not arrive within tree_timeout_s" in r.getMessage()]
    assert len(warnings) == 1, warnings


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ngram"])
def test_chunked_forwards_match_ar(pair, reference, mode):
    """max_num_batched_tokens = 6 at batch 4: every prefill, verify and glue forward runs in chunks of
    one token a sequence, and the tokens stay the target's."""
    check(pair, reference, run(pair, batch=4, mode=mode, k=3, max_num_batched_tokens=6))


LONG_PROMPT = (PROMPTS[2] * 4)[:40]


@pytest.fixture
def small_budget_engine(pair, request):
    """An engine driven step by step, max_num_batched_tokens = 8 (mode: the test's parameter)."""
    mode = request.param
    engine, _ = build_local_engine(Config(model=pair["target"], draft=None if mode == "ar" else pair["close"], mode=mode,
                                          k=3, device=DEVICE, draft_executor="thread", max_num_batched_tokens=8))
    yield engine
    engine.close()


@pytest.mark.parametrize("small_budget_engine", ["ar", "ssd"], indirect=True)
def test_a_long_prompt_prefills_between_the_rounds_of_running_sequences(pair, reference, small_budget_engine):
    """A 40-token prompt arriving while a sequence decodes runs 8 prompt tokens a step (vLLM's chunked
    prefill): the running sequence gains tokens at each of those steps, and both outputs stay the target's."""
    engine = small_budget_engine
    short, long = Sequence(1, "short", PROMPTS[0], GREEDY), Sequence(2, "long", LONG_PROMPT, GREEDY)
    engine.add(short)
    engine.step()
    engine.add(long)
    gained = []
    while long.status is not SeqStatus.RUNNING:
        before = len(short.output_token_ids)
        engine.step()
        gained.append(len(short.output_token_ids) - before)
    assert len(gained) == 5 and min(gained) >= 1, gained  # 4 parts of 8 tokens, then the last 8 and its first token
    while engine.has_work():
        engine.step()
    assert_greedy_equal(short.output_token_ids, reference[0], PROMPTS[0], pair["model"])
    want = hf_greedy(pair["model"], LONG_PROMPT, GREEDY.max_tokens)
    assert_greedy_equal(long.output_token_ids, want, LONG_PROMPT, pair["model"])


@pytest.mark.parametrize("small_budget_engine", ["ar"], indirect=True)
def test_aborting_a_prompt_half_prefilled_frees_its_slot_and_kv(small_budget_engine):
    engine = small_budget_engine
    long = Sequence(2, "long", LONG_PROMPT, GREEDY)
    engine.add(long)
    engine.step()
    assert long.status is SeqStatus.PREFILLING and engine.target.runner.length(2) == 8
    [update] = engine.abort("long")
    assert update.finished and not engine.has_work() and long.finish_reason.value == "abort"
    with pytest.raises(ValueError, match="unknown sequence"):
        engine.target.runner.length(2)


@pytest.fixture(scope="module")
def bf16_reference(pair):
    """AR in bf16, run once for both speculative modes (the same engine settings each time)."""
    return run(pair, batch=4, mode="ar", dtype="bfloat16")


@pytest.mark.parametrize("mode, extra", [("sd", {}), ("ssd", dict(fan_out=12))], ids=["sd", "ssd"])
def test_bf16_departs_from_ar_only_at_bf16_near_ties(pair, bf16_reference, mode, extra):
    """In bf16 (the usual GPU dtype) speculation is held to the same AR, with ties widened to the dtype's
    rounding: a verifier that kept a wrong draft token would depart where the target is sure."""
    got = run(pair, batch=4, mode=mode, k=3, dtype="bfloat16", **extra)
    for prompt, g, w in zip(PROMPTS, got, bf16_reference):
        assert_greedy_equal(g, w, prompt, pair["model"], rel_tie=BF16_NEAR_TIE)


PROCESS_CASES = {
    "sd_b4": dict(batch=4, mode="sd", k=3),
    "ssd_b1": dict(batch=1, mode="ssd", k=3, fan_out=12),
    "ssd_b4": dict(batch=4, mode="ssd", k=3, fan_out=12),
    "ssd_neural_fallback_b1": dict(batch=1, mode="ssd", k=3, fan_out=4, fallback="neural"),
}


# A draft child costs seconds of start-up (a fresh interpreter importing torch). The trees of ssd_b4 over the
# process and of ssd_b1 / ssd_b4 on the split run in test_tree_gate_transitions_are_exact (process-4, split-1,
# split-4): the same engine settings, the gate scripted so that each kind of round is taken (asserted there).
@pytest.mark.parametrize("case", ["sd_b4", "ssd_b1", "ssd_neural_fallback_b1"])
def test_draft_process_matches_ar(pair, reference, case):
    check(pair, reference, run(pair, draft_executor="process", **PROCESS_CASES[case]))


@pytest.mark.parametrize("case", ["ssd_neural_fallback_b1"])
def test_split_draft_matches_ar(pair, reference, case, caplog):
    """Just-in-time drafts on a thread, trees in the child: both halves follow every outcome, never out
    of step (the engine would recover from that with the fast backup and a re-prefill, tokens intact)."""
    caplog.set_level("WARNING")
    check(pair, reference, run(pair, draft_executor="split", **PROCESS_CASES[case]))
    assert not [r for r in caplog.records if "out of step" in r.getMessage() or "failed" in r.getMessage()]


COHORT_PROMPTS, COHORT_LENGTHS = PROMPTS + [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8]], [20, 7, 13, 3, 17, 9]


@pytest.fixture(scope="module")
def cohort_reference(pair):
    """transformers' greedy tokens of the cohort prompts, computed once for the three executors."""
    return [hf_greedy(pair["model"], p, n) for p, n in zip(COHORT_PROMPTS, COHORT_LENGTHS)]


@pytest.mark.parametrize("executor", ["thread", "process", "split"])
def test_two_cohorts_match_ar(pair, cohort_reference, executor, caplog):
    """SSD's rounds without trees as two cohorts, each drafted while the other verifies (the cohort gate
    also tries the batch whole): requests end mid-flight and waiting ones join (6 prompts of different
    lengths, batch 4). Same tokens as greedy decoding, and the draft never out of step."""
    caplog.set_level("WARNING")
    prompts, lengths = COHORT_PROMPTS, COHORT_LENGTHS
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, max_batch_size=4,
             draft_executor=executor, tree_policy="never") as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=[replace(GREEDY, max_tokens=n) for n in lengths])
        m = llm.metrics
    for prompt, out, want in zip(prompts, outs, cohort_reference):
        assert_greedy_equal(out.token_ids, want, prompt, pair["model"])
    assert m.cohort_rounds > 0 and m.cache_hits + m.cache_misses == 0 and m.just_in_time_rounds == m.rounds, m
    assert not [r for r in caplog.records if "out of step" in r.getMessage() or "unavailable" in r.getMessage()]


def test_ssd_hits_the_cache_with_a_close_draft(pair):
    """The pair itself: a close draft's trees hit. On a thread (no child interpreter to start): the trees
    hit in a child too, test_tree_gate_transitions_are_exact[split-1 / split-4] assert it."""
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12,
             draft_executor="thread") as llm:
        out = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)[0]
    m = out.metrics
    assert m.rounds > 0 and m.cache_hits > 0, m
    assert m.acceptance_rate > 0.3, m


@pytest.mark.parametrize("gate, executor, batch, trusting", [
    (LookupFavouringGate, "thread", 1, False), (LookupFavouringGate, "split", 1, False), (LookupFavouringGate, "split", 4, False),
    (JustInTimeLookupGate, "split", 1, True), (JustInTimeLookupGate, "split", 4, True), (JustInTimeLookupGate, "thread", 4, True)])
def test_rows_that_take_their_ngram_proposal_over_the_drafts_are_exact(pair, reference, monkeypatch, caplog, gate,
                                                                       executor, batch, trusting):
    """Rounds whose rows take their n-gram proposal instead of their tree or a draft made now
    (spec/lookup_pick.py; the draft's rows scripted to gain nothing, so every row whose n-gram proposals
    were scored takes its own; trusting: before any was scored), SD's rounds of two cohorts too: the same
    tokens, and the draft, told what is verified instead, never out of step."""
    caplog.set_level("WARNING")
    monkeypatch.setattr(ssd_loop, "TreeGate", gate)
    if trusting:
        monkeypatch.setattr(ssd_loop, "LookupPicker", trusting_picker())
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=batch,
             draft_executor=executor, tree_timeout_s=30.0) as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        m = llm.metrics
    check(pair, reference, outputs)
    assert m.lookup_rows > 0 and (m.cache_hits > 0 or gate is JustInTimeLookupGate), m
    assert not [r for r in caplog.records if "out of step" in r.getMessage()]


class DraftFavouringGate(LookupFavouringGate):
    """Trees every round, the draft's rows measured to gain more than any n-gram proposal: no row takes
    its lookup for its own sake, only the whole round, to skip its wait."""

    def draft_tokens_per_row(self, batch_size: int, sampled: bool = False) -> float | None:
        return 3.0


def long_wait_picker():
    """A LookupPicker that trusts every n-gram proposal at 2 tokens and has measured a wait for trees 1000x
    a round's other work: skipping it by every row taking its lookup always pays."""
    from saguaro_dist.spec.lookup_pick import LookupPicker

    class LongWaitPicker(LookupPicker):
        def expected(self, key):
            return 2.0

        def round_times(self, where):
            return 0.001, 1.0
    return LongWaitPicker


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_sampled_tree_round_never_skips_its_wait(pair, reference, monkeypatch, temperature):
    """A greedy tree round skips its wait for trees by every row taking its n-gram proposal where that
    pays (the draft stops a tree that is no longer wanted); a sampled one never does (ssd_lookup_rows._may_skip_wait:
    rounds that did not wait for the trees they asked for queued builds, session 57)."""
    monkeypatch.setattr(ssd_loop, "TreeGate", DraftFavouringGate)
    monkeypatch.setattr(ssd_loop, "LookupPicker", long_wait_picker())
    params = replace(GREEDY, temperature=temperature, seed=1)
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=2,
             draft_executor="split") as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        m = llm.metrics
    if temperature == 0:
        check(pair, reference, outputs)
        assert m.lookup_rows > 0 and m.lookup_rounds > 0, m
    else:
        assert m.lookup_rows == 0 and m.cache_hits > 0, m


class TwiceLookupsGate(CyclingGate):
    """Trees, trees, just-in-time drafts, then two rounds of n-gram proposals alone: the second is a whole
    round of lookups also after cohorts (the first still takes the drafts that landed for the first cohort)."""

    def __init__(self, modes=None):
        from saguaro_dist.spec.tree_gate import RoundMode
        self.cycle, self.rounds = [RoundMode.TREES, RoundMode.TREES, RoundMode.JUST_IN_TIME, RoundMode.FAST, RoundMode.FAST], 0


@pytest.mark.parametrize("mode, executor, batch", [("ngram", None, 1), ("ngram", None, 4), ("ssd", "thread", 1),
                                                    ("ssd", "split", 1), ("ssd", "split", 4), ("ssd", "process", 4)])
def test_lookup_rounds_of_every_length_are_exact(pair, reference, monkeypatch, caplog, mode, executor, batch):
    """Rounds of n-gram proposals alone at 1, K, 2K and 3K tokens in turn (engine/lookup_rounds.py), in ssd
    between rounds with and without trees and cohort rounds (the gate scripted): the same tokens, and the
    draft, told of every proposal however long, never out of step."""
    caplog.set_level("WARNING")
    chosen = []
    monkeypatch.setattr(LookupLengths, "choose", every_lookup_length(chosen))
    monkeypatch.setattr(ssd_loop, "TreeGate", TwiceLookupsGate)
    drafted = dict(draft=pair["close"], draft_executor=executor, fan_out=12, tree_timeout_s=30.0) if mode == "ssd" else {}
    with LLM(device=DEVICE, model=pair["target"], mode=mode, k=3, max_batch_size=batch, **drafted) as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        m = llm.metrics
    check(pair, reference, outputs)
    assert max(chosen) == 9 and len(set(chosen)) > 1 and (mode == "ssd" or {1, 3, 6} < set(chosen)), chosen
    assert mode == "ngram" or (m.fast_rounds > 0 and m.cache_hits > 0), m
    assert not [r for r in caplog.records if "out of step" in r.getMessage()]


class LookupsThenTreesGate(CyclingGate):
    """Rounds of n-gram proposals alone, every fourth with trees."""

    def __init__(self, modes=None):
        from saguaro_dist.spec.tree_gate import RoundMode
        self.cycle, self.rounds = [RoundMode.FAST, RoundMode.FAST, RoundMode.FAST, RoundMode.TREES], 0


@pytest.mark.parametrize("executor", ["thread", "split"])
def test_sequences_admitted_in_rounds_of_lookups_are_exact(pair, reference, monkeypatch, caplog, executor):
    """More prompts than slots, so sequences are admitted as others finish, mostly in rounds the gate runs
    on n-gram proposals alone (their first speculation drafted just in time there): the same tokens, and
    the draft in step when later rounds build trees for them."""
    caplog.set_level("WARNING")
    monkeypatch.setattr(ssd_loop, "TreeGate", LookupsThenTreesGate)
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=2,
             draft_executor=executor, tree_timeout_s=30.0) as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        m = llm.metrics
    check(pair, reference, outputs)
    assert m.fast_rounds > 0 and m.cache_hits > 0, m
    assert not [r for r in caplog.records if "out of step" in r.getMessage()]


@pytest.mark.parametrize("executor, batch", [("thread", 1), ("thread", 4), ("process", 4), ("split", 1), ("split", 4)])
def test_tree_gate_transitions_are_exact(pair, reference, monkeypatch, caplog, executor, batch):
    """Rounds with and without trees mixed (the gate scripted): same tokens, both kinds of round taken,
    and the draft never out of step."""
    caplog.set_level("WARNING")
    monkeypatch.setattr(ssd_loop, "TreeGate", CyclingGate)
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=batch,
             draft_executor=executor, tree_timeout_s=30.0) as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        m = llm.metrics
    check(pair, reference, outputs)
    assert m.just_in_time_rounds > 0 and m.fast_rounds > 0 and m.cache_hits > 0, m
    assert (m.cohort_rounds > 0) == (batch > 1), m  # cohorts drafted in a round without trees, landed in one with
    assert not [r for r in caplog.records if "out of step" in r.getMessage() or "failed" in r.getMessage()]


# [None-thread] is also test_ssd_matches_ar's ("outcome", 1) case: keep its engine settings and check() as they are.
@pytest.mark.parametrize("capturing, executor", [(None, "thread"), ("engine", "thread"), ("draft child", "split")])
def test_tree_gate_leaves_out_rounds_that_captured_a_graph(pair, reference, monkeypatch, capturing, executor):
    """A round during which a CUDA graph was captured, in the engine's process or in the draft's own (its
    count comes with each of the child's messages), timed the capture: the gate does not measure it (here
    every round 'captures', so no mode gets a rate; without captures every mode does)."""
    moving = iter(range(10**9))
    if capturing == "engine":
        monkeypatch.setattr(ssd_loop, "graph_captures", lambda: next(moving))
    elif capturing == "draft child":
        monkeypatch.setattr(DraftProcess, "graph_captures", lambda self: next(moving))
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=1,
             draft_executor=executor) as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        rates = llm._thread.engine.loop.gate.rates(1)
    check(pair, reference, outputs)
    if capturing:
        assert rates == {"trees": None, "just_in_time": None, "fast": None}
    else:
        assert all(r is not None for r in rates.values()), rates


def test_auto_fallback_still_tries_the_backup_it_judged_slower(pair, reference):
    """A neural backup once timed as hopelessly slow (seeded here) loses every automatic choice; one in
    EXPLORE_EVERY still takes it, so its estimate can recover; outputs stay the target's."""
    from saguaro_dist.spec import Timing
    with LLM(device=DEVICE, model=pair["target"], draft=pair["far"], mode="ssd", k=3, fan_out=4, max_batch_size=1,
             draft_executor="thread", tree_policy="always", fallback="auto") as llm:
        stats = llm._thread.engine.loop.stats
        stats.record_time(Timing.VERIFY, 0.001)
        stats.record_time(Timing.NEURAL_BACKUP, 100.0)
        outputs = [o.token_ids for _ in range(2) for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        fallbacks = llm.metrics.fallbacks
    check(pair, reference, outputs[:len(PROMPTS)])
    check(pair, reference, outputs[len(PROMPTS):])
    assert fallbacks["fast"] >= 15 and 1 <= fallbacks["neural"] <= fallbacks["fast"] // 15 + len(PROMPTS) * 2, fallbacks


def test_tree_policy_always_never_skips_a_tree(pair, reference):
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", k=3, fan_out=12, max_batch_size=1,
             draft_executor="thread", tree_policy="always") as llm:
        outputs = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        m = llm.metrics
    check(pair, reference, outputs)
    assert m.just_in_time_rounds == 0 and m.cache_hits + m.cache_misses == m.rounds - len(PROMPTS), m
    assert 0 < m.tree_builds <= m.cache_hits + m.cache_misses and m.tree_build_s > 0, m  # the draft's own clock
    assert len(PROMPTS) <= m.jit_rounds < m.rounds, m  # first drafts, and misses that took the neural backup
    assert m.jit_rounds <= m.jit_round_tokens <= m.jit_rounds * (3 + 1), m  # each verified 1 to K + 1 tokens


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_round_kinds_count_only_the_tokens_kept(pair, mode):
    """A last round's tokens past max_tokens are dropped, and not counted by round kind either (the bench's
    Theorem 7 splits the cell's tokens by those counts: counted, they made its tokens per tree round negative).
    The draft on a thread: the counting (metrics.EmittedTokens) is the loop's whatever carries the draft."""
    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode=mode, k=3, max_batch_size=2,
             draft_executor="thread") as llm:
        for n in (2, 5, 6, 9):
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=replace(GREEDY, max_tokens=n))
        m = llm.metrics
    rounds_tokens = m.generated_tokens - 4 * len(PROMPTS)  # every sequence's first token came from its prefill
    assert m.jit_rounds > 0 and 0 < m.jit_round_tokens + m.fast_round_tokens + m.lookup_round_tokens <= rounds_tokens, m


@pytest.mark.parametrize("hit_glue", ["skip", "always"])
def test_hit_glue_skip_drops_k_equals_K_after_hits_and_stays_exact(pair, reference, monkeypatch, hit_glue):
    """HitGlue.SKIP: a tree built right after every sequence hit its own branch leaves out x_K's forward and
    so the all-accepted outcome; the outputs are the target's either way. (The real build runs: the spy
    only keeps what it returned.)"""
    from saguaro_dist.engine.draft_worker import DraftWorker
    trees, build = [], DraftWorker.finish_trees

    def spy(self, *args, **kwargs):
        built = build(self, *args, **kwargs)
        trees.extend(built)
        return built
    monkeypatch.setattr(DraftWorker, "finish_trees", spy)
    outputs = run(pair, batch=1, mode="ssd", k=3, fan_out=12, tree_policy="always", hit_glue=hit_glue)
    check(pair, reference, outputs)
    without_k = [t for t in trees if t.accepted and max(t.accepted) < 3]
    assert trees and (without_k if hit_glue == "skip" else not without_k), [t.accepted for t in trees]


def test_final_only_requests_get_one_update_with_every_token(pair, reference):
    """generate()'s requests are read only at the end: one update each (on Ray, an update is an actor
    call each way), carrying every token; streamed (DELTA) requests get one per round."""
    updates = {kind: [] for kind in OutputKind}
    done = {kind: threading.Event() for kind in OutputKind}

    def listener(kind):
        def on_update(item):
            updates[kind].append(item)
            if isinstance(item, BaseException) or item.finished:
                done[kind].set()
        return on_update

    with LLM(device=DEVICE, model=pair["target"], draft=pair["close"], mode="ssd", draft_executor="thread") as llm:
        for i, kind in enumerate(OutputKind):
            llm._thread.submit(Sequence(1000 + i, f"kind-{kind.value}", PROMPTS[0], GREEDY, kind), listener(kind))
        assert all(event.wait(60) for event in done.values())
    final, streamed = updates[OutputKind.FINAL_ONLY], updates[OutputKind.DELTA]
    assert len(final) == 1 and final[0].finished and final[0].token_delta == reference[0]
    assert len(streamed) > 1 and [t for u in streamed for t in u.token_delta] == reference[0]


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_stop_token_ids_end_a_request_like_eos(pair, reference, mode):
    """vLLM's stop_token_ids: the request ends at the first one, which stays in token_ids; a speculation
    round that ran past it gives back nothing after it."""
    stop = reference[0][5]
    want = reference[0][:reference[0].index(stop) + 1]
    draft = None if mode in ("ar", "ngram") else pair["close"]
    with LLM(device=DEVICE, model=pair["target"], draft=draft, mode=mode, draft_executor="thread") as llm:
        out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=replace(GREEDY, stop_token_ids=[stop]))[0]
    assert out.token_ids == want and out.finish_reason == "stop"


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ngram"])
def test_min_tokens_holds_back_the_end_as_transformers_min_new_tokens(pair, mode):
    """min_tokens masks EOS and stop_token_ids in the target's distribution until that many tokens are
    out, in every path (verify rows past the minimum included): the same tokens as transformers'
    generate with min_new_tokens and that end token as EOS."""
    stop, minimum = reference_end(pair)
    draft = None if mode in ("ar", "ngram") else pair["close"]
    params = replace(GREEDY, max_tokens=16, ignore_eos=False, min_tokens=minimum, stop_token_ids=[stop])
    with LLM(device=DEVICE, model=pair["target"], draft=draft, mode=mode, k=3, draft_executor="thread") as llm:
        got = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0].token_ids
    out = pair["model"].generate(torch.tensor([PROMPTS[0]]), max_new_tokens=16, min_new_tokens=minimum, do_sample=False,
                                 eos_token_id=stop, pad_token_id=0)
    want = out[0, len(PROMPTS[0]):].tolist()
    assert stop in reference_tokens(pair)[:minimum]  # the unconstrained output would have ended earlier
    assert_greedy_equal(got, want[:want.index(stop) + 1] if stop in want else want, PROMPTS[0], pair["model"])


def reference_tokens(pair) -> list[int]:
    return hf_greedy(pair["model"], PROMPTS[0], 16)


def reference_end(pair) -> tuple[int, int]:
    """An end token the unconstrained greedy output emits early (its 3rd token), and a minimum past it."""
    return reference_tokens(pair)[2], 8


@pytest.fixture(scope="module")
def penalized(pair):
    """transformers' greedy tokens (and near-tie adjust) under PENALTIES, once for the four modes."""
    return [penalized_reference(pair["model"], prompt, GREEDY.max_tokens) for prompt in PROMPTS]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ngram"])
def test_penalties_follow_transformers_in_every_mode(pair, reference, penalized, mode):
    """Presence, frequency and repetition penalties change the target's distribution, so the verifier
    must score each speculated position with the counts up to it: every mode gives transformers'
    greedy tokens under the same penalties (and they differ from the unpenalized ones)."""
    draft = None if mode in ("ar", "ngram") else pair["close"]
    params = replace(GREEDY, **PENALTIES)
    with LLM(device=DEVICE, model=pair["target"], draft=draft, mode=mode, k=3, draft_executor="thread") as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for prompt, out, plain, (want, adjust) in zip(PROMPTS, outs, reference, penalized):
        assert want != plain  # the penalties bite on this model
        assert_greedy_equal(out.token_ids, want, prompt, pair["model"], adjust=adjust)


@pytest.fixture(scope="module")
def biased(pair):
    """{with penalties: transformers' greedy tokens and adjust per prompt} under BIAS, once for the four modes."""
    return {penalties: [biased_reference(pair["model"], prompt, GREEDY.max_tokens, penalties) for prompt in PROMPTS]
            for penalties in (False, True)}


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ngram"])
def test_logit_bias_and_allowed_tokens_follow_transformers_in_every_mode(pair, reference, biased, mode):
    """OpenAI's logit_bias and vLLM's allowed_token_ids change the target's distribution: every mode gives
    transformers' greedy tokens under the same processors, alone and before the penalties (vLLM's order:
    the repetition penalty divides a biased logit), and only allowed tokens come out."""
    draft = None if mode in ("ar", "ngram") else pair["close"]
    with LLM(device=DEVICE, model=pair["target"], draft=draft, mode=mode, k=3, draft_executor="thread") as llm:
        for penalties in (False, True):
            params = replace(GREEDY, **BIAS, **(PENALTIES if penalties else {}))
            outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
            for prompt, out, plain, (want, adjust) in zip(PROMPTS, outs, reference, biased[penalties]):
                assert want != plain and set(out.token_ids) <= set(BIAS["allowed_token_ids"])
                assert_greedy_equal(out.token_ids, want, prompt, pair["model"], adjust=adjust)


@pytest.mark.parametrize("constraint", ["penalties", "bias"])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_the_draft_proposes_under_the_requests_constraints(pair, monkeypatch, mode, constraint):
    """A draft that is the target itself, told the request's penalties (or logit bias and allowed
    tokens), proposes exactly the constrained target's choices (all accepted, up to fp near-ties);
    proposing unconstrained, it is rejected wherever a constraint moved the target's choice."""
    from saguaro_dist.engine.draft_constraints import DraftConstraints
    params = replace(GREEDY, **(PENALTIES if constraint == "penalties" else BIAS))

    def acceptance() -> float:  # every proposal the draft's: no n-gram rounds or fast backups (a busy box's choice)
        with LLM(device=DEVICE, model=pair["target"], draft=pair["target"], mode=mode, k=3, draft_executor="thread",
                 fallback="neural", ngram_rounds=False) as llm:
            outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        return sum(o.metrics.accepted_tokens for o in outs) / sum(o.metrics.drafted_tokens for o in outs)
    told = acceptance()
    monkeypatch.setattr(DraftConstraints, "penalties", lambda self, owners, paths: None)
    assert told > 0.95 and acceptance() < 0.8  # seen: 1.0 and 0.34 (penalties), 1.0 and 0.0 (bias)
