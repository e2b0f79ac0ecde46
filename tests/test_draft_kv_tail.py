"""The draft proposes from the committed text, whatever proposed the rounds in between.

A draft's KV holds the tokens it ran before they were verified (a just-in-time draft's x_1..x_{K-1}, a
glue's x_1..x_K). When the next rounds' speculations come from elsewhere (a tree's branch, an n-gram
proposal, the other half of a split draft) and commit other tokens at those positions, the KV must be cut
back to where it departs from the committed text, not merely to the committed length: before session 61
the rejected x's stayed in the KV for the sequence's life. Every token stayed exact (the target verifies
whatever is proposed), so only the proposals' quality showed it: one-host SSD's misses drafted 3.13
tokens a round at T = 0.7 against SD's 3.49, and greedy drafts differed from the draft's own greedy
continuation in 16 of 95 misses. The reference here is a fresh worker prefilled with the whole text."""
import pytest
import torch

from engine_helpers import llama_config, save_model
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, Outcome, PrefillRequest, Release

K = 3
PROMPT = [5, 6, 7, 8] * 5  # over the prefix cache's 16 tokens
FIRST_BONUS = 7
GREEDY = DraftSampling(0.0, 0, 1.0, None)
SAMPLED = DraftSampling(1.0, 0, 1.0, 11)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_tail_draft")
    save_model(path, llama_config(vocab=64, hidden=32, layers=2), seed=5)
    return str(path)


def worker_for(draft_dir, text: list[int], sampling: DraftSampling):
    # An explicit fan-out: trees then do not depend on the outcomes each worker has recorded.
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=(2, 2, 1, 1)))
    worker.prefill([PrefillRequest(0, text, sampling)])
    return worker


def other_than(token: int) -> int:
    return (token + 1) % 64


def drafted_then_overtaken(draft_dir, sampling: DraftSampling, wants_tree: bool):
    """A worker that drafted round 0 (its KV then holds x_1..x_{K-1}), then learned two outcomes: x_1
    accepted with a bonus where it had run x_2, the next speculation an n-gram proposal; that proposal all
    accepted, with bonus 30, the next one a branch of another worker's tree. Returns it and the text
    committed before that pending bonus."""
    worker = worker_for(draft_dir, PROMPT, sampling)
    x = worker.jit_draft([JitDraftRequest(0, 0, 0, FIRST_BONUS)])[0].tokens.tolist()
    lookup, branch = [11, 12, 13], [21, 22, 23]
    worker.observe([Outcome(0, 0, 1, other_than(x[1]), next_tokens=lookup, skip_tree=True)])
    worker.observe([Outcome(0, 1, K, 30, next_tokens=branch, skip_tree=not wants_tree)])
    return worker, PROMPT + [FIRST_BONUS, x[0], other_than(x[1])] + lookup


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_just_in_time_draft_after_rounds_proposed_elsewhere_drafts_from_the_committed_text(draft_dir, sampling):
    worker, text = drafted_then_overtaken(draft_dir, sampling, wants_tree=False)
    text += [30]  # the branch is rejected at once: bonus 40
    drafted = worker.jit_draft([JitDraftRequest(0, 3, 0, 40)])[0]
    reference = worker_for(draft_dir, text, sampling).jit_draft([JitDraftRequest(0, 0, 0, 40)])[0]
    if sampling is GREEDY:
        assert drafted.tokens.tolist() == reference.tokens.tolist()
    else:  # the draws differ (each worker's generator is where its own draws left it); q after the text does not
        torch.testing.assert_close(drafted.probs[0], reference.probs[0], rtol=1e-4, atol=1e-6)
    assert worker.runner.length(0) == len(text) + 1 + K - 1  # the text, the bonus, x_1..x_{K-1}


def test_a_tree_after_rounds_proposed_elsewhere_is_built_on_the_committed_text(draft_dir):
    worker, text = drafted_then_overtaken(draft_dir, GREEDY, wants_tree=True)
    reference = worker_for(draft_dir, text, GREEDY)
    reference.observe([Outcome(0, 0, 0, 30, next_tokens=[21, 22, 23])])  # the same bonus and speculation
    built, expected = worker.build_trees(), reference.build_trees()
    assert [t.keys() for t in built] == [t.keys() for t in expected]
    assert built[0].proposals.tokens.tolist() == expected[0].proposals.tokens.tolist()


def test_the_prefix_cache_keeps_only_the_committed_tokens_a_released_kv_holds(draft_dir):
    """A sequence released with a speculated tail that later rounds overtook leaves the prefix cache the
    KV up to where that tail departs: a new sequence on the same text drafts as a fresh worker does."""
    worker, text = drafted_then_overtaken(draft_dir, SAMPLED, wants_tree=False)
    worker.release([Release(0)])
    worker.prefill([PrefillRequest(1, text + [30], SAMPLED)])
    assert worker.prefixes.enabled and worker.runner.length(1) == len(text) + 1
    drafted = worker.jit_draft([JitDraftRequest(1, 0, 0, 40)])[0]
    reference = worker_for(draft_dir, text + [30], SAMPLED).jit_draft([JitDraftRequest(0, 0, 0, 40)])[0]
    torch.testing.assert_close(drafted.probs[0], reference.probs[0], rtol=1e-4, atol=1e-6)
