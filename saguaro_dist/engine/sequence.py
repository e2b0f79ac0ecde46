"""A request's state inside the engine."""
from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field

import torch

from saguaro_dist.engine.detokenizer import DecodeState
from saguaro_dist.engine.messages import DraftSampling, Proposal
from saguaro_dist.engine.metrics import RequestMetrics
from saguaro_dist.engine.structured import GrammarState, grammar_of
from saguaro_dist.lora_request import LoRARequest
from saguaro_dist.sampling_params import SamplingParams
from saguaro_dist.spec.min_tokens import draft_end_ids
from saguaro_dist.spec.stats import ProposalSource


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # holds a batch slot; a long prompt runs part by part between rounds
    RUNNING = "running"
    FINISHED = "finished"


class OutputKind(str, enum.Enum):
    """What the caller reads while a request runs (vLLM's RequestOutputKind, in the two kinds we serve)."""
    DELTA = "delta"            # text deltas every round (streams)
    FINAL_ONLY = "final_only"  # the result at the end (generate): text is decoded once, when it finishes


class FinishReason(str, enum.Enum):
    STOP = "stop"      # eos or a stop string
    LENGTH = "length"  # max_tokens
    ABORT = "abort"    # cancelled by the caller


def make_generator(seed: int | None, salt: int) -> torch.Generator:
    """Per-request randomness: seeded requests reproduce; the salt keeps target and draft streams independent.
    An unseeded request draws its seed from the OS, not torch.seed(): that reseeded the process's global
    torch RNG (the user's own) at every request, and cost ~180 us against ~2."""
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + salt) % (2**63) if seed is not None else secrets.randbits(63))
    return gen


# Index bits of substreams apart from a tree's (index = the sequence's length when it is built): coupled bonus
# draws' candidates on the draft side, the target's uniforms for them (spec/coupled.py), and just-in-time drafts.
# Every set is keyed by the sequence's length, which grows every round and which every worker holding the
# sequence agrees on: never by a call count or a round number, which two workers (the split draft's halves) or
# a re-prefill (after a worker died: round 0 again) would repeat, proposing from numbers that already shaped
# the output (not distributed as q given the text: inexact).
CANDIDATE_STREAM = 1 << 62
COUPLING_STREAM = 1 << 61
DRAFT_STREAM = 1 << 60


def substream(generator: torch.Generator, index: int) -> torch.Generator:
    """A generator for draw set `index` of `generator`'s stream (a round's, say), seeded from its seed and
    `index` alone: how many numbers the stream or other sets drew, or whether a set was cut short, changes
    none of its draws. splitmix64 mixes the two, so that sets next to each other are unrelated (numpy's
    SeedSequence would too, at 23 us a call against 1: one per sequence per tree build)."""
    return torch.Generator().manual_seed(substream_seed(generator, index))


def substream_seed(generator: torch.Generator, index: int) -> int:
    """The seed of substream(generator, index): a caller drawing many sets at once reseeds one generator."""
    return _splitmix64(generator.initial_seed() ^ _splitmix64(index)) % 2**63


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_MASK64 = (1 << 64) - 1


def engine_request_seed(engine_seed: int, arrival: int) -> int:
    """The seed of an unseeded request under Config.seed (vLLM's engine seed): mixed from the engine's seed and
    the request's arrival number, so that one submission order reproduces while no two requests share a stream
    (nor seed + i of another's samples). In [0, 2**62): a seed SamplingParams takes, with room for + i."""
    return _splitmix64(_splitmix64(engine_seed & _MASK64) ^ arrival) >> 2


