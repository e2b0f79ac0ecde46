"""The benched systems behind one surface: open(placement) once, run(prompts, ...) per grid cell, close()."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from saguaro_dist.bench.affinity import draft_children, on_host_cpus, pin_process, pin_system, unpin
from saguaro_dist.bench.config import SYSTEM_SETTINGS, Placement
from saguaro_dist.config import DRAFT_MODES, Mode

log = logging.getLogger(__name__)
ENGINE_FIELDS = ("rounds", "verify_s", "draft_wait_s", "prefill_s", "step_s", "coordination_s", "cache_hits", "cache_misses",
                 "just_in_time_rounds", "jit_rounds", "jit_round_tokens", "tree_build_s", "tree_builds", "cohort_rounds",
                 "fast_rounds", "fast_round_tokens", "lookup_rows",
                 "lookup_rounds", "lookup_round_tokens")


@dataclass
class Measurement:
    """One timed generate call over a batch of prompts."""
    tokens: int                       # generated tokens, all prompts
    seconds: float
    outputs: list[list[int]]
    seq_rounds: int = 0               # verification rounds summed over sequences
    drafted: int = 0
    accepted: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    fallbacks: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)   # EngineMetrics delta of this call (ours only)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Repeats:
    """One system's timed passes over a cell's prompts: the fastest is the cell's figure; every pass's
    tokens/s is kept, in repeat order, to pair with other systems' (bench/paired.py)."""
    best: Measurement
    tokens_per_s: list[float]

    @classmethod
    def of(cls, runs: list[Measurement]) -> "Repeats":
        return cls(max(runs, key=lambda m: m.tokens_per_s), [m.tokens_per_s for m in runs])


def combine(parts: list[Measurement]) -> Measurement:
    """One Measurement for generate calls run one after another (a cell's batches): counts and seconds add up."""
    total = Measurement(tokens=0, seconds=0.0, outputs=[])
    for m in parts:
        for name in ("tokens", "seconds", "seq_rounds", "drafted", "accepted", "cache_hits", "cache_misses"):
            setattr(total, name, getattr(total, name) + getattr(m, name))
        total.outputs += m.outputs
        total.fallbacks = _add(total.fallbacks, m.fallbacks)
        total.engine = _add(total.engine, m.engine)
    return total


def _add(a: dict, b: dict) -> dict:
    """Key-wise sum of two (nested) dicts of numbers; a key in one only keeps its value."""
    return {k: _add(a.get(k, {}), b.get(k, {})) if isinstance(a.get(k, b.get(k)), dict) else a.get(k, 0) + b.get(k, 0)
            for k in a.keys() | b.keys()}


def sampling_kwargs(temperature: float) -> dict:
    """transformers: plain sampling at `temperature` (no default top-k), greedy at 0."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


class OursSystem:
    """saguaro_dist.LLM in one mode, one-host or on local Ray."""

    def __init__(self, name: str, target: str, draft: str, engine_kwargs: dict):
        self.name, self.target, self.draft, self.engine_kwargs = name, target, draft, engine_kwargs
        self.llm, self.place, self.bench_cpus = None, None, ()

    def open(self, place: Placement) -> None:
        from saguaro_dist import LLM
        on_host_cpus(place.pinning)  # not the CPUs of a system opened before (--interleave, serving): Ray inherits them
        self.place, children = place, draft_children()
        mode = "ssd" if self.name.startswith("ssd") else self.name.removesuffix("-k")
        # ssd (and its variants) run the engine's own default executor (engine/build.py: draft_executor): split
        # on the CPU, a thread on the target's GPU, a process with the draft on a GPU of its own; the others name theirs.
        executor = {"sd": "thread", "ssd-split": "split", "ssd-process": "process", "ssd-thread": "thread",
                    "ssd-ray-process": "process"}.get(self.name, "auto")
        # Every repeat runs the same prompts: a prefix cache would skip our systems' prefills from the
        # second on (not transformers'), so it is off here, as in the runs before it existed.
        kwargs = {"enable_prefix_caching": False, **self.engine_kwargs, **SYSTEM_SETTINGS.get(self.name, {})}
        self.llm = LLM(model=self.target, draft=self.draft if Mode(mode) in DRAFT_MODES else None, mode=mode, draft_executor=executor,
                       cluster="local" if self.name.startswith("ssd-ray") else None, target_threads=place.target_threads,
                       draft_threads=place.draft_threads, **kwargs)
        self.threads = place.target_threads
        self.bench_cpus, self.pinned = pin_system(place.pinning, draft_children() - children)  # its own children

    def run(self, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int) -> Measurement:
        from saguaro_dist import SamplingParams
        params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, ignore_eos=True, seed=seed + i)
                  for i in range(len(prompts))]
        torch.set_num_threads(self.threads)  # process-wide: other systems open beside this one may differ
        repin(self.bench_cpus)
        before = self.llm.metrics.to_dict()
        start = time.perf_counter()
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        after = self.llm.metrics.to_dict()
        return measurement_from_outputs(outs, seconds, engine_delta(before, after))

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        if self.place is not None:  # the next system starts from the bench's own CPUs, not this one's pins
            unpin(self.place.pinning)


def repin(cpus: tuple[int, ...]) -> None:
    """This system's pins again before its pass: a system open beside it (--interleave) may have moved them."""
    if cpus:
        pin_process(os.getpid(), cpus)


