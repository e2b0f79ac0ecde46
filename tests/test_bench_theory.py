"""Theorem 7 as the bench applies it, against hand computations."""
from __future__ import annotations

import pytest

from saguaro_dist.bench.systems import Measurement
from saguaro_dist.bench.theory import predict_from_run, predicted_tokens_per_s, with_fast_rounds


def test_prediction_by_hand_when_the_tree_is_hidden():
    # T_p = 5/10 < 1, T_b = 5/10: time = 0.8 * 1 + 0.2 * (1 + 0.5) = 1.1 verifies; 3 / (1.1 * 10 ms)
    got = predicted_tokens_per_s(tokens_hit=3.0, tokens_miss=3.0, p_hit=0.8, verify_s=0.010, tree_s=0.005, backup_s=0.005)
    assert got == pytest.approx(3.0 / (1.1 * 0.010))  # 272.73 tok/s


def test_prediction_by_hand_when_the_tree_is_slower_than_verify():
    # T_p = 1.5: time = 0.5 * 1.5 + 0.5 * (1 + 2.0) = 2.25 verifies of 4 ms; 4 tokens per round
    got = predicted_tokens_per_s(tokens_hit=4.0, tokens_miss=4.0, p_hit=0.5, verify_s=0.004, tree_s=0.006, backup_s=0.008)
    assert got == pytest.approx(4.0 / (2.25 * 0.004))  # 444.4 tok/s


def test_all_hits_hide_the_draft_entirely():
    assert predicted_tokens_per_s(5.0, 0.0, 1.0, 0.01, 0.002, 1.0) == pytest.approx(500.0)


def test_predict_from_run_reads_its_inputs_from_the_measurement():
    # batch 2: 2 x 33 tokens (1 each from prefill), 16 rounds, 30 hits / 2 misses both neural
    m = Measurement(tokens=66, seconds=0.5, outputs=[], cache_hits=30, cache_misses=2, fallbacks={"neural": 2},
                    engine={"rounds": 16, "verify_s": 0.16})
    got = predict_from_run(m, batch=2, calib={"tree_s": 0.005, "jit_s": 0.004})
    hit = 30 / 32
    p_round = hit ** 2                                   # every miss went neural
    time = p_round * 1 + (1 - p_round) * (1 + 0.4)      # verify 10 ms, T_p 0.5, T_b 0.4
    assert got["tokens_per_round"] == pytest.approx(64 / 16)
    assert got["p_hit"] == pytest.approx(p_round)
    assert got["predicted_tokens_per_s"] == pytest.approx(4.0 / (time * 0.010))
    # the run: 2 first tokens from the prefills (no prefill time recorded here), 64 at the predicted rate
    assert got["predicted_run_tokens_per_s"] == pytest.approx(66 / (64 / got["predicted_tokens_per_s"]))
    assert got["measured_over_predicted"] == pytest.approx(132.0 / got["predicted_run_tokens_per_s"])


def test_fast_backups_cost_nothing_in_the_prediction():
    m = Measurement(tokens=11, seconds=1.0, outputs=[], cache_hits=5, cache_misses=5, fallbacks={"fast": 5},
                    engine={"rounds": 10, "verify_s": 0.1})
    assert predict_from_run(m, 1, {"tree_s": 0.001, "jit_s": 1.0})["predicted_tokens_per_s"] == pytest.approx(100.0)


def test_the_runs_own_tree_build_time_is_t_p_and_the_draft_alone_one_is_reported_beside_it():
    # 10 rounds of 10 ms verify, all hits; the draft took 15 ms a tree in the run, 12 ms alone
    m = Measurement(tokens=31, seconds=1.0, outputs=[], cache_hits=10, cache_misses=0,
                    engine={"rounds": 10, "verify_s": 0.1, "tree_build_s": 0.15, "tree_builds": 10})
    got = predict_from_run(m, 1, {"tree_s": 0.012, "jit_s": 0.005})
    assert got["tree_s"] == pytest.approx(0.015) and got["tree_s_in_run"]
    assert got["predicted_tokens_per_s"] == pytest.approx(3.0 / 0.015)
    assert got["tree_alone_s"] == 0.012 and got["predicted_alone_tokens_per_s"] == pytest.approx(3.0 / 0.012 * 31 / 30)


