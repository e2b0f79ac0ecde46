"""Bench settings: systems, hardware settings (placements), the grid and the sweep."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from saguaro_dist.bench.affinity import Pinning, host_cpus, plan_pinning
from saguaro_dist.config import Config, check_device, check_dtype
from saguaro_dist.sampling_params import checked_temperature

# name -> what it is
SYSTEMS = {
    "ar": "ours, autoregressive (target only)",
    "sd": "ours, speculative decoding (draft just in time, one process)",
    "ngram": "ours, prompt lookup (mode ngram: tokens from the sequence's own text, no draft model; 1, K, 2K or 3K a "
             "round, the length measured fastest)",
    "ngram-k": "ours, prompt lookup at K tokens a round (adaptive_lookup_length=False: vLLM's ngram)",
    "ssd": "ours, SSD one-host (the engine's default executor: on the CPU split, as ssd-split; on the target's GPU "
           "a thread, as ssd-thread; a process with the draft on a GPU of its own)",
    "ssd-split": "ours, SSD one-host with trees in a child process (pipe) and just-in-time drafts on a thread",
    "ssd-process": "ours, SSD one-host with the whole draft in a child process (pipe), just-in-time drafts too",
    "ssd-thread": "ours, SSD one-host with the draft on a thread of the target's process (shares the GIL; own CUDA stream)",
    "ssd-trees": "ours, SSD one-host with a tree every round (tree_policy=always; ssd measures and may skip them)",
    "ssd-draft": "ours, SSD one-host whose proposals all come from the draft (ngram_rounds=False: ssd may run rounds "
                 "of n-gram proposals alone)",
    "ssd-k": "ours, SSD one-host whose rounds of n-gram proposals alone propose K tokens (adaptive_lookup_length=False)",
    "ssd-ray": "ours, SSD on local Ray (on the CPU the default split: trees from the draft actor over gRPC, just-in-time "
               "drafts on a draft copy in the target actor)",
    "ssd-ray-process": "ours, SSD on local Ray with the whole draft in the draft actor (just-in-time drafts over gRPC too)",
    "hf": "transformers generate (AR)",
    "hf-assisted": "transformers assisted generation (assistant_model=, SD peer)",
}
SETTINGS = {
    "paper": "target on 1 core; SSD's draft on the other core",
    "equal": "every system may use both cores",
}
OURS = ("ar", "sd", "ngram", "ngram-k", "ssd", "ssd-split", "ssd-process", "ssd-thread", "ssd-trees", "ssd-draft", "ssd-k", "ssd-ray",
        "ssd-ray-process")
SSD_SYSTEMS = ("ssd", "ssd-split", "ssd-process", "ssd-thread", "ssd-trees", "ssd-draft", "ssd-k", "ssd-ray", "ssd-ray-process")
SYSTEM_SETTINGS = {"ssd-trees": {"tree_policy": "always"}, "ssd-draft": {"ngram_rounds": False},  # engine kwargs
                   "ngram-k": {"adaptive_lookup_length": False}, "ssd-k": {"adaptive_lookup_length": False}}
SPECULATIVE = ("sd", "ngram", "ngram-k", *SSD_SYSTEMS, "hf-assisted")
ONE_PROCESS = ("ar", "hf", "sd", "ngram", "ngram-k", "hf-assisted")  # target (and draft) on one thread of the bench process


@dataclass(frozen=True)
class Placement:
    """Where a system's models run under one hardware setting."""
    target_threads: int
    draft_threads: int | None   # None: no draft
    cores: int                  # cores the system may use (the tokens/s per core divisor)
    where: str                  # human-readable: processes, threads and CPUs
    pinning: Pinning = Pinning((), (), (), "not pinned")  # the CPUs its processes are pinned to (bench/affinity.py)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def placement(system: str, setting: str, cores: int = 2) -> Placement:
    """Thread counts, the process layout and the CPU pinning of `system` under `setting` on a `cores`-core host."""
    place = unpinned_placement(system, setting, cores)
    pinning = plan_pinning(system, setting, place.cores, place.draft_threads is not None, host_cpus())
    return dataclasses.replace(place, pinning=pinning, where=f"{place.where}; CPUs: {pinning.text}")


