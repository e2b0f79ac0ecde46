"""min_tokens under ignore_eos, as vLLM has it: its MinTokensLogitsProcessor bars all_stop_token_ids, which
hold the tokenizer's eos and the generation config's eos ids whatever ignore_eos says (and the request's
stop_token_ids). So no eos id comes among the first min_tokens tokens, even where it would end nothing:
greedy in AR, SD and SSD alike and over HTTP, and sampled from the target's distribution with the eos ids
removed and renormalised."""
from __future__ import annotations

import httpx
import pytest
import torch
from transformers import GenerationConfig

from http_helpers import serve_on_loopback
from saguaro_dist import SamplingParams
from saguaro_dist.serve.api import ServerOptions, create_app
from test_engine_sampling import ALPHA, PROMPT, TINY_VOCAB, chi_square_pvalue, sample_joint, sampling_pair
import test_eos_stop_reasons as eos_case
from test_eos_stop_reasons import AT, FORCE, MODES  # AT: min_tokens = AT - 1, a forced eos id comes from token AT on

TEXT_PROMPT = eos_case.PROMPT
pair, engines = eos_case.pair, eos_case.engines  # its fixtures: a tiny pair whose generation config adds an eos id


def forced(token: int) -> SamplingParams:
    """`token` chosen whenever it may be, under ignore_eos: two of it after the first AT - 1 tokens."""
    return SamplingParams(temperature=0, max_tokens=AT + 1, min_tokens=AT - 1, logit_bias={token: FORCE},
                          ignore_eos=True)


@pytest.mark.parametrize("which", ["tokenizer_eos", "generation_config_eos"])
def test_greedy_holds_every_eos_id_back_in_every_mode(engines, pair, which):
    token, ends = pair[2] if which == "tokenizer_eos" else pair[3], set(pair[2:])
    assert set(engines["ar"].eos_token_ids) == ends
    outs = {m: engines[m].generate([TEXT_PROMPT], forced(token), use_tqdm=False)[0] for m in MODES}
    for mode, out in outs.items():
        assert not ends & set(out.token_ids[:AT - 1]), (mode, out.token_ids)
        assert out.token_ids[AT - 1:] == [token, token] and out.finish_reason == "length", (mode, out.token_ids)
        assert (out.token_ids, out.text) == (outs["ar"].token_ids, outs["ar"].text), mode


def test_the_server_holds_them_back_too(engines, pair):
    extra = pair[3]
    want = engines["ar"].generate([TEXT_PROMPT], forced(extra), use_tqdm=False)[0].text
    with serve_on_loopback(create_app(engines["ar"], ServerOptions("m"))) as url:
        reply = httpx.post(f"{url}/completions", json={
            "model": "m", "prompt": TEXT_PROMPT, "max_tokens": AT + 1, "temperature": 0, "min_tokens": AT - 1,
            "ignore_eos": True, "logit_bias": {str(extra): FORCE}}, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (want, "length")
    words = choice["text"].split()  # (a special token among the first AT - 1 would leave no word)
    assert words[-2:] == ["mat", "mat"] and "mat" not in words[:-2], words


# Sampled: the 6-token pair of tests/test_engine_sampling.py, its generation config adding "e" (4) to the
# tokenizer's <eos> (5); both biased up, so that a target that drew them would draw them often.
EOS_IDS = {TINY_VOCAB["e"], TINY_VOCAB["<eos>"]}
N, DEPTH = 6000, 3
SAMPLED = SamplingParams(temperature=1.0, min_tokens=DEPTH, logit_bias={t: 3.0 for t in EOS_IDS})
SETTINGS = {"ar": dict(mode="ar"), "sd": dict(mode="sd", k=2),
            "ssd": dict(mode="ssd", k=1, fan_out=4, tree_policy="always")}


@pytest.fixture(scope="module")
def sampled_pair(tmp_path_factory):
    target, draft, model = sampling_pair(tmp_path_factory.mktemp("min_tokens_pair"))
    GenerationConfig(eos_token_id=sorted(EOS_IDS)).save_pretrained(target)
    return target, draft, model


def held_back_joint(model) -> dict[tuple[int, ...], float]:
    """The first DEPTH tokens' joint law: at each, the target's softmax with the eos ids removed and the rest
    renormalised (the logit bias touches only them)."""
    joint = {(): 1.0}
    for _ in range(DEPTH):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
            logits[sorted(EOS_IDS)] = float("-inf")
            nxt.update({prefix + (t,): mass * q for t, q in enumerate(logits.softmax(-1).tolist()) if q > 0})
        joint = nxt
    return joint


@pytest.mark.parametrize("mode", MODES)
def test_sampling_follows_the_target_without_its_eos_ids(sampled_pair, mode):
    """sample_joint runs under ignore_eos; an eos id drawn early is a sequence of zero probability here."""
    target, draft, model = sampled_pair
    counts, metrics = sample_joint(target, None if mode == "ar" else draft, SAMPLED, n=N, max_tokens=DEPTH,
                                   **SETTINGS[mode])
    assert mode == "ar" or metrics.rounds > 0 and (mode == "sd" or metrics.cache_hits > 0), metrics
    p = chi_square_pvalue(counts, held_back_joint(model))
    assert p > ALPHA, f"{mode}: chi-square p = {p:.2e}"
