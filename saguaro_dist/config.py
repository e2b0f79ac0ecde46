"""One place for every setting: the engine's Config and the enums that name its modes."""
from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, field

from saguaro_dist.lora_request import check_lora_config

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
log = logging.getLogger(__name__)


class Mode(str, enum.Enum):
    AR = "ar"    # plain autoregressive decoding with the target alone
    SD = "sd"    # speculative decoding: draft K tokens, then verify (sequential)
    SSD = "ssd"  # speculative speculative decoding: the draft prepares the next round while the target verifies
    NGRAM = "ngram"  # prompt lookup (vLLM's "ngram" method): K tokens that followed the sequence's last n-gram before
                     # in its own text, no draft model; a baseline for the speculative modes, and a fit for copy-heavy text


DRAFT_MODES = frozenset({Mode.SD, Mode.SSD})  # the modes that run a draft model (and, on Ray, draft actors)
SPECULATIVE_MODES = frozenset({Mode.SD, Mode.SSD, Mode.NGRAM})
SSD_ONLY = frozenset({Mode.SSD})
ALL_MODES = frozenset(Mode)
# Config field -> the modes that use it (the rest apply to every mode); cli/flag_checks.py refuses their flags
# elsewhere. Prompt lookup is ngram's proposals and SD's and SSD's fast backup; fan-out, Saguaro C, fallback
# and the tree knobs shape SSD's trees, which SD never builds.
MODE_FIELDS = {
    **dict.fromkeys(("draft", "draft_revision", "draft_device", "draft_executor", "proposal_top_k",
                     "num_draft_workers", "draft_resources"), DRAFT_MODES),
    **dict.fromkeys(("k", "prompt_lookup_max", "prompt_lookup_min"), SPECULATIVE_MODES),
    **dict.fromkeys(("fan_out", "fan_out_kind", "adaptive_fan_out", "saguaro_c", "fallback", "tree_policy",
                     "jit_cohorts", "hit_glue", "bonus_draw", "ngram_rounds"), SSD_ONLY),
}


class FanOut(str, enum.Enum):
    GEOMETRIC = "geometric"  # Saguaro Theorem 12: i.i.d. acceptance a per token
    OUTCOME = "outcome"      # Theorem 12's optimum for the measured distribution of k* (spec/fanout.py)
    UNIFORM = "uniform"


class DraftExecutor(str, enum.Enum):
    """Where the engine runs its draft. One host: a thread or a child process. On Ray the draft actors
    are the "process"; "split" also keeps a draft copy beside the target (its rank 0) for the drafts."""
    AUTO = "auto"        # thread for SD (draft and target never run at once); for SSD split on the CPU, a thread
                         # on the target's GPU, a process on another GPU; on Ray split on the CPU, else process
    PROCESS = "process"  # a child process spoken to over a pipe (on Ray: the pool of draft actors does all)
    THREAD = "thread"    # a thread of this process: no start-up cost, but it competes for the GIL (one host only)
    SPLIT = "split"      # SSD: just-in-time drafts on a thread (SD's rounds, no hop), trees in a child process
                         # (on Ray: in the pool of draft actors)


class TreePolicy(str, enum.Enum):
    """Whether SSD's draft prepares a speculation tree every round (spec/tree_gate.py)."""
    AUTO = "auto"      # measure rounds with and without trees per batch size, run the faster
    ALWAYS = "always"  # a tree every round (the paper's SSD), even when building it outlasts the verify
    NEVER = "never"    # no trees: SD's rounds on SSD's placement (in two cohorts where that is faster, jit_cohorts)


class HitGlue(str, enum.Enum):
    """Whether a tree built right after a hit also covers the all-accepted outcome (k = K): that needs the draft's
    distribution after x_K, one more sequential draft forward (spec/budget.py: DraftLoad)."""
    AUTO = "auto"      # skip that forward while the target waits for trees; run it again once the draft has slack
    ALWAYS = "always"  # every tree covers k = 0..K (the paper's)
    SKIP = "skip"      # trees after a hit cover k < K only; F_K's branches go to k = K - 1