def unpinned_placement(system: str, setting: str, cores: int) -> Placement:
    one = 1 if setting == "paper" else cores
    if system in ("ar", "hf", "ngram", "ngram-k"):
        return Placement(one, None, one, f"target: bench process, {one} torch thread(s)")
    if system in ("sd", "hf-assisted"):
        return Placement(one, one, one, f"target + draft: bench process, same thread, {one} torch thread(s)")
    if system in ("ssd", "ssd-split", "ssd-trees", "ssd-draft", "ssd-k"):  # two processes, 1 torch thread each: one core each
        gpu = "" if system == "ssd-split" else " (on the target's GPU: a thread of the same process)"
        return Placement(1, 1, 2, "target: bench process engine thread (1 torch thread); draft: trees in a child "
                                  f"process (1 torch thread), pipe; just-in-time drafts on a thread beside the target{gpu}")
    if system == "ssd-process":
        return Placement(1, 1, 2, "target: bench process engine thread (1 torch thread); "
                                  "draft: child process (1 torch thread), pipe")
    if system == "ssd-thread":
        return Placement(1, 1, 2, "target: bench process engine thread (1 torch thread); "
                                  "draft: a thread of the same process (1 torch thread, shares the GIL)")
    if system == "ssd-ray":
        return Placement(1, 1, 2, "target: Ray actor process (1 torch thread, runs the engine; just-in-time drafts "
                                  "on a draft copy there); draft: Ray actor process (1 torch thread), trees over gRPC")
    if system == "ssd-ray-process":
        return Placement(1, 1, 2, "target: Ray actor process (1 torch thread, runs the engine); "
                                  "draft: Ray actor process (1 torch thread), gRPC over loopback")
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def candidate_placements(system: str, setting: str, cores: int = 2) -> list[Placement]:
    """The placements a cell tries, keeping the fastest. Under *equal* a one-process system may use
    both cores, and its best use of them is not always intra-op threads: the demo pair's sd ran 150.6
    tok/s on 2 torch threads and 211.5 on 1 (session 19). So it runs both ways, and its budget still
    counts every core, used or idle."""
    place = placement(system, setting, cores)
    if setting != "equal" or system not in ONE_PROCESS or cores == 1:
        return [place]
    draft = None if place.draft_threads is None else 1
    one = dataclasses.replace(place, target_threads=1, draft_threads=draft,
                              where=place.where.replace(f"{cores} torch thread(s)", "1 torch thread"))
    return [place, one]


def check_ssd_cores(cores: int, systems) -> None:
    """SSD runs two processes (two cores) whatever --cores says: with one, *equal* gave ar 1 core and ssd 2."""
    ssd = [s for s in systems if s in SSD_SYSTEMS]
    if cores < 2 and ssd:
        raise ValueError(f"--cores {cores}: {', '.join(ssd)} run the target and the draft on a core each (2 cores); "
                         "give --cores 2 or more, or leave the SSD systems out")


