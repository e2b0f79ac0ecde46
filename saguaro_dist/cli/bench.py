"""`saguaro bench`: the grid (systems x settings x batch x temperature), the SSD sweep, or our systems serving
request streams (--request-rates); table, JSON, PNGs."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the bench package pulls in matplotlib and transformers: imported when a bench runs
    from saguaro_dist.bench import BenchConfig, ServingConfig, SweepConfig
    from saguaro_dist.bench.remote import RemoteConfig

log = logging.getLogger(__name__)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _rates(text: str) -> tuple[float, ...]:
    """Requests a second, comma-separated; "inf" for all at once (ServingConfig checks that they are > 0)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rates are requests a second, comma-separated (inf: all at once), "
                                         f"got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


# option -> (BenchConfig field, parser)
GRID_OPTIONS = {"--systems": ("systems", _names), "--settings": ("settings", _names), "--batch": ("batch_sizes", _ints),
                "--temperatures": ("temperatures", _floats), "--max-new-tokens": ("max_new_tokens", int),
                "--prompt-len": ("prompt_len", int), "--num-prompts": ("num_prompts", int), "--k": ("k", int),
                "--fan-out": ("fan_out", int),
                "--fan-out-kind": ("fan_out_kind", str), "--saguaro-c": ("saguaro_c", float),
                "--proposal-top-k": ("proposal_top_k", int),
                "--fallback": ("fallback", str), "--tree-policy": ("tree_policy", str),
                "--hit-glue": ("hit_glue", str), "--bonus-draw": ("bonus_draw", str), "--seed": ("seed", int), "--repeats": ("repeats", int),
                "--cores": ("cores", int), "--device": ("device", str), "--dtype": ("dtype", str)}
SWEEP_OPTIONS = {"--sweep-ks": ("ks", _ints), "--sweep-budgets": ("budgets", _ints), "--sweep-kinds": ("kinds", _names),
                 "--sweep-cs": ("cs", _floats), "--sweep-fallbacks": ("fallbacks", _names),
                 "--sweep-batch": ("batch_size", int), "--sweep-temperature": ("temperature", float),
                 "--sweep-system": ("system", str), "--sweep-setting": ("setting", str)}


RESULT_FILES = {"grid": "results.json", "sweep": "sweep.json", "serving": "serving.json"}


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark SSD against AR, SD and transformers (table, JSON, plots)",
                              description=__doc__)
    p.add_argument("--preset", choices=("full", "quick"), default="full", help="grid defaults (quick: CI-sized)")
    p.add_argument("--sweep", action="store_true", help="sweep k, fan-out budget x kind, Saguaro C, fallback instead")
    p.add_argument("--request-rates", type=_rates, help="serve a stream of requests at each rate (requests/s, "
                   "comma-separated; inf: all at once) to our systems instead of the grid: throughput, TTFT, TPOT; "
                   "at most max(--batch) running; default systems ar,sd,ngram,ssd")
    p.add_argument("--num-requests", type=int, default=32, help="requests a serving stream (--request-rates)")
    p.add_argument("--url", help="with --request-rates: stream the requests to this running server (a RayService, "
                                 "`saguaro serve`; any OpenAI-compatible server with /tokenize) instead of our systems here")
    p.add_argument("--api-key", help="the server's key with --url (default: $SAGUARO_API_KEY if set)")
    p.add_argument("--model", help="with --url: the served model name to ask for (default: the server's first)")
    p.add_argument("--target", help="target checkpoint (default: the demo pair)")
    p.add_argument("--draft", help="draft checkpoint (default: the demo pair)")
    p.add_argument("--out", default="bench-results", help="directory for results.json / sweep.json and PNGs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--adaptive-fan-out", action="store_true", help="let the draft shrink the fan-out budget (spec/budget.py)")
    p.add_argument("--enforce-eager", action="store_true", help="on CUDA: no CUDA graphs (the eager baseline)")
    p.add_argument("--no-ngram-rounds", action="store_true",
                   help="ssd: no n-gram proposals in place of the draft's, for whole rounds or single rows "
                        "(Config.ngram_rounds; the ssd-draft system is ssd so)")
    p.add_argument("--interleave", action="store_true",
                   help="open every system of a setting at once and run their repeats in turn (drift falls on all alike)")
    for flag, (field, parse) in {**GRID_OPTIONS, **SWEEP_OPTIONS}.items():  # (by the parser: the name misled, max_new_tokens)
        p.add_argument(flag, dest=field, help="comma-separated list" if parse in (_ints, _floats, _names) else None)
    p.set_defaults(run=run)