class BonusDraw(str, enum.Enum):
    """How a sampled row's tree picks its bonus candidates, and how the target then draws the bonus (spec/coupled.py).
    Greedy rows always take the draft's top-F: their bonus is the target's argmax."""
    COUPLED = "coupled"  # candidates drawn from the draft's guess of each outcome's bonus distribution, the bonus
                         # drawn against them (still exactly the target's): hit more often at T > 0
    TOP_F = "top_f"      # the draft's top-F tokens per outcome, the bonus drawn independently (the paper's)


class FallbackPolicy(str, enum.Enum):
    AUTO = "auto"      # neural below the critical batch size b*, fast above (Saguaro Theorem 17)
    NEURAL = "neural"  # the draft drafts K tokens just in time for the real outcome
    FAST = "fast"      # n-gram / prompt-lookup proposal from the sequence's own tokens
    RANDOM = "random"  # random tokens (the paper's fast backup), for comparison


class SchedulingPolicy(str, enum.Enum):
    """Which waiting request takes a free batch slot (vLLM's --scheduling-policy)."""
    FCFS = "fcfs"          # first come, first served
    PRIORITY = "priority"  # the lowest `priority` value first, then first come; running requests are not preempted


# auto: vLLM's --dtype auto, each model's checkpoint dtype adjusted to its device (model/device.py auto_dtype)
DTYPES = ("float32", "float16", "bfloat16", "auto")


def check_dtype(dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be {', '.join(DTYPES)}, got {dtype!r}")


def check_device(device, name: str = "device") -> None:
    """cpu, cuda or cuda:N (the string only: whether that GPU exists is checked where the model loads,
    which on a cluster is a worker's node, not the driver's)."""
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def parse_enum(enum_type: type[enum.Enum], value, field_name: str):
    """Accept an enum member or its string value; anything else is a ValueError naming the field."""
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"{field_name} must be one of {choices}, got {value!r}") from None


def check_memory_utilization(value) -> None:
    if not is_number(value) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {value!r}")


def is_number(value) -> bool:
    """An int or a float (a bool is neither here: True is not a temperature)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_resources(name: str, value) -> None:
    """Ray custom resources: {name: amount >= 0} (finite: Ray scales amounts to integers)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and is_number(v) and 0 <= v < math.inf
                                              for k, v in value.items()):
        raise ValueError(f"{name} must map resource names to finite amounts >= 0, got {value!r}")


def check_seed(seed) -> None:
    """None or an int64 (SamplingParams.seed's range; a bool is no seed)."""
    if seed is not None and (type(seed) is not int or not -2**63 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] (or None), got {seed!r}")


def check_seconds(name: str, value, zero_ok: bool) -> None:
    """Finite and at most threading.TIMEOUT_MAX: the engine waits on it (an inf raised OverflowError there)."""
    if not is_number(value) or not 0 <= value <= threading.TIMEOUT_MAX or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}, got {value!r}")


