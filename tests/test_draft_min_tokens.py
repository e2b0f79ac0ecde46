"""The draft told the request's min_tokens and the ends it holds back (DraftSampling.min_tokens, end_token_ids):
at a position that fewer than min_tokens output tokens precede, it proposes no eos id or stop token, as the
target never samples one there. Acceptance only: exactness holds either way (the target bars them itself)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine_helpers import llama_config, save_model, self_drafted, self_drafting_target
from saguaro_dist import SamplingParams
from saguaro_dist.config import Config
from saguaro_dist.distributed.codec import CodecError, sampling_from_proto, sampling_to_proto
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
from saguaro_dist.engine.build import build_draft_worker
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.messages import DraftSampling, JitDraftRequest, PrefillRequest
from saguaro_dist.spec.min_tokens import (
    MAX_END_TOKEN_IDS, RowEnds, checked_end_ids, draft_end_ids, held_back_rows, hold_back_positions,
)

pytestmark = pytest.mark.timeout(300)
K = 3
GREEDY = DraftSampling(0.0, 0, 1.0, None)
PROMPT, BONUS = [5, 6, 7, 8], 7  # after the first round the output is [BONUS]: one token
END = 9                          # the end id of the worker tests, made the draft's every choice where allowed


# ---- the per-position rule ---------------------------------------------------------------------------
def test_held_back_rows_are_the_positions_short_of_min_tokens():
    assert held_back_rows(0, 3, 5) == 3           # positions after 0, 1, 2 output tokens
    assert held_back_rows(2, 3, 5) == 1
    assert held_back_rows(3, 3, 5) == held_back_rows(7, 3, 5) == 0
    assert held_back_rows(0, 10, 4) == 4          # every row
    assert held_back_rows(0, 0, 4) == 0


def test_the_ends_told_are_the_distinct_eos_and_stop_ids_and_only_under_min_tokens():
    assert draft_end_ids(2, {7, 2}, (2, 9), 100) == (2, 7, 9)
    assert draft_end_ids(0, {7}, (9,), 100) == ()
    huge = draft_end_ids(1, set(), range(MAX_END_TOKEN_IDS + 5, -1, -1), 1 << 30)  # the smallest: any vocabulary's ids
    assert len(huge) == MAX_END_TOKEN_IDS and huge[0] == 0 and huge[-1] == MAX_END_TOKEN_IDS - 1


@pytest.mark.parametrize("min_tokens, ids, match", [
    (-1, (), "min_tokens"), (1.5, (), "min_tokens"), (True, (), "min_tokens"),
    (1, (3, -2), "end_token_ids"), (1, (3, 1.0), "end_token_ids"), (1, 5, "end_token_ids"),
    (1, range(MAX_END_TOKEN_IDS + 1), f"at most {MAX_END_TOKEN_IDS}"),
])
def test_bad_min_tokens_or_end_ids_are_refused(min_tokens, ids, match):
    with pytest.raises(ValueError, match=match):
        checked_end_ids(min_tokens, ids)
    with pytest.raises(ValueError, match=match):
        DraftSampling(0.0, 0, 1.0, None, min_tokens=min_tokens, end_token_ids=ids)


def test_row_ends_bar_each_row_until_its_own_count_reaches_min_tokens():
    rule = RowEnds(ends=[(1, 3), (2,), (1,)], before=[1, 2, 0], min_tokens=[3, 3, 0])
    barred = [rule.apply(torch.zeros(3, 4)).isinf().nonzero().tolist()]
    rule.drew(torch.tensor([0, 0, 0]))
    barred.append(rule.apply(torch.zeros(3, 4)).isinf().nonzero().tolist())
    rule.drew(torch.tensor([0, 0, 0]))
    barred.append(rule.apply(torch.zeros(3, 4)).isinf().nonzero().tolist())
    assert barred == [[[0, 1], [0, 3], [1, 2]], [[0, 1], [0, 3]], []]
    big = RowEnds(ends=[(2, 70)], before=[0], min_tokens=[1])  # an id past this vocabulary bars nothing
    assert big.apply(torch.zeros(1, 4)).isinf().nonzero().tolist() == [[0, 2]]


def test_positions_bar_the_rows_short_of_min_tokens():
    logits = torch.zeros(4, 5)
    held = hold_back_positions(logits, 1, 3, (4, 0, 9))  # rows after 1, 2 output tokens
    assert held.isinf().nonzero().tolist() == [[0, 0], [0, 4], [1, 0], [1, 4]]
    assert hold_back_positions(logits, 3, 3, (4,)) is logits and not logits.isinf().any()


# ---- the draft worker ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("min_tokens_draft")
    save_model(path, llama_config(vocab=64, hidden=32, layers=2), seed=3)
    return str(path)


def favouring_end(temperature: float = 0.0, **kw) -> DraftSampling:
    """END the draft's choice wherever it may come (a bias of 100: ~1 of the probability at T = 1)."""
    return DraftSampling(temperature, 0, 1.0, 1 if temperature else None, logit_bias={END: 100.0}, **kw)