def test_rounds_that_waited_for_a_just_in_time_draft_are_theorem_7s_misses():
    # 10 rounds: 4 waited for a neural draft (the gate's rounds without trees, neural misses), 6 took trees
    m = Measurement(tokens=31, seconds=1.0, outputs=[], cache_hits=6, cache_misses=0,
                    engine={"rounds": 10, "verify_s": 0.1, "jit_rounds": 4, "tree_build_s": 0.06, "tree_builds": 6})
    got = predict_from_run(m, 1, {"tree_s": 0.02, "jit_s": 0.005})
    assert got["p_hit"] == pytest.approx(0.6)
    time = 0.6 * 1 + 0.4 * (1 + 0.5)  # T_p 0.6 hides behind the verify; T_b 0.5
    assert got["predicted_tokens_per_s"] == pytest.approx(3.0 / (time * 0.010))
    assert got["best_case_tokens_per_s"] == pytest.approx(3.0 / 0.010 * 31 / 30)  # p = 1: every round one verify


def test_a_run_without_a_tree_is_predicted_as_sd_rounds():
    """The tree gate may run a whole cell just-in-time (trees lost at a smaller batch): no lookups, so
    no hit rate, but Theorem 7 still predicts it with p = 0 (every round 1 + T_b)."""
    m = Measurement(tokens=31, seconds=1.0, outputs=[], cache_hits=0, cache_misses=0,
                    engine={"rounds": 10, "verify_s": 0.1, "jit_rounds": 10, "tree_build_s": 0.0, "tree_builds": 0})
    got = predict_from_run(m, 1, {"tree_s": 0.02, "jit_s": 0.005})
    assert got["hit_rate"] is None and got["p_hit"] == 0.0 and not got["tree_s_in_run"]
    assert got["predicted_tokens_per_s"] == pytest.approx(3.0 / (1.5 * 0.010))


def test_rounds_run_as_two_cohorts_are_reported_beside_the_prediction():
    """Theorem 7 counts a round without a tree as SD's (1 + T_b); two cohorts overlap that draft with a
    verify, so the report names their share next to the prediction."""
    from saguaro_dist.bench.report import theorem7_lines
    m = Measurement(tokens=31, seconds=1.0, outputs=[], cache_hits=0, cache_misses=0,
                    engine={"rounds": 10, "verify_s": 0.1, "jit_rounds": 10, "cohort_rounds": 6, "tree_build_s": 0.0,
                            "tree_builds": 0})
    got = predict_from_run(m, 2, {"tree_s": 0.02, "jit_s": 0.005})
    assert got["cohort_share"] == pytest.approx(0.6)
    [line] = theorem7_lines([{"system": "ssd", "batch": 2, "temperature": 0.7, "theorem7": got}])
    assert line.endswith("; 60% of rounds two cohorts (Theorem 7 counts them as whole SD rounds)")


def test_the_best_case_is_every_round_of_the_cheaper_kind():
    # a tree takes 3 verifies, a just-in-time draft 0.5: rounds without trees are the best case
    m = Measurement(tokens=31, seconds=1.0, outputs=[], cache_hits=6, cache_misses=0,
                    engine={"rounds": 10, "verify_s": 0.1, "jit_rounds": 4, "tree_build_s": 0.18, "tree_builds": 6})
    got = predict_from_run(m, 1, {"tree_s": 0.02, "jit_s": 0.005})
    assert got["best_case_tokens_per_s"] == pytest.approx(3.0 / (1.5 * 0.010) * 31 / 30)
    assert got["best_case_tokens_per_s"] > got["predicted_run_tokens_per_s"]


