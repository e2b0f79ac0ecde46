"""The draft told the request's bad words (DraftSampling.bad_words): its drafts and tree branches complete
none of them, as the target's masked choices never do, so it stops proposing what the target must reject.
Acceptance only: exactness holds either way (tests/test_bad_words.py)."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from engine_helpers import llama_config, save_model, self_drafted, self_drafting_target
from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.distributed.codec import CodecError, sampling_from_proto, sampling_to_proto
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
from saguaro_dist.spec.bad_words import banned_at

pytestmark = pytest.mark.timeout(300)
K = 3
GREEDY = DraftSampling(0.0, 0, 1.0, None)
PROMPT, BONUS = [5, 6, 7, 8], 7


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad_words_draft")
    save_model(path, llama_config(vocab=64, hidden=32, layers=2), seed=3)
    return str(path)


def drafted(backend, sampling: DraftSampling) -> list[int]:
    """The draft's first speculation after PROMPT and the bonus BONUS (its output so far: [BONUS])."""
    backend.prefill([PrefillRequest(0, PROMPT, sampling)])
    return backend.jit_draft([JitDraftRequest(0, 0, 0, BONUS)])[0].tokens.tolist()


def completes(output: list[int], tokens: list[int], words) -> bool:
    """Whether any of tokens, following output, completes one of words."""
    return any(t in banned_at(output + tokens[:j], words) for j, t in enumerate(tokens))


def test_drafts_complete_no_bad_word(draft_dir):
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8))
    plain = drafted(worker, GREEDY)
    words = ((plain[0],), (plain[1], plain[2]))  # a one-token word, and a pair the plain draft completes
    told = drafted(worker, replace(GREEDY, bad_words=words))
    assert completes([BONUS], plain, words) and not completes([BONUS], told, words)
    assert told[0] != plain[0]


def test_tree_branches_and_their_bonus_candidates_complete_no_bad_word(draft_dir):
    """Every branch (k, t): neither t after the output and x_1..x_k, nor its K tokens after that, completes a
    bad word (the target never answers such a t); the plain draft's tree does, so the words bite."""
    config = Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=12, adaptive_fan_out=False)
    trees = {}
    for name in ("plain", "told"):
        worker = build_draft_worker(config)
        drafted(worker, GREEDY)
        trees[name] = (worker.build_trees()[0], worker.seqs[0].speculation)
    tree, spec = trees["plain"]
    common = max(range(64), key=lambda t: sum(row.count(t) for row in tree.proposals.tokens.tolist()))
    words = ((common,), (spec[0], spec[1]))
    worker = build_draft_worker(config)
    drafted(worker, replace(GREEDY, bad_words=words))
    told, spec = worker.build_trees()[0], worker.seqs[0].speculation
    assert not completes([BONUS], spec, words)
    for k, t, branch in zip(told.accepted, told.bonus_tokens, told.proposals.tokens.tolist()):
        assert not completes([BONUS], spec[:k] + [t] + branch, words), (k, t, branch)
    assert any(completes([BONUS], trees["plain"][1][:k] + [t] + branch, words)
               for k, t, branch in zip(tree.accepted, tree.bonus_tokens, tree.proposals.tokens.tolist()))


def test_bad_words_cross_the_wire_and_are_checked_there():
    sampling = replace(GREEDY, bad_words=((3,), (4, 5, 6)))
    assert sampling_from_proto(sampling_to_proto(sampling)) == sampling
    msg = sampling_to_proto(sampling)
    msg.bad_words.add()  # an empty word: nothing to bar
    with pytest.raises(CodecError, match="bad_words"):
        sampling_from_proto(msg)
    with pytest.raises(ValueError, match="bad_words"):
        DraftSampling(0.0, 0, 1.0, None, bad_words=((1, -2),))


