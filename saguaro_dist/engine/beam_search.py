"""vLLM's beam search (vllm/entrypoints/generate/beam_search/: offline.py over LLM.generate, online.py over the
async engine), built the same way: each step every live beam is extended by one generate(max_tokens=1,
logprobs=2 * beam_width) call, every returned candidate becomes a beam, one ended by the tokenizer's EOS is
complete, and the beam_width best of the rest (by vLLM's length-penalised score) go on. At the end the completed
and live beams are ranked together. BeamRule is what both drivers share (run_beam_search here, LLM.beam_search's;
serve/beam_route.py the server's). BeamSearchParams is vLLM's (vllm.sampling_params), checked here at the edge."""
from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum

from tqdm import tqdm

from saguaro_dist.engine.logprob_objects import Logprob
from saguaro_dist.plain_numbers import plain_flag, plain_number
from saguaro_dist.sampling_params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a step asks generate for 2 * beam_width logprobs


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: beam_width beams, each grown up to max_tokens tokens. temperature: the step's sampling (0: greedy;
    the candidates are the top 2 * beam_width of the raw distribution either way); length_penalty: a beam's
    score is cum_logprob / len(tokens) ** length_penalty (any finite value: see beam_rank).
    include_stop_str_in_output is accepted and, as in vLLM's offline beam search, unused (it has no stop
    strings). structured_outputs: vLLM's constrained search, not supported here: only None is accepted."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: object | None = None

    def __post_init__(self):
        for name in ("beam_width", "max_tokens", "temperature", "length_penalty"):  # np.int64, np.float32, 0-d tensors
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            object.__setattr__(self, name, plain_flag(getattr(self, name)))
        check_int("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        check_int("max_tokens", self.max_tokens, 1, None)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"BeamSearchParams.{name} must be True or False, got {getattr(self, name)!r}")
        check_number("temperature", self.temperature, least=0.0)
        check_number("length_penalty", self.length_penalty, least=None)
        if self.structured_outputs is not None:
            raise ValueError("BeamSearchParams.structured_outputs is not supported (beam search here is unconstrained); "
                             f"leave it None, got {self.structured_outputs!r}")


def check_int(name: str, value, least: int, most: int | None) -> None:
    if type(value) is not int or value < least or (most is not None and value > most):
        span = f"{least}..{most}" if most is not None else f">= {least}"
        raise ValueError(f"BeamSearchParams.{name} must be an integer {span}, got {value!r}")


def check_number(name: str, value, least: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            least is not None and value < least):
        raise ValueError(f"BeamSearchParams.{name} must be a finite number{'' if least is None else f' >= {least}'}, "
                         f"got {value!r}")


@dataclass
class BeamSearchSequence:
    """vLLM's: one beam. tokens: the prompt's then the beam's; logprobs: per beam token, the step's whole
    {token id: Logprob} entry; text: set on the returned beams (tokens decoded, prompt included, as vLLM's).
    finish_reason: "stop" (ended by EOS) or "length" (max_tokens, or the context's end); stop_reason None."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best beams, at most beam_width, the best first."""
    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    """vLLM's: one prompt's search: the live beams and the completed ones."""
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)

    @classmethod
    def of_prompt(cls, prompt_token_ids: list[int]) -> BeamSearchInstance:
        return cls([BeamSearchSequence(list(prompt_token_ids))])


EosIds = int | Collection[int] | None


def is_eos(token: int, eos_token_id: EosIds) -> bool:
    if eos_token_id is None:
        return False
    return token == eos_token_id if isinstance(eos_token_id, int) else token in eos_token_id


def scored_length(tokens: list[int], eos_token_id: EosIds) -> int:
    """The length the score divides by: the prompt counted, a final EOS not (a lone EOS counts 1, not 0)."""
    return max(len(tokens) - (1 if is_eos(tokens[-1], eos_token_id) else 0), 1)


def log_magnitude(cumulative_logprob: float, seq_len: int, length_penalty: float) -> float:
    """log |cum_logprob / seq_len ** length_penalty|, without forming the power (finite for a finite cum != 0)."""
    return math.log(abs(cumulative_logprob)) - length_penalty * math.log(seq_len)


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: EosIds,
                          length_penalty: float = 1.0) -> float:
    """vLLM's (after transformers'): cum_logprob / len ** length_penalty, the length counting the prompt and
    leaving out a final EOS. eos_token_id: one id (beam_eos), or a collection of ids. Where len ** length_penalty
    leaves float's normal range (a large |length_penalty|: vLLM's overflow or division by zero) the quotient is
    taken in log space instead, rounded to 0 or inf only where the true value itself is past float's range."""
    seq_len = scored_length(tokens, eos_token_id)
    try:
        divisor = float(seq_len) ** float(length_penalty)
    except OverflowError:
        divisor = math.inf
    if sys.float_info.min <= divisor < math.inf:  # vLLM's quotient
        return cumulative_logprob / divisor
    if cumulative_logprob == 0 or math.isinf(cumulative_logprob):  # (whatever they are divided by)
        return cumulative_logprob
    try:
        magnitude = math.exp(log_magnitude(cumulative_logprob, seq_len, length_penalty))
    except OverflowError:
        magnitude = math.inf
    return math.copysign(magnitude, cumulative_logprob)


