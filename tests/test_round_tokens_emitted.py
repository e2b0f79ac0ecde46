"""Tokens per round kind (EngineMetrics.jit_round_tokens) count only what the requests emitted: a round
verified past a stop token, an EOS, max_tokens or a stop string emits the tokens up to it, and the
engine drops the rest (Engine._append). Real engines on tiny checkpoints; the target drafts for itself,
so greedy rounds accept all K and the end falls inside a round."""
from __future__ import annotations

from dataclasses import replace

from engine_helpers import CyclingGate
from transformers import AutoTokenizer

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.demo import demo_pair
from saguaro_dist.engine import ssd_loop
from saguaro_dist.spec.tree_gate import RoundMode

K = 4
PROMPT = [3, 17, 5, 42, 9, 11]


def sd_run(model: str, params: SamplingParams, **prompt):
    with LLM(model=model, draft=model, mode="sd", k=K, max_batch_size=2, draft_executor="thread") as llm:
        out = llm.generate(sampling_params=params, use_tqdm=False, **prompt)[0]
        return out, llm.metrics


def first_mid_round_index(tokens: list[int]) -> int:
    """An output index that a K + 1 token round passes (token 0 comes from the prefill), whose token is new."""
    return next(i for i in range(2, len(tokens)) if (i - 1) % (K + 1) not in (0, K) and tokens[i] not in tokens[:i])


def test_a_stop_token_inside_a_round_counts_only_the_tokens_up_to_it(tiny_checkpoint):
    """Old: the round counted all K + 1 verified tokens (kept_tokens knew only max_tokens)."""
    model = tiny_checkpoint("llama")
    full, _ = sd_run(model, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), prompt_token_ids=[PROMPT])
    stop = full.token_ids[first_mid_round_index(full.token_ids)]
    out, m = sd_run(model, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]), prompt_token_ids=[PROMPT])
    assert out.token_ids[-1] == stop and out.token_ids == full.token_ids[:len(out.token_ids)]
    assert m.jit_round_tokens == len(out.token_ids) - 1 == m.generated_tokens - 1, m
    assert m.jit_rounds * (K + 1) > m.jit_round_tokens, m  # a round did verify past the stop


def test_max_tokens_inside_a_round_still_counts_only_the_kept_tokens(tiny_checkpoint):
    out, m = sd_run(tiny_checkpoint("llama"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                    prompt_token_ids=[PROMPT])
    assert len(out.token_ids) == 4 and m.jit_round_tokens == 3, m


def test_a_stop_string_inside_a_round_counts_only_the_tokens_up_to_it():
    """A stop string is found in the text after the round (Engine._stop_token_by_token): the tokens after it
    are dropped then, and not counted."""
    target, _ = demo_pair()
    prompt = "def add(a, b):\n    "
    full, _ = sd_run(target, SamplingParams(temperature=0, max_tokens=24), prompts=[prompt])
    stop_text = full.text[:len(full.text) // 2].split()[-1] if full.text.split() else None
    assert stop_text, full.text
    out, m = sd_run(target, SamplingParams(temperature=0, max_tokens=24, stop=[stop_text]), prompts=[prompt])
    assert out.finish_reason == "stop" and len(out.token_ids) < len(full.token_ids), out
    assert m.jit_round_tokens == len(out.token_ids) - 1 == m.generated_tokens - 1, m


class LookupsGate(CyclingGate):
    """Rounds of n-gram proposals alone (the gate scripted), whatever they measure."""

    def __init__(self, modes=None):
        self.cycle, self.rounds = [RoundMode.FAST], 0


def test_ssd_n_gram_rounds_count_only_the_tokens_kept(monkeypatch):
    """Old: ssd's n-gram rounds (fast_round_tokens) added the round's verified tokens up to max_tokens alone, so
    a stop string inside such a round counted the tokens after it. The prompt holds the target's own greedy
    continuation, so the n-gram proposals repeat it and are accepted whole."""
    target, _ = demo_pair()
    monkeypatch.setattr(ssd_loop, "TreeGate", LookupsGate)

    def run(prompt, params):
        with LLM(model=target, draft=target, mode="ssd", k=K, draft_executor="thread", adaptive_lookup_length=False) as llm:
            return llm.generate([prompt], sampling_params=params, use_tqdm=False)[0], llm.metrics

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "def add(a, b):\n    "
    first, _ = run(prompt, greedy)
    loop = prompt + first.text + "\n\n" + prompt  # the target goes on as it went the first time
    full, m = run(loop, greedy)
    assert m.fast_rounds > 0 and m.fast_round_tokens > 0, m
    # a stop string of each later token, past the earlier tokens' text (min_tokens): some fall inside an n-gram
    # round that verified tokens past them
    tokenizer = AutoTokenizer.from_pretrained(target)
    for at in range(K + 2, len(full.token_ids)):
        out, m = run(loop, replace(greedy, min_tokens=at, stop=[tokenizer.decode(full.token_ids[at])]))
        assert out.token_ids == full.token_ids[:at + 1], (at, out.token_ids)
        assert m.jit_round_tokens + m.fast_round_tokens + m.lookup_round_tokens <= len(out.token_ids) - 1, (at, m)