def test_a_grpc_draft_is_told_the_bad_words(draft_dir):
    """Over real gRPC on loopback: the served draft proposes what the in-process draft told them does."""
    config = Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8)
    local = LocalDraftBackend(build_draft_worker(config))
    words = ((drafted(local, GREEDY)[0],),)
    told = drafted(local, replace(GREEDY, bad_words=words))
    server, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0)
    remote = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)
    try:
        assert drafted(remote, replace(GREEDY, bad_words=words)) == told
    finally:
        remote.close()
        local.close()
        server.stop(None)


# ---- the engine: a draft that is the target itself ---------------------------------------------------
VOCAB, PROMPTS = 6, [[1, 2, 3], [0, 4], [3, 3, 1, 0]]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return self_drafting_target(tmp_path_factory.mktemp("bad_words_target"), VOCAB)


def generate(target: str, params: SamplingParams, **kwargs):
    return self_drafted(target, PROMPTS, params, K, **kwargs)


@pytest.mark.parametrize("mode, executor", [("sd", "thread"), ("ssd", "thread"),
                                            pytest.param("ssd", "process", marks=pytest.mark.slow)])
def test_a_draft_told_the_bad_words_is_accepted_and_greedy_stays_ar(target, mode, executor):
    """The draft is the target: told the bad words it proposes the masked target's choices (all accepted,
    up to fp near-ties); untold, it proposed the banned commonest token wherever the target's argmax was it.
    "process": the words cross the pipe to the draft's child process."""
    plain = [o.outputs[0].token_ids for o in generate(target, PARAMS, mode="ar")]
    letters = [t for out in plain for t in out if t < VOCAB - 1]  # the tiny tokenizer's a..e are ids 0..4 (5: <eos>)
    words = ["abcde"[max(set(letters), key=letters.count)]]
    params = replace(PARAMS, bad_words=words)
    want = [o.outputs[0].token_ids for o in generate(target, params, mode="ar")]
    outs = generate(target, params, mode=mode, draft_executor=executor)
    assert [o.outputs[0].token_ids for o in outs] == want != plain
    acceptance = sum(o.metrics.accepted_tokens for o in outs) / sum(o.metrics.drafted_tokens for o in outs)
    assert acceptance > 0.95, acceptance


def test_a_malformed_bad_words_error_names_the_place_not_the_payload():
    """The decode error becomes a gRPC status whose details travel in a trailer, dropped past 8-16 KiB: a
    payload echoed in it turned INVALID_ARGUMENT into RESOURCE_EXHAUSTED with no explanation."""
    from saguaro_dist.bad_word_ids import checked_word_ids
    big = [list(range(60))] * 127
    for words, where in ((big + [[]], "bad_words[127] is empty"), (big + [[1, -2]], "bad_words[127] is holding '-2'"),
                         (big * 2, "got 254")):
        with pytest.raises(ValueError, match=re.escape(where)) as err:
            checked_word_ids(words)
        assert len(str(err.value)) < 300


def test_allowed_tokens_every_one_barred_by_bad_words_are_refused():
    from saguaro_dist.sampling_params import check_against_model
    params = SamplingParams(allowed_token_ids=[3, 4], _bad_words_token_ids=((3,), (4,), (5, 6)))
    with pytest.raises(ValueError, match="bad_words bar every token of allowed_token_ids"):
        check_against_model(params, 32, frozenset({1}))
    check_against_model(SamplingParams(allowed_token_ids=[3, 4], _bad_words_token_ids=((3,), (5, 4))), 32, frozenset())


def test_a_prefill_whose_end_ids_cover_the_vocabulary_under_min_tokens_is_refused(draft_dir):
    """DraftSampling has no vocabulary, so the draft worker checks this one (the target refuses it alike): every
    token an end id, held back by min_tokens, leaves nothing to draft (logits all -inf)."""
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="sd", k=K))
    every_end = DraftSampling(0.0, 0, 1.0, None, min_tokens=2, end_token_ids=tuple(range(64)))
    with pytest.raises(ValueError, match="every token of the vocabulary"):
        worker.prefill([PrefillRequest(0, PROMPT, every_end)])
    worker.prefill([PrefillRequest(1, PROMPT, GREEDY)])  # the worker serves on