def beam_rank(tokens: list[int], cumulative_logprob: float, eos_token_id: EosIds,
              length_penalty: float) -> tuple[float, float, float]:
    """The search's sort key: vLLM's score first, so ordinary scores rank (and tie) exactly as vLLM's. A score
    rounded to 0 or inf (a true value past float's range, as a large |length_penalty| gives) ties with its kind;
    those are told apart by the true values' order (sign, then log magnitude), so every finite
    length_penalty ranks the beams as the formula does."""
    score = get_beam_search_score(tokens, cumulative_logprob, eos_token_id, length_penalty)
    if cumulative_logprob == 0 or (score != 0 and not math.isinf(score)):
        return score, 0.0, 0.0
    sign = math.copysign(1.0, cumulative_logprob)
    return score, sign, sign * log_magnitude(cumulative_logprob, scored_length(tokens, eos_token_id), length_penalty)


def create_sort_beams_key_function(eos_token_id: EosIds, length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)


def cum_logprob_of(beam: BeamSearchSequence) -> float:
    return beam.cum_logprob


def entry_logprob(value) -> float:
    """A logprobs entry's value: a Logprob (LLM.generate's) or a plain log p (the engine's stream, the server's)."""
    return value.logprob if isinstance(value, Logprob) else value


def extended(beam: BeamSearchSequence, entry: dict) -> list[BeamSearchSequence]:
    """Every candidate of one step's logprobs entry (the chosen token and the top 2 * beam_width) as a beam."""
    return [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], beam.cum_logprob + entry_logprob(lp))
            for token, lp in entry.items()]


def advance(instance: BeamSearchInstance, candidates: list[BeamSearchSequence], ends: EosIds, beam_width: int,
            key: Callable[[BeamSearchSequence], float]) -> None:
    """vLLM's selection: a candidate ending in EOS (ends: None under ignore_eos) is complete ("stop"); the
    beam_width best of the others are the live beams (a stable sort: ties keep the candidates' order)."""
    live = []
    for beam in candidates:
        if is_eos(beam.tokens[-1], ends):
            beam.finish_reason = "stop"
            instance.completed.append(beam)
        else:
            live.append(beam)
    instance.beams = sorted(live, key=key, reverse=True)[:beam_width]


def retire_full(instance: BeamSearchInstance, max_model_len: int) -> None:
    """Beams with no room left in the context are complete ("length"): vLLM's generate refused them mid-search."""
    full = [b for b in instance.beams if len(b.tokens) >= max_model_len]
    for beam in full:
        beam.finish_reason = "length"
    instance.completed += full
    instance.beams = [b for b in instance.beams if len(b.tokens) < max_model_len]


def best_beams(instance: BeamSearchInstance, beam_width: int,
               key: Callable[[BeamSearchSequence], float]) -> list[BeamSearchSequence]:
    """The beam_width best of the completed and the still-live beams (these ended at max_tokens: "length")."""
    for beam in instance.beams:
        beam.finish_reason = "length"
    return sorted(instance.completed + instance.beams, key=key, reverse=True)[:beam_width]


def beam_eos(tokenizer) -> int | None:
    """The one id that completes a beam: the tokenizer's eos_token_id, as current vLLM's searches (offline and
    served) read it, not every EOS id of the generation config; None without a tokenizer (no beam ends on EOS)."""
    return None if tokenizer is None else tokenizer.eos_token_id


class LiveRanking(Enum):
    """Which live candidates go on each step, as vLLM's two searches pick them (the final ranking is the
    length-penalised score in both): offline (LLM.beam_search) by that score, served (vLLM's online search)
    by the cumulative log-probability. They differ only where candidates differ in length: an EOS candidate
    kept live under ignore_eos, whose score leaves the EOS out of the length."""
    SCORE = "score"
    CUM_LOGPROB = "cum_logprob"


