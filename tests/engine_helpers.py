"""Checkpoints and exactness checks shared by the engine tests (real HF checkpoints, no mocks)."""
from __future__ import annotations

import io
import os
import socket
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from saguaro_dist.bench.departures import NEAR_TIE, RELATIVE_NEAR_TIE  # noqa: F401 (NEAR_TIE: for the suites)

# The engine tests' device: SAGUARO_TEST_DEVICE=cuda runs the exactness suites on a GPU
# (benchmarks/gpu_check.sh); CI has none and runs them on the CPU.
DEVICE = os.environ.get("SAGUARO_TEST_DEVICE", "cpu")
# The near-tie rule the bench judges its greedy departures by (saguaro_dist/bench/departures.py). In bf16 a
# logit is rounded to 8 significant bits: two computations of one position (a decode and a verify row) differ
# by a few of its units. Seen: the demo target's top two 0.0034 apart in fp32 were one bf16 unit apart
# (4.125 vs 4.094), and AR and SD chose differently there.
BF16_NEAR_TIE = RELATIVE_NEAR_TIE["bfloat16"]  # relative to the top logit's magnitude: 4 units in the last place


def llama_config(vocab: int, hidden: int, layers: int, heads: int = 4, kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_model(path, config: LlamaConfig, seed: int, sharpen: float = 4.0) -> LlamaForCausalLM:
    """A random model whose LM head is scaled up so its distributions are peaked like a real LM's."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    return model


def save_perturbed(path, source: LlamaForCausalLM, seed: int, noise: float) -> None:
    """A draft close to the target: the target's weights plus relative Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    clone = LlamaForCausalLM(source.config).eval()
    with torch.no_grad():
        for (_, p), (_, q) in zip(clone.named_parameters(), source.named_parameters()):
            p.copy_(q + noise * q.std() * torch.randn(q.shape, generator=gen))
    clone.save_pretrained(path)


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])  # every position attended: without a mask transformers masks pad_token_id's (0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def top2(model: LlamaForCausalLM, tokens: list[int], adjust=None) -> tuple[float, float]:
    """The target's (fp32) top logit and its gap to the second at the next position; adjust(tokens,
    logits) -> logits first, when the request changes the distribution (penalties)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1]
    if adjust is not None:
        logits = adjust(tokens, logits)
    top = logits.topk(2).values
    return float(top[0]), float(top[0] - top[1])


def assert_greedy_equal(got: list[int], want: list[int], prompt: list[int], model: LlamaForCausalLM,
                        rel_tie: float = 0.0, adjust=None) -> None:
    """Token-identical, except a divergence at a genuine near-tie of the target's top two logits: a gap
    under NEAR_TIE + rel_tie * |top logit| (rel_tie: the rounding of a lower-precision dtype; adjust:
    as top2's)."""
    assert len(got) == len(want), (got, want)
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top, gap = top2(model, prompt + want[:i], adjust)
            tie = NEAR_TIE + rel_tie * abs(top)
            assert gap < tie, f"greedy divergence at token {i} ({a} != {b}) with top-2 gap {gap:.2e} (tie < {tie:.2e})"
            return


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: transformers' log_softmax at each output position, teacher-forced."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1]


def check_logprobs(model, prompt: list[int], out, top: int) -> None:
    """out.logprobs: per token, the chosen token's raw log-probability first, then the top `top` (vLLM's
    Logprob objects, as RequestOutput carries them)."""
    want = reference_logprobs(model, prompt, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert next(iter(entry)) == token  # the chosen token comes first
        assert abs(entry[token].logprob - float(want[i, token])) < 1e-4
        assert within_rank(want[i], token, entry[token].rank)
        top_ids = want[i].topk(top).indices.tolist()
        assert set(top_ids) <= set(entry) and len(entry) <= top + 1
        for t in top_ids:
            assert abs(entry[t].logprob - float(want[i, t])) < 1e-4


def within_rank(row: torch.Tensor, token: int, rank: int, tol: float = 1e-4) -> bool:
    """vLLM's rank of a token (how many are at least as likely), up to tokens within tol of it."""
    return int((row > row[token] + tol).sum()) + 1 <= rank <= int((row >= row[token] - tol).sum())


PROMPTS = [[5, 9, 2, 7, 11, 3], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [17]]


def close_pair(root) -> dict:
    """A 2-layer target and a draft close to it (good acceptance), as the exactness tests use them."""
    torch.set_num_threads(1)
    target = save_model(root / "target", llama_config(96, 64, 2), seed=0)
    save_perturbed(root / "close_draft", target, seed=1, noise=0.15)
    return {"target": str(root / "target"), "close": str(root / "close_draft"), "model": target}


class CyclingGate:
    """A tree gate on a fixed cycle trees, trees, just-in-time (then n-gram rounds, where the engine offers
    them): every transition (a tree asked for after a round without one, a tree looked up in a round that
    asks for none, drafts after n-gram proposals) happens every few rounds."""

    def __init__(self, modes=None):
        from saguaro_dist.spec.tree_gate import RoundMode
        self.cycle, self.rounds = [RoundMode.TREES, RoundMode.TREES, RoundMode.JUST_IN_TIME], 0
        if modes and RoundMode.FAST in modes:
            self.cycle.append(RoundMode.FAST)

    def mode(self, batch_size: int, sampled: bool = False, fast_estimate: float | None = None):
        self.rounds += 1
        return self.cycle[self.rounds % len(self.cycle)]

    def record(self, *args) -> None:
        pass

    def draft_tokens_per_row(self, batch_size: int, sampled: bool = False) -> float | None:
        return None  # unmeasured: no row takes its n-gram proposal over the draft's


class LookupFavouringGate(CyclingGate):
    """Trees every round (JustInTimeLookupGate: SD's rounds), the draft's rows measured to gain nothing:
    every row whose n-gram proposals were scored takes its n-gram proposal over the draft's
    (spec/lookup_pick.py)."""
    round_mode = "trees"

    def __init__(self, modes=None):
        from saguaro_dist.spec.tree_gate import RoundMode
        self.cycle, self.rounds = [RoundMode(self.round_mode)], 0

    def draft_tokens_per_row(self, batch_size: int, sampled: bool = False) -> float | None:
        return 0.0


class JustInTimeLookupGate(LookupFavouringGate):
    round_mode = "just_in_time"


def every_lookup_length(chosen: list):
    """A LookupLengths.choose that takes the candidate lengths in turn, the longest first (of those the rows
    have room for), whatever was measured, so that rounds of n-gram proposals alone run at every length;
    `chosen` collects them."""
    def choose(self, keys, room):
        fits = [n for n in self.lengths if n <= room] or [1]
        chosen.append(fits[-1 - len(chosen) % len(fits)])
        return chosen[-1]
    return choose


def trusting_picker():
    """A LookupPicker that expects every n-gram proposal to gain a token before any was scored: rows take
    their n-gram proposals from the first round that offers them (with a LookupFavouringGate)."""
    from saguaro_dist.spec.lookup_pick import LookupPicker

    class TrustingPicker(LookupPicker):
        def expected(self, key):
            return 1.0
    return TrustingPicker


PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.4)


class OutputPenalties:
    """transformers has no presence / frequency penalty: vLLM's, as a logits processor (tokens after
    the prompt only), written here independently of saguaro_dist.spec."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for t in set(ids):
                scores[row, t] -= self.frequency * ids.count(t) + self.presence
        return scores


def penalized_reference(model: LlamaForCausalLM, prompt: list[int], n: int) -> tuple[list[int], callable]:
    """transformers' greedy tokens under PENALTIES, and the same penalties as an `adjust` for near-ties."""
    output_penalties = OutputPenalties(len(prompt), PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"])
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None, repetition_penalty=PENALTIES["repetition_penalty"],
                         logits_processor=LogitsProcessorList([output_penalties]))
    repetition = RepetitionPenaltyLogitsProcessor(PENALTIES["repetition_penalty"])

    def adjust(tokens, logits):
        ids = torch.tensor([tokens])
        return output_penalties(ids, repetition(ids, logits[None].clone()))[0]
    return out[0, len(prompt):].tolist(), adjust


# vocabulary 96: a third of the tokens allowed, a few pushed up or down
BIAS = dict(logit_bias={4: 3.0, 12: 2.0, 30: -100.0, 33: 1.5}, allowed_token_ids=tuple(range(0, 96, 3)) + (4,))


class TokenBias:
    """OpenAI's logit_bias and vLLM's allowed_token_ids as a transformers logits processor, written here
    independently of saguaro_dist.spec."""

    def __init__(self, logit_bias: dict[int, float], allowed_token_ids):
        self.logit_bias, self.allowed = logit_bias, set(allowed_token_ids)

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, b in self.logit_bias.items():
            scores[:, t] += b
        scores[:, [t for t in range(scores.shape[1]) if t not in self.allowed]] = float("-inf")
        return scores


def biased_reference(model: LlamaForCausalLM, prompt: list[int], n: int, penalties: bool = False):
    """transformers' greedy tokens under BIAS (then PENALTIES, in vLLM's order, if asked), and the same
    processors as an `adjust` for near-ties."""
    processors = [TokenBias(**BIAS)]
    if penalties:
        processors += [RepetitionPenaltyLogitsProcessor(PENALTIES["repetition_penalty"]),
                       OutputPenalties(len(prompt), PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"])]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList(processors))

    def adjust(tokens, logits):
        ids, scores = torch.tensor([tokens]), logits[None].clone()
        for p in processors:
            scores = p(ids, scores)
        return scores[0]
    return out[0, len(prompt):].tolist(), adjust


class Terminal(io.StringIO):
    """stderr as a terminal would be: tqdm's progress bars (disable=None) show only where isatty() holds."""

    def isatty(self) -> bool:
        return True


def wait_for(condition, within_s: float = 15.0) -> None:
    """Poll `condition` until it holds; fail the test if it does not within `within_s`."""
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition(), "timed out"


def port_closed(address: str, within_s: float = 10.0) -> bool:
    """Whether nothing listens at host:port any more, polled for up to `within_s`."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) != 0:
                return True
        time.sleep(0.2)
    return False


def self_drafting_target(path, vocab: int) -> str:
    """A one-layer target with a tiny word-level tokenizer, sharp enough to be its own draft (acceptance ~1
    where the draft knows the request's constraints): tests/test_draft_bad_words.py, test_draft_min_tokens.py."""
    from test_engine_sampling import save_tiny_tokenizer
    save_model(path, llama_config(vocab, 32, 1), seed=3, sharpen=2.0)
    save_tiny_tokenizer(path)
    return str(path)


def self_drafted(target: str, prompts: list[list[int]], params, k: int, **kwargs):
    """generate with the target as its own draft (mode "ar": none), the neural backup, no n-gram rounds."""
    from saguaro_dist import LLM
    draft = None if kwargs.get("mode") == "ar" else target
    with LLM(model=target, draft=draft, k=k, fallback="neural", ngram_rounds=False, **kwargs) as llm:
        return llm.generate(prompt_token_ids=prompts, sampling_params=params)
