"""Every mode fills the whole context, as AR: a speculative round at the context's end scores positions past
max_model_len in the target's position slack (engine/build.py position_slack), and the tokens that would land
there are cut with finish "length". Old: sd / ssd / ngram stopped K + 1 tokens early (a strict prefix of AR's
output), refused prompts within K + 1 of the end that AR accepts, and LLM.max_model_len said K + 1 less than
asked. Real engines over a tiny transformers pair; greedy outputs token-identical to AR's and transformers'."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import DEVICE, assert_greedy_equal, close_pair, hf_greedy
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.model import ModelRunner
from saguaro_dist.model.memory import KVNeed, shortfall

pytestmark = pytest.mark.timeout(600)
MAX_LEN = 40
LOOPING = [5, 9, 2, 7, 11, 3] * 4  # 24 tokens that repeat: n-gram lookup proposes long matches
# ar generates 2 and 1 tokens after these: every mode must take them and end where ar does
NEAR_END = [[(i * 7) % 90 + 1 for i in range(MAX_LEN - 2)], [(i * 5) % 90 + 1 for i in range(MAX_LEN - 1)]]
PROMPTS = [LOOPING, [3, 4, 5, 6, 7], *NEAR_END]
GREEDY = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # past the context's end
SPECULATIVE = [("sd", 1), ("sd", 4), ("ssd", 1), ("ssd", 4), ("ngram", 1), ("ngram", 4)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("context_end_pair"))


def llm_of(pair, mode: str, k: int = 4, draft_of: str = "close") -> LLM:
    draft = {"draft": pair[draft_of], "draft_executor": "thread"} if mode in ("sd", "ssd") else {}
    return LLM(model=pair["target"], mode=mode, k=k, max_model_len=MAX_LEN, device=DEVICE, **draft)


def token_ids(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[tuple[list[int], str]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def ar_outputs(pair):
    with llm_of(pair, "ar") as llm:
        assert llm.max_model_len == MAX_LEN
        return token_ids(llm)


def test_ar_fills_the_context_with_the_targets_greedy_tokens(pair, ar_outputs):
    for prompt, (out, finish) in zip(PROMPTS, ar_outputs):
        assert finish == "length" and len(prompt) + len(out) == MAX_LEN
        assert_greedy_equal(out, hf_greedy(pair["model"], prompt, len(out)), prompt, pair["model"])


@pytest.mark.parametrize("mode, k", SPECULATIVE)
def test_speculative_modes_fill_the_context_as_ar(pair, ar_outputs, mode, k):
    """Token-identical to ar up to the last position of the context (the last round's accepted tokens
    cross it: those past it are cut), prompts one and two short of it accepted; LLM.max_model_len is what
    was asked."""
    with llm_of(pair, mode, k) as llm:
        assert llm.max_model_len == MAX_LEN
        assert token_ids(llm) == ar_outputs
        with pytest.raises(ValueError, match=f"leaves 0 of the model's max length {MAX_LEN}"):  # as ar refuses it
            llm.generate(prompt_token_ids=[[1] * MAX_LEN], sampling_params=GREEDY, use_tqdm=False)


@pytest.mark.parametrize("mode, k", [("sd", 1), ("sd", 4), ("ssd", 4)])
def test_a_sampled_round_past_the_context_end_is_cut(pair, mode, k):
    """T = 1, seeded, the target drafting for itself: every round accepts its K tokens and the bonus, so
    from a 22-token prompt the last round crosses the context's end mid-round (23 + (K + 1) n never hits
    40). Its tokens past the end are cut: each output ends at the context's end exactly, finish "length"."""
    prompts = [LOOPING[:22]] * 3
    sampled = [SamplingParams(temperature=1.0, seed=seed, max_tokens=None, ignore_eos=True) for seed in range(3)]
    with llm_of(pair, mode, k, draft_of="target") as llm:
        for prompt, (out, finish) in zip(prompts, token_ids(llm, sampled, prompts)):
            assert finish == "length" and len(prompt) + len(out) == MAX_LEN


def test_a_runner_holds_its_position_slack_past_max_model_len(pair):
    """The slack's positions (here past max_position_embeddings, 256) take KV and RoPE; max_model_len stays
    the user's, the logits before it are the slack-less runner's, and the slack's end is a hard limit."""
    tokens = [(i * 3) % 90 + 1 for i in range(256)]
    plain = ModelRunner(pair["target"], device=DEVICE, max_model_len=256)
    slack = ModelRunner(pair["target"], device=DEVICE, max_model_len=256, position_slack=5)
    assert (plain.max_model_len, slack.max_model_len, slack.max_positions) == (256, 256, 261)
    for runner in (plain, slack):
        runner.add("s")
    want = torch.cat([plain.extend(["s"], [tokens[:250]], [250])[0], plain.extend(["s"], [tokens[250:]], [6])[0]])
    got = torch.cat([slack.extend(["s"], [tokens[:250]], [250])[0],
                     slack.extend(["s"], [tokens[250:] + [1] * 5], [11])[0]])
    assert torch.allclose(got[:256], want, rtol=0, atol=1e-5) and torch.isfinite(got).all()
    with pytest.raises(ValueError, match=r"exceed max_model_len 256 \+ 5 positions of slack"):
        slack.extend(["s"], [[1]], [1])
    with pytest.raises(ValueError, match="exceed max_model_len 256$"):
        plain.extend(["s"], [[1]], [1])


def test_the_kv_worst_case_counts_the_slack():
    need = KVNeed(batch=2, spare_rows=1, max_len=100, bytes_per_token=8, slack=5)
    assert need.bytes == 3 * 105 * 8 and need.fitting_len(need.bytes) == 100 and need.fitting_batch(need.bytes) == 2
    why = shortfall(need, need.bytes - 1, torch.device("cpu"), 0.9)
    assert "max_model_len 100 (+ 5 speculative)" in why and "Fits: max_model_len 99" in why
