"""Ranks of exactly tied log-probabilities (common with bf16 logits): the chosen (or prompt) token always has
the engine's rank, vLLM's count of tokens at least as likely (so it ranks last among its equals, inside the
top N too), the top N take 1, 2, ... in topk order around it, and no two entries of a position share a rank;
the offline API (engine/logprob_objects) and the HTTP server (serve/responses) agree, and chat's
top_logprobs are the topk's N tokens even when the chosen one ties with the last of them."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.engine.logprob_objects import logprob_entry
from saguaro_dist.engine.logprobs import token_logprobs
from saguaro_dist.serve.responses import CHAT, COMPLETION, prompt_logprobs
from test_serve_fixtures import make_tokenizer, write_llama


class IdTokenizer:
    def decode(self, ids: list[int]) -> str:
        return f"t{ids[0]}"


def offline_ranks(logits: list[float], chosen: int, top_n: int) -> dict[int, int | None]:
    entry = token_logprobs(torch.tensor([logits]), [chosen], top_n)[0]
    return {t: lp.rank for t, lp in logprob_entry(entry, top_n, None).items()}


def server_ranks(logits: list[float], chosen: int, top_n: int) -> dict[int, int | None]:
    entry = token_logprobs(torch.tensor([logits]), [chosen], top_n)[0]
    return {int(t): v["rank"] for t, v in prompt_logprobs(IdTokenizer(), [None, entry], top_n)[1].items()}


@pytest.mark.parametrize("ranks_of", [offline_ranks, server_ranks])
def test_a_chosen_token_tied_inside_the_top_ranks_last_among_its_equals(ranks_of):
    assert ranks_of([1.0, 1.0, 0.0], 1, 2) == {1: 2, 0: 1}  # the reviewer's case: was {1: 1, 0: 2}
    assert ranks_of([1.0, 1.0, 0.0], 0, 2) == {0: 2, 1: 1}
    assert ranks_of([2.0, 1.0, 1.0, 0.0], 1, 3) == {1: 3, 0: 1, 2: 2}


@pytest.mark.parametrize("ranks_of", [offline_ranks, server_ranks])
def test_ranks_are_distinct_and_the_chosen_one_is_the_engines_count(ranks_of):
    """Every tie pattern of a small row, every chosen token, every N: the chosen token has the >= count, the
    others distinct ranks from 1 in descending log p, none shared with the chosen token's."""
    rows = [[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [2.0, 1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]]
    for row in rows:
        for chosen in range(len(row)):
            for top_n in range(len(row) + 1):
                ranks = ranks_of(row, chosen, top_n)
                assert ranks[chosen] == sum(v >= row[chosen] for v in row), (row, chosen, top_n)
                others = [ranks[t] for t in ranks if t != chosen]
                assert len(set(ranks.values())) == len(ranks), (row, chosen, top_n, ranks)
                assert others == sorted(others) and others[:1] in ([], [1], [2]), (row, chosen, top_n, ranks)


def test_chat_top_logprobs_are_the_topk_when_the_chosen_token_ties_outside_it():
    logits = torch.tensor([[1.0, 1.0, 0.0]])
    top_ids = logits.topk(1).indices[0].tolist()
    chosen = 1 - top_ids[0]  # tied with the top token, left out of the top 1 by topk
    entry = token_logprobs(logits, [chosen], 1)[0]
    tops = CHAT.logprobs(IdTokenizer(), [chosen], [entry], 1)["content"][0]["top_logprobs"]
    assert [t["token"] for t in tops] == [f"t{top_ids[0]}"]  # was the chosen token (listed first, stable sort)
    completion_tops = COMPLETION.logprobs(IdTokenizer(), [chosen], [entry], 1)["top_logprobs"][0]
    assert list(completion_tops) == [f"t{chosen}", f"t{top_ids[0]}"]


@pytest.fixture(scope="module")
def twin_rows_target(tmp_path_factory) -> str:
    """A tiny Llama whose lm_head rows come in identical pairs (2j, 2j + 1): every token's logit ties exactly
    with its twin's at every position, as bf16 rounding makes ties in real models."""
    path = write_llama(tmp_path_factory.mktemp("twin_rows"), make_tokenizer(), hidden=32, layers=1, seed=11)
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight[1::2] = weight[0::2][: weight[1::2].shape[0]]
    model.save_pretrained(path)
    return path


def test_engine_ranks_a_greedy_token_tied_with_its_twin_second(twin_rows_target):
    """Greedy picks one of the likeliest twins: the top 2 is the pair, the chosen token rank 2 (vLLM's count),
    its twin 1; prompt tokens rank by their count too, never sharing a rank with another entry."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    with LLM(model=twin_rows_target, mode="ar") as llm:
        out = llm.generate(["the cat sat on the mat"], params, use_tqdm=False)[0]
    vocab = len(make_tokenizer())
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert len(entry) == 2 and entry[token].rank == 2, entry
        assert entry[token ^ 1].rank == 1 and entry[token ^ 1].logprob == entry[token].logprob, entry
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert len({lp.rank for lp in entry.values()}) == len(entry), entry
        twin = token ^ 1
        if twin < vocab and twin in entry:
            assert entry[token].rank > entry[twin].rank, entry