def test_each_kind_of_round_brings_its_own_tokens():
    """10 rounds, 31 tokens after the prefill's: 4 waited for a neural draft and verified 4 tokens each, the
    6 tree rounds (some misses on the fast backup) 2.5 each. At the run's p the mix is its mean; the best
    case gives every round one kind with that kind's tokens, not the mean."""
    m = Measurement(tokens=32, seconds=1.0, outputs=[], cache_hits=4, cache_misses=2, fallbacks={"fast": 2},
                    engine={"rounds": 10, "verify_s": 0.1, "jit_rounds": 4, "jit_round_tokens": 16,
                            "tree_build_s": 0.06, "tree_builds": 6})
    got = predict_from_run(m, 1, {"tree_s": 0.02, "jit_s": 0.004})
    assert (got["tokens_per_hit_round"], got["tokens_per_miss_round"]) == (2.5, 4.0)
    assert got["tokens_per_round"] == pytest.approx(3.1)
    time = 0.6 * 1 + 0.4 * (1 + 0.4)
    assert got["predicted_tokens_per_s"] == pytest.approx(3.1 / (time * 0.010))  # the measured mix: the mean
    # just-in-time every round: 4 tokens in 1.4 verifies (286/s) beats trees' 2.5 in one (250/s); with the
    # mean for both kinds, trees would have looked best (310/s)
    assert got["best_case_tokens_per_s"] == pytest.approx(4.0 / (1.4 * 0.010) * 32 / 31)


def test_a_best_case_is_never_claimed_for_a_kind_the_run_did_not_run():
    """Every round waited for a just-in-time draft (b = 8, T = 0.7 on the demo pair): how many tokens a round
    of trees would verify is unknown, so the best case is the measured kind's."""
    m = Measurement(tokens=248, seconds=1.0, outputs=[], cache_hits=36, cache_misses=64, fallbacks={"neural": 64},
                    engine={"rounds": 10, "verify_s": 0.1, "jit_rounds": 10, "jit_round_tokens": 240,
                            "tree_build_s": 0.01, "tree_builds": 10})
    got = predict_from_run(m, 8, {"tree_s": 0.005, "jit_s": 0.005})
    assert got["p_hit"] == 0.0 and got["tokens_per_hit_round"] is None and got["tokens_per_miss_round"] == 24.0
    assert got["best_case_tokens_per_s"] == pytest.approx(got["predicted_run_tokens_per_s"])


def test_the_run_is_predicted_with_its_own_prefills_and_first_tokens():
    """Theorem 7 predicts decoding; the measured tok/s is the whole call's. 8 prompts run one at a time
    (b = 1): 8 first tokens came from prefills that took 0.1 s, the other 1016 from rounds."""
    m = Measurement(tokens=1024, seconds=2.3, outputs=[[0] * 128] * 8, cache_hits=254, cache_misses=0,
                    engine={"rounds": 254, "verify_s": 1.27, "prefill_s": 0.1, "tree_build_s": 0.254, "tree_builds": 254})
    got = predict_from_run(m, 1, {"tree_s": 0.001, "jit_s": 0.004})
    assert got["tokens_per_round"] == pytest.approx(1016 / 254)                 # 4 a round, not (1024 - 1) / 254
    assert got["predicted_tokens_per_s"] == pytest.approx(4.0 / 0.005)          # every round one 5 ms verify
    assert got["predicted_run_tokens_per_s"] == pytest.approx(1024 / (0.1 + 1016 / 800.0))
    assert got["measured_over_predicted"] == pytest.approx((1024 / 2.3) / got["predicted_run_tokens_per_s"])


def test_the_trees_best_case_keeps_the_misses_that_waited():
    """Trees every round cannot beat the tree rounds the run measured: at b = 1, T = 0.7 most lookups miss and
    the neural backup makes those rounds wait. 10 rounds, 4 of them the gate's just-in-time ones; of the 6 tree
    rounds 3 missed onto the neural backup: "trees every round" is p = 0.5, not 1."""
    m = Measurement(tokens=31, seconds=1.0, outputs=[], cache_hits=3, cache_misses=3, fallbacks={"neural": 3},
                    engine={"rounds": 10, "verify_s": 0.1, "just_in_time_rounds": 4, "jit_rounds": 7,
                            "jit_round_tokens": 21, "tree_build_s": 0.06, "tree_builds": 6})
    got = predict_from_run(m, 1, {"tree_s": 0.02, "jit_s": 0.008})
    assert (got["tokens_per_hit_round"], got["tokens_per_miss_round"]) == (3.0, 3.0)
    trees = 3.0 / ((0.5 * 1 + 0.5 * 1.8) * 0.010)    # T_p 0.6 hidden; T_b 0.8 on the waiting half
    just_in_time = 3.0 / (1.8 * 0.010)
    assert got["best_case_tokens_per_s"] == pytest.approx(max(trees, just_in_time) * 31 / 30)
    assert got["best_case_tokens_per_s"] < 3.0 / 0.010 * 31 / 30    # what p = 1 claimed