def engine_delta(before: dict, after: dict) -> dict:
    delta = {k: after[k] - before[k] for k in ENGINE_FIELDS}
    delta["fallbacks"] = {k: v - before["fallbacks"].get(k, 0) for k, v in after["fallbacks"].items()}
    return delta


def measurement_from_outputs(outs, seconds: float, engine: dict) -> Measurement:
    m = Measurement(tokens=sum(len(o.token_ids) for o in outs), seconds=seconds,
                    outputs=[list(o.token_ids) for o in outs], engine=engine)
    for o in outs:
        r = o.metrics
        m.seq_rounds += r.rounds
        m.drafted += r.drafted_tokens
        m.accepted += r.accepted_tokens
        m.cache_hits += r.cache_hits
        m.cache_misses += r.cache_misses
        for kind, n in r.fallbacks.items():
            m.fallbacks[kind] = m.fallbacks.get(kind, 0) + n
    return m


GENERATION_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def neutral_generation(model):
    """The model with a generation config that holds its special token ids only. generate() fills every
    setting its call leaves unset from model.generation_config, so a checkpoint's sampling defaults
    (Qwen2.5's repetition_penalty 1.05, top_k 20; no_repeat_ngram_size, min_p, typical_p...) would apply
    to transformers' runs, greedy ones too, and not to ours, which the bench gives plain SamplingParams:
    two different samplers, and greedy outputs that depart from our ar's."""
    from transformers import GenerationConfig
    old = model.generation_config
    model.generation_config = GenerationConfig(**{k: getattr(old, k) for k in GENERATION_TOKEN_IDS
                                                  if getattr(old, k, None) is not None})
    return model


class HFSystem:
    """transformers generate on the same checkpoints, device and dtype as ours; assisted = with assistant_model=."""

    def __init__(self, name: str, target: str, draft: str, k: int, device: str = "cpu", dtype: str = "float32"):
        self.name, self.target_path, self.draft_path, self.k = name, target, draft, k
        self.device, self.dtype = device, getattr(torch, dtype)
        self.model = self.assistant = self.place = None
        self.bench_cpus = ()

    def open(self, place: Placement) -> None:
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(place.target_threads)
        self.threads, self.place = place.target_threads, place
        self.bench_cpus, self.pinned = pin_system(place.pinning, set())
        load = lambda p: neutral_generation(AutoModelForCausalLM.from_pretrained(p, dtype=self.dtype).to(self.device).eval())  # noqa: E731
        self.model = load(self.target_path)
        if self.name == "hf-assisted":
            self.assistant = load(self.draft_path)
            # Fixed-K drafts, as ours: transformers' defaults stop a draft once the assistant's top probability
            # falls under 0.4 (assistant_confidence_threshold), ~1 token a round on the demo pair, not K.
            self.assistant.generation_config.update(num_assistant_tokens=self.k, num_assistant_tokens_schedule="constant",
                                                    assistant_confidence_threshold=0.0)

    def run(self, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int) -> Measurement:
        torch.set_num_threads(self.threads)
        repin(self.bench_cpus)
        start = time.perf_counter()
        if self.assistant is None:  # one batched call (prompts share one length: no padding)
            outputs = self._generate(prompts, temperature, max_new_tokens, seed)
        else:  # transformers' assisted generation takes one sequence at a time
            outputs = [self._generate([p], temperature, max_new_tokens, seed + i)[0] for i, p in enumerate(prompts)]
        seconds = time.perf_counter() - start
        return Measurement(tokens=sum(map(len, outputs)), seconds=seconds, outputs=outputs)

    def _generate(self, prompts, temperature, max_new_tokens, seed) -> list[list[int]]:
        torch.manual_seed(seed)
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        # eos_token_id=None: EOS neither stops nor is masked, as ours runs with ignore_eos. min_new_tokens (what this
        # once passed) masks EOS's logit: another distribution, and a greedy row departed from ar's where EOS led.
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      eos_token_id=None, pad_token_id=0, **sampling_kwargs(temperature), **extra)
        return out[:, ids.shape[1]:].tolist()

    def close(self) -> None:
        self.model = self.assistant = None
        if self.place is not None:
            unpin(self.place.pinning)


def make_system(name: str, target: str, draft: str, engine_kwargs: dict):
    if name.startswith("hf"):
        return HFSystem(name, target, draft, engine_kwargs["k"], engine_kwargs["device"], engine_kwargs["dtype"])
    return OursSystem(name, target, draft, engine_kwargs)