@dataclass(frozen=True)
class BenchConfig:
    """One `saguaro bench` run: the pair, the systems, the grid and the SSD settings."""
    target: str | None = None             # None: the shipped demo pair
    draft: str | None = None
    systems: tuple[str, ...] = tuple(SYSTEMS)
    settings: tuple[str, ...] = tuple(SETTINGS)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_new_tokens: int = 128
    prompt_len: int = 64                  # prompts truncated to this many tokens
    num_prompts: int | None = None        # prompts per cell, run b at a time (None: MIN_PROMPTS or the largest batch)
    k: int = 4
    fan_out: int = 12
    fan_out_kind: str = "outcome"
    adaptive_fan_out: bool = False        # the engine default; sweep points over the budget always pin it
    saguaro_c: float = 1.0
    proposal_top_k: int = 0               # the draft proposes from its k likeliest tokens (0: all)
    fallback: str = "auto"
    tree_policy: str = "auto"
    hit_glue: str = "auto"                # after a hit, whether trees cover k = K (Config.hit_glue)
    bonus_draw: str = "coupled"           # sampled rows' tree candidates and bonus draw (Config.bonus_draw)
    ngram_rounds: bool = True             # ssd: the gate may run rounds of n-gram proposals alone (Config.ngram_rounds)
    seed: int = 0
    repeats: int = 1                      # timed repeats per cell (the best is kept) after an untimed warm-up (runner.warm_up)
    interleave: bool = False              # every system of a setting open at once, one repeat of each in turn
    cores: int = 2
    device: str = "cpu"                   # every system's models (cuda: the GPU check, benchmarks/gpu_check.sh)
    dtype: str = "float32"                # "auto": the target's auto dtype on `device`, for every model (_auto_dtype)
    enforce_eager: bool = False           # on CUDA: no CUDA graphs (the eager baseline)
    out_dir: str = "bench-results"
    plots: bool = True

    def __post_init__(self):
        for name in ("target", "draft"):  # paths may come as Path objects
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))
        empty = [name for name in ("systems", "settings", "temperatures") if not getattr(self, name)]
        if empty:  # (`--systems ,`: nothing ran, exit 0, and an empty results.json)
            raise ValueError(f"{', '.join(empty)}: give at least one (an empty list runs nothing)")
        for name in ("target", "draft"):  # now, not a FileNotFoundError once the run reads config.json
            if getattr(self, name) is not None:
                check_checkpoint(name, getattr(self, name))
        bad = [s for s in self.systems if s not in SYSTEMS] + [s for s in self.settings if s not in SETTINGS]
        if bad:
            raise ValueError(f"unknown systems/settings {bad}; systems: {', '.join(SYSTEMS)}; settings: {', '.join(SETTINGS)}")
        if min(self.batch_sizes, default=0) < 1 or self.max_new_tokens < 1 or self.prompt_len < 1:
            raise ValueError("batch sizes, max_new_tokens and prompt_len must be >= 1")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        # SamplingParams' own check, now: a NaN or inf passed `t < 0`, every cell failed once loaded, and the JSON
        # held a NaN literal; a temperature it takes as greedy (under 1e-5) is recorded as 0, so =ar judges it.
        object.__setattr__(self, "temperatures", tuple(checked_temperature(t) for t in self.temperatures))
        check_dtype(self.dtype)
        check_device(self.device)
        if self.num_prompts is not None and self.num_prompts < 1:  # (against the batch sizes: prompt_count)
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        check_ssd_cores(self.cores, self.systems)
        # The engine's own checks of the SSD knobs, now: they used to fail once the first cell had loaded a model.
        Config(model="unchecked", draft="unchecked", mode="ssd", **self.engine_kwargs())
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", self._auto_dtype())

    def _auto_dtype(self) -> str:
        """dtype "auto" resolved once, for the target checkpoint (model/device.py auto_dtype): the cells run
        both models at it, as transformers' baselines take one dtype and the departure judge rounds at the
        run's, and the results record the dtype that ran."""
        from saguaro_dist.bench.prompts import resolve_pair
        from saguaro_dist.model.device import auto_dtype
        from saguaro_dist.model.hf_config import read_config_json
        from saguaro_dist.model.loader import resolve_model_dir
        target, _ = resolve_pair(self.target, self.draft)
        return auto_dtype(read_config_json(resolve_model_dir(target, weights=False)), self.device)

    @property
    def prompt_count(self) -> int:
        """Every cell runs the same prompts, b at a time: batch 1 is measured on the text batch 8 sees,
        not on the first prompt alone (one prompt's hit rate is not the pair's), also when 1 is the only
        batch size asked for (`--batch 1` alone measured one prompt: ~20 rounds at 64 tokens); and the
        largest batch size runs PASS_BATCHES batches a pass. The grid's count: a sweep runs its own
        (SweepConfig.prompt_count), so num_prompts is checked against the grid's batch sizes here, where the
        grid reads it, not at construction (that refused a sweep's `--num-prompts 4`)."""
        if self.num_prompts is not None and self.num_prompts < max(self.batch_sizes):
            raise ValueError(f"num_prompts ({self.num_prompts}) must be >= the largest batch size ({max(self.batch_sizes)})")
        return self.num_prompts or default_prompt_count(self.batch_sizes)

    @classmethod
    def preset(cls, name: str, **overrides) -> "BenchConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def engine_kwargs(self) -> dict:
        return dict(k=self.k, fan_out=self.fan_out, fan_out_kind=self.fan_out_kind,
                    adaptive_fan_out=self.adaptive_fan_out, saguaro_c=self.saguaro_c, proposal_top_k=self.proposal_top_k,
                    fallback=self.fallback, tree_policy=self.tree_policy, hit_glue=self.hit_glue,
                    bonus_draw=self.bonus_draw, ngram_rounds=self.ngram_rounds,
                    max_batch_size=max(self.batch_sizes),
                    device=self.device, dtype=self.dtype, enforce_eager=self.enforce_eager)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SweepConfig:
    """One-factor-at-a-time sweep of the SSD knobs around `base`, plus budget x fan-out kind."""
    base: BenchConfig = field(default_factory=BenchConfig)
    system: str = "ssd"                   # ssd (one-host) or ssd-ray
    setting: str = "paper"
    batch_size: int = 1
    temperature: float = 0.7              # Saguaro C acts only when sampling
    ks: tuple[int, ...] = (2, 4, 6)
    budgets: tuple[int, ...] = (6, 12, 24)
    kinds: tuple[str, ...] = ("geometric", "outcome", "uniform")
    cs: tuple[float, ...] = (1.0, 0.8, 0.5, 0.2)
    fallbacks: tuple[str, ...] = ("auto", "neural", "fast", "random")

    def __post_init__(self):
        # Checked before any model loads: an unknown setting ran as *equal* under its own name, a batch size
        # of 0 or a NaN temperature failed every point once loaded (and the JSON held a NaN literal).
        if self.system not in SSD_SYSTEMS or self.setting not in SETTINGS:
            raise ValueError(f"the sweep runs an SSD system ({', '.join(SSD_SYSTEMS)}) under a setting "
                             f"({', '.join(SETTINGS)}), got {self.system!r} under {self.setting!r}")
        if self.batch_size < 1:
            raise ValueError(f"the sweep's batch size must be >= 1, got {self.batch_size}")
        if self.base.num_prompts is not None and self.base.num_prompts < self.batch_size:
            # an error, not a silent raise of --num-prompts to the batch size (what the sweep did)
            raise ValueError(f"num_prompts ({self.base.num_prompts}) must be >= the sweep's batch size ({self.batch_size})")
        check_ssd_cores(self.base.cores, (self.system,))
        object.__setattr__(self, "temperature", checked_temperature(self.temperature))

    @property
    def prompt_count(self) -> int:
        """The prompts every point runs, batch_size at a time: num_prompts, else the grid's default count for
        the base's batch sizes, or batch_size when larger."""
        return self.base.num_prompts or max(self.batch_size, default_prompt_count(self.base.batch_sizes))

    def points(self) -> list[tuple[str, dict]]:
        """(axis, engine overrides) per run; fan-out budgets are crossed with the kinds."""
        pts = [("k", {"k": k, "fan_out": max(self.base.fan_out, k + 1)}) for k in self.ks]
        pts += [("fan_out", {"fan_out": b, "fan_out_kind": kind, "adaptive_fan_out": False}) for kind in self.kinds
                for b in self.budgets if b >= self.base.k + 1]
        pts += [("saguaro_c", {"saguaro_c": c}) for c in self.cs]
        pts += [("fallback", {"fallback": f}) for f in self.fallbacks]
        return pts

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