MAX_CACHE_SALT_CHARS = 128  # vLLM's validate_cache_salt (entrypoints/generate/base/protocol.py)
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: object, param: str = "cache_salt") -> str | None:
    """vLLM's rule for a request's cache_salt: None, or a non-empty string of at most 128 characters without
    '@', '/', '\\' or NUL. Raises ValueError naming `param`."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"{param} must be a non-empty string if provided, got {salt!r}")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise ValueError(f"{param} must be at most {MAX_CACHE_SALT_CHARS} characters and must not contain "
                         f"'@', '/', '\\' or NUL")
    return salt


def cache_namespace(cache_salt: str | None = None, lora_int_id: int | None = None) -> tuple | None:
    """The prefix-cache namespace of a request's KV (model/prefix_cache.py): only requests with the same one
    share prefixes. None (no salt, the base model): the shared namespace. The one place that says what sets it
    apart: the salt, and for the target's KV the LoRA adapter it ran through (the draft's KV is the base model's,
    whatever the adapter: the draft passes the salt alone)."""
    parts = (cache_salt,) if lora_int_id is None else (cache_salt, lora_int_id)
    return None if all(p is None for p in parts) else parts


def namespace_lora_id(namespace) -> int | None:
    """The adapter a cache_namespace names (None: the base model's KV)."""
    return namespace[1] if isinstance(namespace, tuple) and len(namespace) == 2 else None


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind = OutputKind.DELTA
    stream_interval_s: float = 0.0         # DELTA: rounds closer than this share one update, once text went out
    priority: int = 0                      # scheduling_policy "priority": lower is admitted first (vLLM's)
    cache_salt: str | None = None          # vLLM's: prefix-cache KV is shared only with requests of the same salt
    lora_request: LoRARequest | None = None  # the target runs it through this adapter (None: the base model)
    status: SeqStatus = SeqStatus.WAITING
    prefilled: int = 0                     # prompt tokens already in the target's KV
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # one per output token if params.logprobs is set
    round_logprobs: list[dict[int, float]] = field(default_factory=list)   # the target's, for the tokens it just decided
    prompt_logprobs: list[dict[int, float] | None] | None = None          # if params.prompt_logprobs: None first
    text: str = ""                         # detokenized output, stop strings cut
    stop_after: int = 0                    # text[:stop_after] came from the first min_tokens tokens: no stop string ends there
    decode_state: DecodeState = field(default_factory=DecodeState)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None   # vLLM's: the stop_token_id or stop string that ended it; None: EOS, length
    round: int = 0
    speculation: Proposal | None = None    # what the target verifies this round
    speculation_kind: ProposalSource = ProposalSource.NEURAL  # where this round's speculation came from
    last_outcome: tuple[int, int] = (0, 0) # (k accepted, bonus token) of the last verification
    draft_lost: bool = False               # its draft worker died: re-prefill it on a live one
    beyond_draft: bool = False             # it outgrew the draft's context: the fast backup speculates to its end
    wants_tree: bool = False               # SSD: the draft was asked for a tree for this speculation
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    arrival_time: float = field(default_factory=time.perf_counter)
    last_update_time: float = 0.0          # when its reader last got an update
    generator: torch.Generator | None = None
    logit_bias_row: torch.Tensor | None = None  # [V]: params' logit bias and allowed tokens, built at first use
    prompt_mask_row: torch.Tensor | None = None  # [V] bool: the token is in the prompt (penalties), built at first use
    grammar: GrammarState | None = None    # structured outputs: the matcher, advanced by the committed tokens
    error: Exception | None = None         # this request failed alone (its grammar could not be followed): its caller's error

    def __post_init__(self):
        self.generator = make_generator(self.params.seed, salt=1)
        if self.decode_state == DecodeState():  # the first output tokens are decoded after the prompt's end (vLLM's)
            self.decode_state = DecodeState.after_prompt(self.prompt_token_ids)
        self.metrics.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token(self) -> int:
        """tokens[-1], without building `tokens` (a list as long as the sequence, per row a round)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def cache_namespace(self) -> tuple | None:
        """The target's: its salt and its adapter."""
        return cache_namespace(self.cache_salt, None if self.lora_request is None else self.lora_request.lora_int_id)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def draft_sampling(self, eos_token_ids: frozenset[int] = frozenset(), vocab_size: int = 0) -> DraftSampling:
        """What the draft is told of this request's sampling; eos_token_ids: the target's (with stop_token_ids,
        what min_tokens holds back: TargetScorer.eos_token_ids); vocab_size: the target's (ids past it bar nothing)."""
        p = self.params
        return DraftSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
                             presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                             repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias,
                             allowed_token_ids=p.allowed_token_ids, bad_words=p.banned_words, min_tokens=p.min_tokens,
                             end_token_ids=draft_end_ids(p.min_tokens, eos_token_ids, p.stop_token_ids, vocab_size),
                             grammar=None if p.structured_outputs is None else grammar_of(p.structured_outputs))