@dataclass(frozen=True)
class BeamRule:
    """One search's rules, the part the offline (LLM.generate) and the served (async engine) drivers share:
    the step's sampling, how a step's logprobs entries grow the beams, and the final ranking."""
    params: BeamSearchParams
    eos_token_id: int | None
    max_model_len: int
    live_ranking: LiveRanking = LiveRanking.SCORE

    @property
    def key(self) -> Callable[[BeamSearchSequence], tuple]:
        return lambda beam: beam_rank(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def step_params(self) -> SamplingParams:
        """One token per live beam, with the top 2 * beam_width candidates (transformers', vLLM's)."""
        return SamplingParams(logprobs=2 * self.params.beam_width, max_tokens=1, temperature=self.params.temperature)

    def step(self, instance: BeamSearchInstance, entries: list[dict]) -> None:
        """Grow the instance's live beams by their step entries (one each, in the beams' order)."""
        candidates = [c for beam, entry in zip(instance.beams, entries, strict=True) for c in extended(beam, entry)]
        ends = None if self.params.ignore_eos else self.eos_token_id
        live_key = self.key if self.live_ranking is LiveRanking.SCORE else cum_logprob_of
        advance(instance, candidates, ends, self.params.beam_width, live_key)
        retire_full(instance, self.max_model_len)

    def best(self, instance: BeamSearchInstance) -> list[BeamSearchSequence]:
        return best_beams(instance, self.params.beam_width, self.key)


def run_beam_search(llm, prompt_ids: list[list[int]], params: BeamSearchParams,
                    salts: list[str | None] | None = None, loras: list | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """The search over llm.generate, as vLLM's LLM.beam_search batches it: the prompts searched
    concurrency_limit at a time (None: all at once), each group to its end before the next starts. salts: each
    prompt's cache_salt (None: none), loras: each prompt's LoRARequest (None: the base model), which every step
    of its beams carries. use_tqdm: a bar over each group's token steps (an upper bound: beams may all end
    sooner; shown only on a terminal, as generate's), off with a concurrency_limit, as vLLM's."""
    if concurrency_limit is not None and (type(concurrency_limit) is not int or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}")
    if use_tqdm and concurrency_limit is not None:
        log.warning("beam_search: the progress bar is off with a concurrency_limit (as vLLM's)")
        use_tqdm = False
    size = concurrency_limit or max(len(prompt_ids), 1)
    salts, loras = salts or [None] * len(prompt_ids), loras or [None] * len(prompt_ids)
    return [out for start in range(0, len(prompt_ids), size)
            for out in search_group(llm, prompt_ids[start:start + size], params, salts[start:start + size],
                                    loras[start:start + size], use_tqdm)]


def search_group(llm, prompt_ids: list[list[int]], params: BeamSearchParams, salts: list[str | None], loras: list,
                 use_tqdm: bool) -> list[BeamSearchOutput]:
    """One group's search, every prompt's beams in one generate batch a step."""
    rule = BeamRule(params, beam_eos(llm.tokenizer), llm.max_model_len)
    instances = [BeamSearchInstance.of_prompt(ids) for ids in prompt_ids]
    with tqdm(total=params.max_tokens, desc="Beam search", unit="token", disable=None if use_tqdm else True) as bar:
        for _ in range(params.max_tokens):
            if not search_step(llm, rule, instances, salts, loras):
                break
            bar.update()
    return [BeamSearchOutput(finished_texts(rule.best(i), llm.tokenizer)) for i in instances]


def search_step(llm, rule: BeamRule, instances: list[BeamSearchInstance], salts: list, loras: list) -> bool:
    """One token for every live beam of every instance, in one generate batch; False when none was live."""
    live = [step_prompt(beam, salt) for instance, salt in zip(instances, salts) for beam in instance.beams]
    adapters = [lora for instance, lora in zip(instances, loras) for _ in instance.beams]
    if not live:
        return False
    # (a prompt with no room is refused here by generate, as vLLM's search refuses it; grown beams that
    # fill the context are retired by the rule before they reach it)
    outs = iter(llm.generate(live, sampling_params=rule.step_params(), use_tqdm=False,
                             lora_request=adapters if any(adapters) else None))
    for instance in instances:
        rule.step(instance, [next(outs).outputs[0].logprobs[0] for _ in instance.beams])
    return True


def step_prompt(beam: BeamSearchSequence, salt: str | None) -> dict:
    """A beam's one-token step as a vLLM TokensPrompt dict, with its prompt's cache_salt if it has one."""
    return {"prompt_token_ids": beam.tokens} if salt is None else {"prompt_token_ids": beam.tokens, "cache_salt": salt}


def finished_texts(beams: list[BeamSearchSequence], tokenizer) -> list[BeamSearchSequence]:
    """The returned beams' text: all their tokens decoded, as vLLM's (None without a tokenizer)."""
    for beam in beams:
        beam.text = None if tokenizer is None else tokenizer.decode(beam.tokens)
    return beams
