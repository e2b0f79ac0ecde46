"""The acceptance counters stop at a sequence's end: a round's tokens past a stop token or max_tokens are dropped
from the output, and the draft tokens offered for those positions are neither drafted nor accepted
(metrics.counted_speculation). Counted, a short request's last round scored K accepted for one token kept."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import DEVICE, llama_config, save_model
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine.metrics import RequestMetrics, counted_speculation

K = 4
PROMPT = [5, 9, 2, 7, 11, 3]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """SD with the target as its own draft, greedy: every draft token is accepted, each full round gains K + 1."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("counters") / "target"
    save_model(path, llama_config(96, 32, 1), seed=0)
    with LLM(device=DEVICE, model=str(path), draft=str(path), mode="sd", k=K, max_batch_size=4,
             draft_executor="thread") as llm:
        yield llm


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def expected(round_tokens: int) -> tuple[int, int, int]:
    """(rounds, drafted, accepted) of a request whose rounds kept round_tokens tokens, all drafts accepted."""
    rounds = -(-round_tokens // (K + 1))
    last = round_tokens - (K + 1) * (rounds - 1)  # kept of the last round: an end before its bonus cuts it
    counted = K * (rounds - 1) + min(last, K)
    return rounds, counted, counted


@pytest.mark.parametrize("drafted, accepted, kept, want", [
    (4, 4, 5, (4, 4)),  # all kept (the bonus too): as verified
    (4, 2, 3, (4, 2)),  # a rejection, the bonus kept (an end there or none): as verified
    (4, 0, 1, (4, 0)),
    (4, 4, 1, (1, 1)),  # the end at the first accepted token: the 3 drafted past it count for nothing
    (4, 3, 2, (2, 2)),
    (4, 2, 2, (2, 2)),  # the end at the last accepted token: the rejected one and the bonus dropped
    (3, 1, 0, (0, 0)),  # nothing kept (a grammar failure at the first token)
    (0, 0, 1, (0, 0)),
])
def test_counted_speculation(drafted, accepted, kept, want):
    assert counted_speculation(drafted, accepted, kept) == want


def test_the_pending_round_is_not_in_the_request_metrics_dict():
    assert "verified" not in RequestMetrics(verified=(4, 4)).to_dict()


def test_a_round_cut_by_max_tokens_counts_only_the_tokens_kept(llm):
    lengths = (2, 3, 6, 7, 11)
    m0 = llm.metrics
    drafted0, accepted0, drafts0 = m0.drafted_tokens, m0.accepted_tokens, m0.drafts
    outs = llm.generate(prompt_token_ids=[PROMPT] * len(lengths), sampling_params=[greedy(n) for n in lengths],
                        use_tqdm=False)
    for n, out in zip(lengths, outs):
        m = out.metrics
        assert len(out.token_ids) == n
        assert (m.rounds, m.drafted_tokens, m.accepted_tokens) == expected(n - 1), (n, m)  # the first: prefill's
        assert m.acceptance_rate == 1.0
        assert m.mean_accepted_length <= (n - 1) / m.rounds + 1, (n, m)
    m = llm.metrics
    assert m.drafted_tokens - drafted0 == sum(o.metrics.drafted_tokens for o in outs)
    assert m.accepted_tokens - accepted0 == sum(o.metrics.accepted_tokens for o in outs)
    assert m.drafts - drafts0 == sum(o.metrics.rounds for o in outs)


def test_a_round_cut_by_a_stop_token_counts_only_the_tokens_kept(llm):
    reference = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(11), use_tqdm=False)[0].token_ids
    at = next(i for i in range(2, 11) if reference[i] not in reference[:i] and i % (K + 1) != 0)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(11, stop_token_ids=[reference[at]]),
                       use_tqdm=False)[0]
    assert out.token_ids == reference[:at + 1] and out.finish_reason == "stop"
    m = out.metrics
    assert (m.rounds, m.drafted_tokens, m.accepted_tokens) == expected(at), (at, m)
