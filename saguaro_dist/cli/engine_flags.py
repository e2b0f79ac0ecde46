"""The engine flags shared by `saguaro serve`, `generate` and `run-batch`, one function per group of flags.

Every flag defaults to None, so a --config file's values are only overridden on purpose (cli/serve.py's
ENGINE_FLAGS maps them onto Config fields)."""
from __future__ import annotations

import argparse

from saguaro_dist.config import (DTYPES, BonusDraw, DraftExecutor, FallbackPolicy, FanOut, HitGlue, Mode,
                                 SchedulingPolicy, TreePolicy)


def fan_out_arg(text: str):
    """A budget ("12") or explicit per-position counts ("4,3,2")."""
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:  # argparse's own message named this function ("invalid fan_out_arg value")
        raise argparse.ArgumentTypeError(f"expected a branch budget (say 12) or comma-separated counts "
                                         f"(say 4,3,2), got {text!r}") from None
    return parts[0] if len(parts) == 1 else parts


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's ModelDType takes these names too


def dtype_arg(text: str) -> str:
    """A dtype name, vLLM's aliases half / float read as float16 / float32 (argparse's choices check the rest)."""
    return DTYPE_ALIASES.get(text, text)


def human_int(text: str) -> int:
    """An integer as vLLM's --max-model-len reads it: 32768, 32k (x 1000, decimals allowed: 25.6k) or 32K
    (x 1024); likewise m / M, g / G, t / T."""
    value = text.strip()
    if value and value[-1] in "kmgtKMGT":
        number, suffix = value[:-1], value[-1]
        try:
            if suffix.islower():
                return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
            return int(number) * 1024 ** ("KMGT".index(suffix) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid size {text!r}: a number and k/m/g/t (x 1000) or an integer "
                                             f"and K/M/G/T (x 1024), e.g. 32k or 32K") from None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r} (e.g. 4096, 32k or 32K)") from None


def add_engine_args(p: argparse.ArgumentParser, engine_seed: bool = False) -> None:
    """engine_seed: add the engine's --seed (Config.seed), where no per-request --seed takes the name."""
    g = p.add_argument_group("engine")
    for add_group in ENGINE_ARG_GROUPS:
        add_group(g)  # one group, in this order: `--help` lists the flags as it always did
    if engine_seed:
        _add_engine_seed(g)


def _add_model_args(g) -> None:
    """Which checkpoints and tokenizer, and their Hub revisions."""
    g.add_argument("model_tag", nargs="?", metavar="MODEL", help="target model path or HF id (or use --model)")
    g.add_argument("--model", help="target model (default: the shipped demo pair)")
    g.add_argument("--draft", help="draft model (needed for sd / ssd; default: the demo draft with the demo pair)")
    g.add_argument("--revision", help="the target's Hub revision: a branch, tag or commit (vLLM's; default main)")
    g.add_argument("--draft-revision", help="the draft's Hub revision")
    g.add_argument("--tokenizer", help="a tokenizer (folder or HF id) used instead of the target's own (vLLM's)")
    g.add_argument("--tokenizer-revision", help="the tokenizer's Hub revision")


def _add_speculation_args(g) -> None:
    """The decoding mode and the shape of its speculation."""
    g.add_argument("--mode", choices=[m.value for m in Mode], help="ar, sd, ssd or ngram (prompt lookup, no draft) (default ssd; ar without draft)")
    g.add_argument("--k", type=int, help="speculation length K (default 4)")
    g.add_argument("--fan-out", type=fan_out_arg, help="branch budget B, or K+1 comma-separated counts")
    g.add_argument("--fan-out-kind", choices=[f.value for f in FanOut])
    g.add_argument("--adaptive-fan-out", dest="adaptive_fan_out", action="store_true", default=None,
                   help="let the draft shrink the fan-out budget while its tree builds outlast verifies")
    g.add_argument("--saguaro-c", type=float, help="Saguaro sampling scale C in [0, 1]")
    g.add_argument("--proposal-top-k", type=int, dest="proposal_top_k",
                   help="the draft proposes from its k likeliest tokens when sampling (exact either way; its "
                        "distributions then travel sparse: worth it with a large vocabulary); 0 (default): all")
    g.add_argument("--prompt-lookup-max", type=int, dest="prompt_lookup_max",
                   help="longest n-gram prompt lookup matches (--mode ngram, and SSD's fast backup; default 3)")
    g.add_argument("--prompt-lookup-min", type=int, dest="prompt_lookup_min", help="shortest one (default 1)")
    g.add_argument("--fallback", choices=[f.value for f in FallbackPolicy])
    g.add_argument("--speculative-config", dest="speculative_config",
                   help="vLLM's speculative config as JSON, e.g. '{\"model\": \"DRAFT\", \"num_speculative_tokens\": 4}' or "
                        "'{\"method\": \"ngram\", \"prompt_lookup_max\": 4}' (the same as --draft / --k / --mode ngram)")