def drafted(backend, sampling: DraftSampling) -> list[int]:
    """The draft's first speculation after PROMPT and the bonus BONUS (its output so far: [BONUS])."""
    backend.prefill([PrefillRequest(0, PROMPT, sampling)])
    return backend.jit_draft([JitDraftRequest(0, 0, 0, BONUS)])[0].tokens.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_hold_the_ends_back_while_short_of_min_tokens(draft_dir, temperature):
    """Output [BONUS], min_tokens 3: x_1 and x_2 (after 1 and 2 output tokens) are no end, x_3 may be."""
    worker = build_draft_worker(Config(model=draft_dir, draft=draft_dir, mode="sd", k=K))
    assert drafted(worker, favouring_end(temperature)) == [END] * K
    told = drafted(worker, favouring_end(temperature, min_tokens=3, end_token_ids=(END, 2)))
    assert END not in told[:2] and 2 not in told[:2] and told[2] == END
    assert drafted(worker, favouring_end(temperature, min_tokens=1, end_token_ids=(END,))) == [END] * K  # met


@pytest.mark.parametrize("temperature, bonus_draw", [(0.0, "top_f"), (1.0, "coupled"), (1.0, "top_f")])
def test_tree_candidates_and_branches_hold_the_ends_back_by_their_own_path(draft_dir, temperature, bonus_draw):
    """Each branch (k, t) and its K tokens sit after 1 + k, 2 + k, ... output tokens: none of the first
    min_tokens - 1 positions of spec[:k] + [t] + branch is END; past them the branch proposes END."""
    config = Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=12, bonus_draw=bonus_draw)
    worker = build_draft_worker(config)
    spec = drafted(worker, favouring_end(temperature, min_tokens=4, end_token_ids=(END,)))
    tree = worker.build_trees()[0]
    branches = list(zip(tree.accepted, tree.bonus_tokens, tree.proposals.tokens.tolist()))
    paths = [spec[:k] + [t] + b for k, t, b in branches]
    assert paths and all(END not in path[:3] for path in paths), paths  # positions after 1, 2, 3 output tokens
    assert all(b[i] == END for k, _, b in branches for i in range(max(0, 2 - k), K)), branches  # drawn after 4+
    assert any(k == 3 and t == END for k, t in zip(tree.accepted, tree.bonus_tokens))  # k = 3's bonus: after 4


# ---- the wire -------------------------------------------------------------------------------------------
def test_min_tokens_cross_the_wire_and_are_checked_there():
    sampling = replace(GREEDY, min_tokens=5, end_token_ids=(9, 2))
    assert sampling_from_proto(sampling_to_proto(sampling)) == sampling
    assert sampling.end_token_ids == (2, 9)
    for field, value in (("min_tokens", -1), ("end_token_ids", [3, -4])):
        msg = sampling_to_proto(sampling)
        if field == "min_tokens":
            msg.min_tokens = value
        else:
            msg.end_token_ids[:] = value
        with pytest.raises(CodecError, match=field):
            sampling_from_proto(msg)
    msg = sampling_to_proto(sampling)
    msg.end_token_ids.extend(range(100, 100 + MAX_END_TOKEN_IDS))
    with pytest.raises(CodecError, match="end_token_ids must hold at most"):
        sampling_from_proto(msg)
    msg = sampling_to_proto(GREEDY)
    msg.ClearField("min_tokens")  # a sender that predates them: nothing held back
    assert sampling_from_proto(msg) == GREEDY


def test_a_grpc_draft_is_told_min_tokens(draft_dir):
    """Over real gRPC on loopback: the served draft proposes what the in-process draft told min_tokens does."""
    config = Config(model=draft_dir, draft=draft_dir, mode="ssd", k=K, fan_out=8)
    local = LocalDraftBackend(build_draft_worker(config))
    sampling = favouring_end(min_tokens=3, end_token_ids=(END,))
    told = drafted(local, sampling)
    server, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0)
    remote = GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=10.0)
    try:
        assert drafted(remote, sampling) == told != [END] * K
    finally:
        remote.close()
        local.close()
        server.stop(None)