def test_rounds_of_n_gram_proposals_are_mixed_in_at_one_verify_each():
    # 20 rounds of 10 ms verifies: 10 n-gram rounds (2 tokens each, one verify), 10 of Theorem 7's, all just in
    # time (4 tokens each after a 5 ms draft: 1.5 verifies). 1 token from the prefill, 61 in all.
    assert with_fast_rounds(400.0, 4.0, 0.0, 2.0, 0.010) == 400.0
    m = Measurement(tokens=61, seconds=1.0, outputs=[], cache_hits=0, cache_misses=0, fallbacks={},
                    engine={"rounds": 20, "verify_s": 0.2, "just_in_time_rounds": 10, "jit_rounds": 10,
                            "jit_round_tokens": 40, "fast_rounds": 10, "fast_round_tokens": 20})
    got = predict_from_run(m, 1, {"tree_s": 0.02, "jit_s": 0.005})
    assert (got["fast_share"], got["tokens_per_fast_round"], got["tokens_per_miss_round"]) == (0.5, 2.0, 4.0)
    assert got["p_hit"] == 0.0  # of Theorem 7's rounds, every one waited for a draft
    assert got["predicted_tokens_per_s"] == pytest.approx((10 * 4 + 10 * 2) / (10 * 0.015 + 10 * 0.010))  # 240
    assert got["best_case_tokens_per_s"] == pytest.approx(61 / (60 / (4 / 0.015)))  # just in time (267) beats 2 / 10 ms


def test_tree_rounds_whose_rows_all_took_n_gram_proposals_count_as_n_gram_rounds():
    """They waited for no tree (one verify each) but their rows were chosen for a good match: they join the
    prediction's n-gram rounds, not the best case's "every round n-gram proposals alone"."""
    m = Measurement(tokens=71, seconds=1.0, outputs=[], cache_hits=0, cache_misses=0, fallbacks={},
                    engine={"rounds": 20, "verify_s": 0.2, "just_in_time_rounds": 10, "jit_rounds": 10,
                            "jit_round_tokens": 40, "fast_rounds": 5, "fast_round_tokens": 10,
                            "lookup_rounds": 5, "lookup_round_tokens": 20})
    got = predict_from_run(m, 1, {"tree_s": 0.02, "jit_s": 0.005})
    assert (got["fast_share"], got["tokens_per_fast_round"], got["tokens_per_miss_round"]) == (0.5, 3.0, 4.0)
    assert got["predicted_tokens_per_s"] == pytest.approx((10 * 4 + 10 * 3) / (10 * 0.015 + 10 * 0.010))
    # n-gram alone (the gate's rounds: 2 / 10 ms) and just in time (4 / 15 ms) lose to the run's own mix
    assert got["best_case_tokens_per_s"] == pytest.approx(got["predicted_run_tokens_per_s"])
    assert got["best_case_tokens_per_s"] > 71 / (70 / (4 / 0.015))


def test_the_best_case_is_never_below_the_runs_own_mix():
    """Tree rounds whose rows all took n-gram proposals leave Theorem 7 the rows without a good match:
    every round of one kind at their tokens would gain less than the run's own mix, which it reached."""
    m = Measurement(tokens=81, seconds=1.0, outputs=[], cache_hits=5, cache_misses=0, fallbacks={},
                    engine={"rounds": 20, "verify_s": 0.2, "just_in_time_rounds": 0, "jit_rounds": 0,
                            "jit_round_tokens": 0, "tree_build_s": 0.05, "tree_builds": 5,
                            "lookup_rounds": 15, "lookup_round_tokens": 70})
    got = predict_from_run(m, 1, {"tree_s": 0.01, "jit_s": 0.005})
    assert got["tokens_per_hit_round"] == 2.0  # the 5 tree rounds' 10 tokens
    assert got["best_case_tokens_per_s"] == pytest.approx(got["predicted_run_tokens_per_s"])