def _add_ssd_round_args(g) -> None:
    """How SSD's rounds use trees, cohorts and n-gram proposals."""
    g.add_argument("--tree-policy", choices=[t.value for t in TreePolicy],
                   help="ssd: auto (default) runs rounds with or without speculation trees, whichever is measured "
                        "faster at the batch size; always builds a tree every round; never builds none (SD's rounds)")
    g.add_argument("--jit-cohorts", type=int, choices=[1, 2], dest="jit_cohorts",
                   help="ssd rounds without trees: 2 (default) verifies the batch as two cohorts, the draft drafting "
                        "one while the target verifies the other, where measured faster; 1: the batch whole")
    g.add_argument("--hit-glue", choices=[h.value for h in HitGlue],
                   help="ssd: after a hit, whether the tree covers the all-accepted outcome too (one draft forward "
                        "more); auto (default) skips it while the target waits for trees")
    g.add_argument("--bonus-draw", choices=[b.value for b in BonusDraw],
                   help="ssd, sampled rows: coupled (default) draws the tree's bonus candidates from the draft's guess and the "
                        "bonus against them (hit more often, still exact); top_f takes the draft's top-F")
    g.add_argument("--ngram-rounds", action=argparse.BooleanOptionalAction, default=None,
                   help="ssd: let the tree gate run rounds of n-gram proposals alone (no draft, no tree) where they "
                        "measure faster, as on repetitive text, and a row take its n-gram proposal over the "
                        "draft's where that gains more (default on; only with --fallback auto)")


def _add_batching_args(g) -> None:
    """How many sequences and tokens one engine step takes."""
    g.add_argument("--max-batch-size", "--max-num-seqs", type=int, dest="max_batch_size",
                   help="sequences decoded together (vLLM's --max-num-seqs; default 8)")
    g.add_argument("--max-model-len", type=human_int, help="context length in tokens: 4096, 32k (32000) or 32K (32768)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="prompt tokens an engine step prefills and tokens one forward takes; longer prompts run in "
                        "chunks between decoding rounds (default 2048)")


def _add_device_args(g) -> None:
    """Where the models run, in which dtype, and how much device memory they may take."""
    g.add_argument("--device", help="cpu, cuda, cuda:0, ...")
    g.add_argument("--draft-device", help="the draft's own device (default: --device), e.g. cuda:1")
    g.add_argument("--dtype", type=dtype_arg, choices=DTYPES,
                   help="the models' dtype (default float32); auto: each model's checkpoint dtype, on CUDA float16 "
                        "for a float32 one (vLLM's), on the CPU bfloat16 for a float16 one; half / float: float16 / float32")
    g.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=None,
                   help="on CUDA: run every forward eagerly (default: decode and verify steps replay CUDA graphs)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help="share of the device's memory the engine may use (vLLM's; default 0.9). The KV cache's worst "
                        "case (max-num-seqs x max-model-len) must fit what the weights leave of it: on CUDA it is "
                        "allocated at start-up and a shortfall is an error naming what fits; on the CPU a warning")


def _add_scheduling_args(g) -> None:
    """Prefix reuse and which waiting request runs next."""
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse finished sequences' KV for prompts that start with their tokens (default on)")
    g.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy],
                   help="which waiting request takes a free batch slot: fcfs (default) or priority (the request's "
                        "`priority`, lower first; running requests are not preempted)")


def _add_defaults_and_stats_args(g) -> None:
    """Requests' sampling defaults and the periodic stats line."""
    g.add_argument("--generation-config",
                   help="requests' default temperature, top_p, top_k, min_p, repetition_penalty and max_tokens: "
                        "auto (default) from the model's generation_config.json, as vLLM; vllm: none (temperature "
                        "1, no truncation); or a folder holding a generation_config.json")
    g.add_argument("--disable-log-stats", dest="log_stats_interval_s", action="store_const", const=0.0, default=None,
                   help="no periodic engine stats line (default: one every 10 s while serving, as vLLM)")


def _add_cluster_args(g) -> None:
    """Running the engine as Ray actors: pool sizes, the draft's executor, the cluster."""
    g.add_argument("--tp", "--tensor-parallel-size", "-tp", type=int, dest="tp",
                   help="tensor-parallel size of the target (above 1 implies --cluster auto)")
    g.add_argument("--draft-workers", type=int, help="draft actors in the pool (above 1 implies --cluster auto)")
    g.add_argument("--draft-executor", choices=[e.value for e in DraftExecutor],
                   help="where the draft runs. One host: thread, process (a child), or split (just-in-time drafts on "
                        "a thread, trees in a child); default auto: thread for sd, and for ssd split on the CPU, thread "
                        "on the target's GPU, process on a GPU of its own. On Ray: split (the target's rank 0 drafts "
                        "just in time, the draft actors build the trees; auto for ssd on the CPU) or process (the "
                        "draft actors do all)")
    g.add_argument("--cluster", help="run the engine as Ray actors: auto, local or ray://host:port "
                                     "(default: one-host engine inside the server)")


def _add_engine_seed(g) -> None:
    """vLLM's engine --seed (serve and run-batch; generate's --seed seeds its requests)."""
    g.add_argument("--seed", type=int, dest="engine_seed",
                   help="vLLM's engine seed: requests without a seed of their own draw from streams derived from "
                        "it and their order of arrival, so the same requests in the same order reproduce "
                        "(default: fresh randomness); a request's seed still wins")


# In --help order (one "engine" group): model, speculation, SSD rounds, batching, device, scheduling, defaults, cluster.
ENGINE_ARG_GROUPS = (_add_model_args, _add_speculation_args, _add_ssd_round_args, _add_batching_args, _add_device_args,
                     _add_scheduling_args, _add_defaults_and_stats_args, _add_cluster_args)