# ---- the engine: a draft that is the target itself ---------------------------------------------------
VOCAB, EOS = 6, 5                            # the tiny tokenizer's a..e are ids 0..4, <eos> 5
PROMPTS = [[0, 4], [1, 2], [3, 3, 1, 0]]     # greedy, each ends within 3 tokens (4, then <eos>)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return self_drafting_target(tmp_path_factory.mktemp("min_tokens_target"), VOCAB)


def generate(target: str, params: SamplingParams, **kwargs):
    return self_drafted(target, PROMPTS, params, K, **kwargs)


def acceptance(outs) -> float:
    return sum(o.metrics.accepted_tokens for o in outs) / sum(o.metrics.drafted_tokens for o in outs)


@pytest.mark.parametrize("mode, executor, stop", [("sd", "thread", ()), ("ssd", "thread", ()), ("ssd", "thread", (4,)),
                                                  pytest.param("ssd", "process", (4,), marks=pytest.mark.slow)])
def test_a_draft_told_min_tokens_is_accepted_and_greedy_stays_ar(target, mode, executor, stop):
    """The draft is the target: told min_tokens it proposes the held-back target's choices (all accepted,
    up to fp near-ties); untold, it proposed <eos> (or the stop token) wherever the target's argmax was it.
    "process": the fields cross the pipe to the draft's child process."""
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=12, stop_token_ids=list(stop))
    plain = [o.outputs[0].token_ids for o in generate(target, replace(params, min_tokens=0), mode="ar")]
    assert all(len(out) <= 3 and out[-1] in (EOS, *stop) for out in plain), plain
    want = [o.outputs[0].token_ids for o in generate(target, params, mode="ar")]
    outs = generate(target, params, mode=mode, draft_executor=executor)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(len(out) >= 12 and not {EOS, *stop} & set(out[:12]) for out in want), want
    assert acceptance(outs) > 0.95, acceptance(outs)


def test_stop_ids_past_the_vocabulary_are_not_told_and_cannot_break_the_wire(tmp_path):
    """A stop_token_id may be any int (vLLM's): one past int64 went into end_token_ids and failed the gRPC
    encode mid-step, aborting every request in flight (the reviewer's reproduction, over loopback gRPC)."""
    from saguaro_dist.distributed.draft_pool import DraftPool
    from saguaro_dist.engine.build import make_runner
    from saguaro_dist.engine.engine import Engine
    from saguaro_dist.engine.sequence import Sequence
    assert draft_end_ids(2, {7, 200}, (2**63, 9), 100) == (7, 9)
    save_model(tmp_path, llama_config(64, 32, 2), seed=3)
    config = Config(model=str(tmp_path), draft=str(tmp_path), mode="ssd", k=3, fan_out=4, fallback="neural",
                    draft_threads=1)
    server, port = serve_draft(build_draft_worker(config), "127.0.0.1", 0)
    engine = Engine(config, make_runner(config.model, config),
                    DraftPool([GrpcDraftBackend([f"127.0.0.1:{port}"], deadline_s=20.0)], max_batch_size=4), None, {1})
    try:
        innocent = Sequence(0, "innocent", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        engine.add(innocent)
        engine.step()
        engine.add(Sequence(1, "huge-stop", [9, 10, 11],
                            SamplingParams(temperature=0, max_tokens=6, min_tokens=2, stop_token_ids=[2**63])))
        for _ in range(40):
            engine.step()
            if innocent.finished:
                break
        assert innocent.finished and len(innocent.output_token_ids) == 12
    finally:
        engine.close()
        server.stop(None)


def test_many_end_ids_bar_their_rows_at_once():
    """Rows sharing a request's ends are barred in one assignment (a request may hold back thousands)."""
    ends = tuple(range(0, 60, 2))
    rule = RowEnds(ends=[ends, ends, (5,), ()], before=[0, 9, 0, 0], min_tokens=[3, 3, 1, 3])
    out = rule.apply(torch.zeros(4, 64))
    assert torch.isinf(out[0, list(ends)]).all() and torch.isfinite(out[0, 1::2]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[3]).all()  # past min_tokens; no ends
    assert torch.isinf(out[2, 5]) and int(torch.isinf(out[2]).sum()) == 1