MIN_PROMPTS = 8  # prompts a cell runs unless num_prompts says otherwise ...
PASS_BATCHES = 2  # ... or this many batches of the largest batch size: a pass of one b = 8 batch is ~45 rounds, of
                  # which the tree gate's re-tries took up to 5, and its ratio to sd read 0.86-1.23 over sessions
                  # 63-71 (T = 0.7), where two batches a pass read 1.09-1.17 (session 71); the default grid
                  # (b up to 8) runs 16 prompts


def default_prompt_count(batch_sizes: tuple[int, ...]) -> int:
    return max(MIN_PROMPTS, PASS_BATCHES * max(batch_sizes))


def check_checkpoint(name: str, value: str) -> None:
    """A folder holding config.json, or what can only be a Hugging Face id (owner/name, the rule of
    model/loader.py resolve_model_dir, which then fetches it or says why not)."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--{name} {value}: the folder holds no config.json (not a model checkpoint)")
        return
    if path.exists() or value.startswith((".", "/", "~")) or value.count("/") != 1 or "" in value.split("/"):
        raise ValueError(f"--{name} {value}: no such folder, and not a Hugging Face id (owner/name)")


PRESETS = {
    "full": dict(max_new_tokens=192, prompt_len=64, repeats=1),
    "quick": dict(batch_sizes=(1, 2), temperatures=(0.0,), max_new_tokens=16, prompt_len=16,
                  systems=("ar", "sd", "ssd", "hf", "hf-assisted"), settings=("paper",), plots=True),
}
