"""The exact-core sampling test through the distributed runtime: drafts behind gRPC in Ray actors on
a real local Ray cluster. Apart from tests/test_distributed.py so that the suite's two workers (a test
file each) can run these slowest cases beside the rest of it."""
from __future__ import annotations

import pytest

from engine_helpers import llama_config, save_model, save_perturbed

pytestmark = pytest.mark.slow


# Each executor (split: drafts beside the target, trees over gRPC; process: everything over gRPC) runs the
# hit path of top-F trees covering every outcome, and ssd_coupled: hits, misses to the neural backup (it asserts
# fallbacks["neural"] > 0, the path ssd_miss_neural took alone, at k = 2 here) and each coupled tree's plan, with
# the draft's guess, crossing gRPC for the target's bonus draw. The process's hit path runs with min_p, which
# crosses to the drafts over gRPC (its plain T = 1 runs in the split and in ssd_coupled).
@pytest.mark.parametrize("case, params, executor", [
    ("ssd_hit_path", "t1", "split"), ("ssd_hit_path", "t1_minp0.85", "process"),
    ("ssd_coupled", "t1", "process"), ("ssd_coupled", "t1", "split")])
def test_sampling_is_exact_through_the_distributed_path(ray_cluster, tmp_path_factory, case, params, executor):
    """The exact-core chi-square test, with the drafts behind gRPC in Ray actors (N_TWIN samples per path:
    the single-process test carries the N-sample power; this one proves the transport changes nothing)."""
    from test_engine_sampling import CASES, N_TWIN, PARAMS, VOCAB, chi_square_pvalue, exact_joint, sample_joint
    root = tmp_path_factory.mktemp("dist_sampling")
    model = save_model(root / "target", llama_config(VOCAB, 32, 1), seed=3, sharpen=2.0)
    save_perturbed(root / "draft", model, seed=4, noise=0.6)
    settings, took_path = CASES[case]
    counts, metrics = sample_joint(str(root / "target"), str(root / "draft"), PARAMS[params], n=N_TWIN,
                                   cluster="auto", num_draft_workers=2, **(settings | {"draft_executor": executor}))
    assert took_path(metrics), metrics
    p = chi_square_pvalue(counts, exact_joint(model, PARAMS[params]))
    assert p > 1e-4, f"{case} on Ray: chi-square p = {p:.2e}"