@dataclass(frozen=True)
class Config:
    """Everything the engine needs to know; validated once, never mutated afterwards."""

    model: str
    draft: str | None = None
    revision: str | None = None            # the target's Hub revision (branch, tag or commit; None: main)
    draft_revision: str | None = None      # the draft's
    tokenizer: str | None = None           # a tokenizer (folder or Hub id) used instead of the target's own (vLLM's --tokenizer)
    tokenizer_revision: str | None = None  # its Hub revision (default: revision, when the tokenizer is the model's)
    mode: Mode = Mode.SSD
    k: int = 4                             # speculation length K
    fan_out: int | tuple[int, ...] = 12    # branch budget B, or explicit F_0..F_K (K+1 ints)
    fan_out_kind: FanOut = FanOut.OUTCOME
    adaptive_fan_out: bool = False         # shrink the budget while tree builds outlast verifies (spec/budget.py)
    saguaro_c: float = 1.0                 # Saguaro sampling (ssd; sd drafts unbiased): scale of the draft's top-F probabilities
    proposal_top_k: int = 0                # the draft proposes from its k likeliest tokens (T > 0; 0: all): still exact, q travels sparse
    prompt_lookup_max: int = 3             # n-gram sizes prompt lookup matches, the longest first (vLLM's names): mode
    prompt_lookup_min: int = 1             # ngram's proposals, and SSD's fast backup
    fallback: FallbackPolicy = FallbackPolicy.AUTO
    tree_policy: TreePolicy = TreePolicy.AUTO
    jit_cohorts: int = 2                   # ssd rounds without trees: 2 = the batch in two cohorts, one drafted while the other verifies, where measured faster (spec/cohorts.py); 1 = whole
    hit_glue: HitGlue = HitGlue.AUTO       # ssd: after a hit, whether the tree covers k = K too (one draft forward more)
    bonus_draw: BonusDraw = BonusDraw.COUPLED  # ssd, T > 0: coupled draws (spec/coupled.py), or the draft's top-F (the paper's)
    ngram_rounds: bool = True              # ssd, tree_policy and fallback "auto": the tree gate may run rounds of n-gram
                                           # proposals alone where they measure faster (repetitive text; spec/tree_gate.py),
                                           # and a row may take its n-gram proposal over the draft's (spec/lookup_pick.py)
    adaptive_lookup_length: bool = True    # a round of n-gram proposals alone (mode ngram, ssd's n-gram rounds) proposes
                                           # 1, K, 2K or 3K tokens, the length measured fastest (spec/lookup_length.py); False: K
    max_batch_size: int = 8
    max_model_len: int | None = None       # None: the target's max_position_embeddings
    max_num_batched_tokens: int = 2048     # prompt tokens an engine step prefills, tokens one forward takes: longer prompts run in chunks
    device: str = "cpu"
    draft_device: str | None = None        # the draft's own device (None: `device`), e.g. cuda:1 beside a target on cuda:0
    dtype: str = "float32"                 # or float16, bfloat16, auto (per model: its checkpoint's, for its device)
    enforce_eager: bool = False            # on CUDA: every forward eager (default: short ones replay CUDA graphs; model/cuda_graphs.py)
    gpu_memory_utilization: float = 0.9    # share of the device's memory the engine may use; its KV cache must fit (model/memory.py)
    enable_prefix_caching: bool = True     # finished sequences' KV rows are reused by prompts that start alike (model/prefix_cache.py)
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS  # which waiting request is admitted next
    enable_lora: bool = False              # vLLM's: requests may name a PEFT adapter (LoRARequest) the target runs them through
    max_loras: int = 1                     # adapters one batch runs at once (the target's slots); others' requests wait
    max_lora_rank: int = 16                # the largest adapter rank r taken (vLLM's choices: 1, 8, 16, ..., 512)
    max_cpu_loras: int | None = None       # adapters kept read in host memory (LRU, >= max_loras; None: max_loras): one evicted from its slot reloads without reading its files
    log_stats_interval_s: float = 10.0     # an INFO line of throughput, queue and speculation figures this often (0: off)
    generation_config: str = "auto"        # requests' sampling defaults: the model's generation_config.json, "vllm" (none) or a folder
    seed: int | None = None                # vLLM's: an unseeded request's draws derive from it and its order of arrival,
                                           # so a run's same requests in the same order reproduce (None: fresh OS randomness)
    # torch intra-op threads for the target / draft. None: one host leaves torch's own; a Ray actor runs 1 (and
    # asks Ray for a CPU per thread either way: distributed/placement.py)
    target_threads: int | None = None
    draft_threads: int | None = None
    draft_executor: DraftExecutor = DraftExecutor.AUTO
    tree_timeout_s: float = 5.0            # how long the target waits for a late speculation tree
    startup_timeout_s: float = 600.0       # on Ray: how long start-up waits for its actors to be placed and load
    draft_deadline_s: float = 10.0         # on Ray: a draft actor this late with a just-in-time draft is taken for dead
                                           # (its sequences move on; the pool takes it back once it answers again)
    draft_spin_s: float = 0.05             # after work the target follows up within a round (a tree, a draft), the draft
                                           # busy-polls this long for its next message before it blocks (the one-host
                                           # engine its draft's pipe, up to 10 ms of it); 0: off
    # Distributed runtime (None: the one-host engine)
    cluster: str | None = None
    tensor_parallel_size: int = 1
    num_draft_workers: int = 1
    target_resources: dict = field(default_factory=dict)  # extra Ray resources per target rank
    draft_resources: dict = field(default_factory=dict)   # extra Ray resources per draft worker

    def __post_init__(self):
        object.__setattr__(self, "mode", parse_enum(Mode, self.mode, "mode"))
        object.__setattr__(self, "fan_out_kind", parse_enum(FanOut, self.fan_out_kind, "fan_out_kind"))
        object.__setattr__(self, "draft_executor", parse_enum(DraftExecutor, self.draft_executor, "draft_executor"))
        object.__setattr__(self, "fallback", parse_enum(FallbackPolicy, self.fallback, "fallback"))
        object.__setattr__(self, "tree_policy", parse_enum(TreePolicy, self.tree_policy, "tree_policy"))
        object.__setattr__(self, "hit_glue", parse_enum(HitGlue, self.hit_glue, "hit_glue"))
        object.__setattr__(self, "bonus_draw", parse_enum(BonusDraw, self.bonus_draw, "bonus_draw"))
        object.__setattr__(self, "scheduling_policy", parse_enum(SchedulingPolicy, self.scheduling_policy, "scheduling_policy"))
        if isinstance(self.fan_out, list):
            object.__setattr__(self, "fan_out", tuple(self.fan_out))
        for name in ("target_resources", "draft_resources"):  # a copy: the caller's dict may change later
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, dict(getattr(self, name)))
        for name in ("model", "draft", "tokenizer"):  # a pathlib.Path is a folder too
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        self._validate()

    @property
    def tokenizer_source(self) -> tuple[str, str | None]:
        """(path or Hub id, revision) of the tokenizer the engine speaks: `tokenizer`, else the model's."""
        if self.tokenizer is None:
            return self.model, self.tokenizer_revision or self.revision
        return self.tokenizer, self.tokenizer_revision

    def _validate(self):
        self._validate_models()
        self._validate_speculation()
        self._validate_sizes()
        self._validate_times()
        self._validate_placement()
        warn_unused_fields(self)

    def _validate_models(self):
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"model must be a folder or a Hugging Face id, got {self.model!r}")
        if self.uses_draft and not self.draft:
            raise ValueError(f"mode {self.mode.value!r} needs a draft model (draft=...)")
        if self.mode is Mode.NGRAM and self.draft:
            raise ValueError("mode 'ngram' proposes from each sequence's own tokens and takes no draft model: drop "
                             "draft=..., or choose mode 'sd' / 'ssd'")
        if self.mode is Mode.AR and self.draft:  # it went unused, silently: a user who meant SD measured AR
            raise ValueError("mode 'ar' decodes with the target alone and takes no draft model: drop draft=..., or "
                             "choose mode 'sd' / 'ssd'")
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft.strip()):
            raise ValueError(f"draft must be a folder or a Hugging Face id, got {self.draft!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer.strip()):
            raise ValueError(f"tokenizer must be a folder or a Hugging Face id, got {self.tokenizer!r}")
        for name in ("revision", "draft_revision", "tokenizer_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a branch, tag or commit of the Hub repository, got {value!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        check_dtype(self.dtype)

    def _validate_speculation(self):
        check_int("k", self.k, 1)
        if not is_number(self.saguaro_c) or not 0.0 <= self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in [0, 1], got {self.saguaro_c!r}")
        for flag in ("ngram_rounds", "adaptive_lookup_length", "adaptive_fan_out", "enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.jit_cohorts not in (1, 2) or isinstance(self.jit_cohorts, bool):
            raise ValueError(f"jit_cohorts must be 1 (the batch whole) or 2 (two cohorts), got {self.jit_cohorts!r}")
        check_int("proposal_top_k", self.proposal_top_k, 0)
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if any(type(n) is not int for n in lookup) or not 1 <= lookup[0] <= lookup[1]:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, got {lookup}")
        self._validate_fan_out()

    def _validate_fan_out(self):
        """A budget must cover K+1 positions only where trees are built (ssd): sd and ngram leave it unused, and
        the default budget refused their k >= 12, with a --fan-out their flags refuse."""
        if isinstance(self.fan_out, tuple):
            if len(self.fan_out) != self.k + 1 or any(type(f) is not int or f < 1 for f in self.fan_out):
                raise ValueError(f"fan_out as a list needs k+1 = {self.k + 1} positive ints, got {list(self.fan_out)}")
            return
        least = self.k + 1 if self.mode is Mode.SSD else 1
        if type(self.fan_out) is not int or self.fan_out < least:
            what = f"k+1 = {least} (one branch per position)" if self.mode is Mode.SSD else "1"
            hint = (f": k = {self.k} needs that many (lower k, or raise fan_out: default {type(self).fan_out})"
                    if self.mode is Mode.SSD else "")
            raise ValueError(f"fan_out budget must be an int >= {what}, got {self.fan_out!r}{hint}")

    def _validate_sizes(self):
        for name in ("max_batch_size", "max_num_batched_tokens", "tensor_parallel_size", "num_draft_workers"):
            check_int(name, getattr(self, name), 1)
        for name in ("max_model_len", "target_threads", "draft_threads"):  # None: the model's own, torch's own
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_memory_utilization(self.gpu_memory_utilization)
        check_seed(self.seed)
        check_lora_config(self.enable_lora, self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _validate_times(self):
        if not is_number(self.draft_spin_s) or not 0.0 <= self.draft_spin_s <= 1.0:
            raise ValueError(f"draft_spin_s must be a number of seconds in [0, 1], got {self.draft_spin_s!r}")
        check_seconds("tree_timeout_s", self.tree_timeout_s, zero_ok=True)  # 0: never wait for a late tree
        check_seconds("startup_timeout_s", self.startup_timeout_s, zero_ok=False)
        check_seconds("draft_deadline_s", self.draft_deadline_s, zero_ok=False)
        check_seconds("log_stats_interval_s", self.log_stats_interval_s, zero_ok=True)

    def _validate_placement(self):
        if self.draft_executor is DraftExecutor.SPLIT and self.mode is not Mode.SSD:
            raise ValueError(f"draft_executor 'split' splits SSD's draft (drafts here, trees in a child); mode is {self.mode.value!r}")
        if self.draft_executor is DraftExecutor.THREAD and self.cluster is not None:
            raise ValueError("draft_executor 'thread' is one-host only: on Ray the draft actors build the trees "
                             "('process'), and 'split' also drafts beside the target")
        if self.cluster is not None and (not isinstance(self.cluster, str) or not self.cluster.strip()):
            raise ValueError(f"cluster must be 'local', 'auto' or a Ray address such as 'ray://host:10001', got {self.cluster!r}")
        for name in ("target_resources", "draft_resources"):
            check_resources(name, getattr(self, name))
        if {"CPU", "GPU"} & set(self.draft_resources):  # Ray refuses them in an actor's custom resources
            raise ValueError(f"draft_resources may not name CPU or GPU (got {self.draft_resources!r}): a draft "
                             f"worker's CPUs are draft_threads, its GPU draft_device")
        self._validate_pools()
        check_device(self.device)
        if self.draft_device is not None:
            check_device(self.draft_device, "draft_device")

    def _validate_pools(self):
        """More than one target rank or draft worker needs Ray: the one-host engine ran one of each, silently."""
        for name in ("tensor_parallel_size", "num_draft_workers"):
            if self.cluster is None and getattr(self, name) > 1:
                raise ValueError(f"{name} = {getattr(self, name)} runs on Ray: give cluster ('auto': the cluster "
                                 f"this process runs on or `ray start` began, 'local', or 'ray://host:10001')")

    @property
    def uses_draft(self) -> bool:
        """Whether the mode runs a draft model (SD, SSD)."""
        return self.mode in DRAFT_MODES

    @property
    def draft_device_resolved(self) -> str:
        return self.draft_device or self.device

    @property
    def fan_out_budget(self) -> int:
        return sum(self.fan_out) if isinstance(self.fan_out, tuple) else self.fan_out


def unused_fields(config: Config) -> dict:
    """field -> value of the settings `config.mode` leaves unused that differ from their defaults."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)
            if config.mode not in MODE_FIELDS.get(f.name, ALL_MODES) and getattr(config, f.name) != _default(f)}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def warn_unused_fields(config: Config) -> None:
    """Said, not refused (vLLM has no such fields outside its speculative_config to refuse): callers such as
    the bench pass one set of settings to every mode. A draft is refused where unused (_validate_models)."""
    for name, value in unused_fields(config).items():
        uses = " / ".join(m.value for m in Mode if m in MODE_FIELDS[name])
        _warn_once(f"Config {name} = {getattr(value, 'value', value)!r} is unused in mode {config.mode.value!r} "
                   f"(it applies only to mode {uses})")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """Once per process (vLLM's warning_once): the CLI validates a Config, then builds its engine's."""
    log.warning(message)