def bench_config(args) -> "BenchConfig":
    from saguaro_dist.bench import BenchConfig
    overrides = {f: parse(getattr(args, f)) for f, parse in GRID_OPTIONS.values() if getattr(args, f) is not None}
    return BenchConfig.preset(args.preset, target=args.target, draft=args.draft, out_dir=args.out,
                              plots=not args.no_plots, adaptive_fan_out=args.adaptive_fan_out,
                              enforce_eager=args.enforce_eager, ngram_rounds=not args.no_ngram_rounds,
                              interleave=args.interleave, **overrides)


def sweep_config(args, base) -> "SweepConfig":
    from saguaro_dist.bench import SweepConfig
    overrides = {f: parse(getattr(args, f)) for f, parse in SWEEP_OPTIONS.values() if getattr(args, f) is not None}
    if args.preset == "quick":
        overrides = {"ks": (2, 4), "budgets": (6, 12), "cs": (1.0, 0.5), "fallbacks": ("neural", "fast"), **overrides}
    return SweepConfig(base=base, **overrides)


def serving_config(args, base) -> "ServingConfig":
    """The serving run: our default systems unless --systems names others (ServingConfig rejects transformers')."""
    import dataclasses

    from saguaro_dist.bench.serving import SERVING_SYSTEMS, ServingConfig
    if args.systems is None:
        base = dataclasses.replace(base, systems=SERVING_SYSTEMS)
    return ServingConfig(base=base, rates=args.request_rates, num_requests=args.num_requests)


def remote_config(args, base) -> "RemoteConfig":
    """A serving run against --url: the flags that choose our systems and their hardware are the server's
    business there, so giving one is an error rather than silently unused."""
    import os

    from saguaro_dist.bench.remote import RemoteConfig
    from saguaro_dist.serve.args import API_KEY_ENV
    if not args.request_rates:
        raise ValueError("--url measures serving streams: give --request-rates too")
    ours = [flag for flag, given in (("--systems", args.systems), ("--settings", args.settings), ("--batch", args.batch_sizes),
                                     ("--target", args.target), ("--draft", args.draft)) if given]
    if ours:
        raise ValueError(f"{', '.join(ours)} choose our systems here; with --url the server is measured as it runs")
    return RemoteConfig(args.url, base, args.request_rates, args.num_requests, args.api_key or os.environ.get(API_KEY_ENV),
                        args.model)


def _run_remote(remote: "RemoteConfig", progress: bool) -> dict:
    """run_remote, a server that cannot be reached or refuses the run reported as the error it is (exit 2)."""
    from saguaro_dist.bench.remote import run_remote
    from saguaro_dist.client import SaguaroError
    try:
        return run_remote(remote, progress)
    except SaguaroError as err:
        raise ValueError(f"the server at {remote.url}: {err}") from err


def run(args) -> int:
    from saguaro_dist.bench import run_grid, run_serving, run_sweep
    from saguaro_dist.bench.plots import write_plots
    from saguaro_dist.bench.report import render, write_json
    cfg = bench_config(args)
    out = Path(cfg.out_dir)
    if args.sweep and (args.request_rates or args.url):
        raise ValueError("--sweep and --request-rates (or --url) are two different runs: give one")
    if args.sweep:
        results = run_sweep(sweep_config(args, cfg), progress=not args.no_progress)
    elif args.url:
        results = _run_remote(remote_config(args, cfg), progress=not args.no_progress)
    elif args.request_rates:
        results = run_serving(serving_config(args, cfg), progress=not args.no_progress)
    else:
        results = run_grid(cfg, progress=not args.no_progress)
    print(render(results))
    path = write_json(results, out / RESULT_FILES[results["kind"]])
    plots = write_plots(results, out) if cfg.plots else []
    print(f"\nwrote {path}" + "".join(f", {p}" for p in plots))
    return 0
