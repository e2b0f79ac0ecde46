"""`saguaro bench`: the grid (systems x settings x batch x temperature), the SSD sweep, or our systems serving
request streams (--request-rates); table, JSON, PNGs."""
from __future__ import annotations

import argparse
import logging
import sys
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
    """Requests a second, comma-separated; "inf" for all at once (ServingConfig checks that they are > 0). None
    given ("", ",") is refused: it read as no --request-rates at all, and the whole grid ran instead."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        rates = ()
    if not rates:
        raise argparse.ArgumentTypeError(f"request rates are requests a second, comma-separated (inf: all at once), "
                                         f"at least one; got {text!r}")
    return rates


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


EXPECTED = {int: "an integer", float: "a number", _ints: "comma-separated integers", _floats: "comma-separated numbers"}


def _parsed(args, options: dict) -> dict:
    """field -> value of the options given; one that does not parse is an error naming its option (int()'s
    "invalid literal for int() with base 10: 'x'" named none)."""
    values = {}
    for flag, (field, parse) in options.items():
        text = getattr(args, field)
        if text is not None:
            try:
                values[field] = parse(text)
            except ValueError:
                raise ValueError(f"{flag} expects {EXPECTED[parse]}, got {text!r}") from None
    return values


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
NUM_REQUESTS = 32  # requests a serving stream, --num-requests left out
OPTION_FLAGS = {**{field: flag for flag, (field, _) in {**GRID_OPTIONS, **SWEEP_OPTIONS}.items()},
                "num_requests": "--num-requests", "api_key": "--api-key", "model": "--model", "target": "--target",
                "draft": "--draft", "adaptive_fan_out": "--adaptive-fan-out", "enforce_eager": "--enforce-eager",
                "no_ngram_rounds": "--no-ngram-rounds", "interleave": "--interleave"}
OURS_RUNS = ("grid", "sweep", "serving")  # the runs of our systems here (--url measures a server)
# option dest -> the runs that use it (the others' options apply to every run)
RUN_OPTIONS = {"systems": ("grid", "serving"), "settings": ("grid", "serving"), "batch_sizes": ("grid", "serving"),
               "temperatures": ("grid", "serving", "url"), "num_prompts": ("grid", "sweep"),
               "interleave": ("grid", "serving"), "num_requests": ("serving", "url"), "api_key": ("url",),
               "model": ("url",),
               **dict.fromkeys(("target", "draft", "k", "fan_out", "fan_out_kind", "saguaro_c", "proposal_top_k",
                                "fallback", "tree_policy", "hit_glue", "bonus_draw", "cores", "device", "dtype",
                                "adaptive_fan_out", "enforce_eager", "no_ngram_rounds"), OURS_RUNS),
               **dict.fromkeys((field for field, _ in SWEEP_OPTIONS.values()), ("sweep",))}
RUN_NAMES = {"grid": "the grid (no --sweep, --request-rates or --url)",
             "sweep": "--sweep (it runs --sweep-system at --sweep-batch, --sweep-temperature, --sweep-setting)",
             "serving": "--request-rates without --url (it streams --num-requests requests to our systems)",
             "url": "--url (they choose our systems here; the server is measured as it runs)"}


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark SSD against AR, SD and transformers (table, JSON, plots)",
                              description=__doc__)
    p.add_argument("--preset", choices=("full", "quick"), default="full", help="grid defaults (quick: CI-sized)")
    p.add_argument("--sweep", action="store_true", help="sweep k, fan-out budget x kind, Saguaro C, fallback instead")
    p.add_argument("--request-rates", type=_rates, help="serve a stream of requests at each rate (requests/s, "
                   "comma-separated; inf: all at once) to our systems instead of the grid: throughput, TTFT, TPOT; "
                   "at most max(--batch) running; default systems ar,sd,ngram,ssd")
    p.add_argument("--num-requests", type=int, help=f"requests a serving stream (--request-rates; default {NUM_REQUESTS})")
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
    overrides = _parsed(args, GRID_OPTIONS)
    return BenchConfig.preset(args.preset, target=args.target, draft=args.draft, out_dir=args.out,
                              plots=not args.no_plots, adaptive_fan_out=args.adaptive_fan_out,
                              enforce_eager=args.enforce_eager, ngram_rounds=not args.no_ngram_rounds,
                              interleave=args.interleave, **overrides)


def sweep_config(args, base) -> "SweepConfig":
    from saguaro_dist.bench import SweepConfig
    overrides = _parsed(args, SWEEP_OPTIONS)
    small = [b for b in overrides.get("budgets", ()) if b < base.k + 1]
    if small:  # (a preset's budgets below it are skipped: the points() rule)
        raise ValueError(f"--sweep-budgets {','.join(map(str, small))}: a fan-out budget spreads over the k+1 = "
                         f"{base.k + 1} positions of a round (--k {base.k}), so it must be at least {base.k + 1}")
    if args.preset == "quick":
        overrides = {"ks": (2, 4), "budgets": (6, 12), "cs": (1.0, 0.5), "fallbacks": ("neural", "fast"), **overrides}
    return SweepConfig(base=base, **overrides)


def serving_config(args, base) -> "ServingConfig":
    """The serving run: our default systems unless --systems names others (ServingConfig rejects transformers')."""
    import dataclasses

    from saguaro_dist.bench.serving import SERVING_SYSTEMS, ServingConfig
    if args.systems is None:
        base = dataclasses.replace(base, systems=SERVING_SYSTEMS)
    return ServingConfig(base=base, rates=args.request_rates, num_requests=_num_requests(args))


def _num_requests(args) -> int:
    return NUM_REQUESTS if args.num_requests is None else args.num_requests


def remote_config(args, base) -> "RemoteConfig":
    """A serving run against --url (run_kind and check_run_options refused what it would leave unused)."""
    import os

    from saguaro_dist.bench.remote import RemoteConfig
    from saguaro_dist.serve.args import API_KEY_ENV
    return RemoteConfig(args.url, base, args.request_rates, _num_requests(args),
                        args.api_key or os.environ.get(API_KEY_ENV), args.model)


def run_kind(args) -> str:
    """grid, sweep, serving or url: the run the flags ask for."""
    rates = args.request_rates is not None  # (given, even if empty: ServingConfig refuses no rates, not the grid)
    if args.sweep and (rates or args.url):
        raise ValueError("--sweep and --request-rates (or --url) are two different runs: give one")
    if args.url and not rates:
        raise ValueError("--url measures serving streams: give --request-rates too")
    return "sweep" if args.sweep else "url" if args.url else "serving" if rates else "grid"


def check_run_options(args, kind: str) -> None:
    """Options the run leaves unused are an error, not dropped: --sweep-ks without --sweep, --systems with
    --sweep or --url, --num-requests without --request-rates, ..."""
    from saguaro_dist.cli.flag_checks import given
    unused = [OPTION_FLAGS[d] for d in given(args, RUN_OPTIONS, unset=(None, False)) if kind not in RUN_OPTIONS[d]]
    if unused:
        raise ValueError(f"{', '.join(unused)}: unused by {RUN_NAMES[kind]}")


def check_system_options(args, systems: tuple[str, ...]) -> None:
    """Options none of the run's systems uses: --draft with ar and hf alone, SSD's knobs without an SSD system."""
    from saguaro_dist.bench.config import SPECULATIVE, SSD_SYSTEMS
    from saguaro_dist.cli.flag_checks import given
    drafting, ours_drafting = ("sd", *SSD_SYSTEMS, "hf-assisted"), ("sd", *SSD_SYSTEMS)
    users = {"draft": drafting, "k": SPECULATIVE, "proposal_top_k": ours_drafting,
             **dict.fromkeys(("fan_out", "fan_out_kind", "saguaro_c", "fallback", "tree_policy", "hit_glue",
                              "bonus_draw", "adaptive_fan_out", "no_ngram_rounds"), SSD_SYSTEMS)}
    unused = [d for d in given(args, users, unset=(None, False)) if not set(systems) & set(users[d])]
    if unused:
        raise ValueError("; ".join(f"{OPTION_FLAGS[d]} applies only to systems {', '.join(users[d])}" for d in unused)
                         + f"; this run's are {', '.join(systems)}")


def _run_remote(remote: "RemoteConfig", progress: bool) -> dict:
    """run_remote, a server that cannot be reached or refuses the run reported as the error it is (exit 2)."""
    from saguaro_dist.bench.remote import run_remote
    from saguaro_dist.client import SaguaroError
    try:
        return run_remote(remote, progress)
    except SaguaroError as err:
        raise ValueError(f"the server at {remote.url}: {err}") from err


def run(args) -> int:
    from saguaro_dist.bench.plots import write_plots
    from saguaro_dist.bench.report import render, write_json
    kind = run_kind(args)
    check_run_options(args, kind)
    cfg = bench_config(args)
    check_out_dir(Path(cfg.out_dir))
    results = _run(args, kind, cfg)
    print(render(results))
    out = Path(cfg.out_dir)
    path = write_json(results, out / RESULT_FILES[results["kind"]])
    plots = write_plots(results, out) if cfg.plots else []
    print(f"\nwrote {path}" + "".join(f", {p}" for p in plots))
    return failed_exit_code(results)


def check_out_dir(out: Path) -> None:
    """--out checked before any run (it failed after the whole run, nothing written): a directory, or one that
    can be made in the nearest folder that exists. Nothing is made here: a run refused later leaves no folder."""
    import os
    existing = out.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {existing} is not writable")


def failed_exit_code(results: dict) -> int:
    """1 when a cell failed (its error is in the results, which are written anyway): a script or CI job that
    runs the bench learns of it without reading the JSON; else 0."""
    errors = results.get("errors") or []
    if errors:
        print(f"{len(errors)} cell(s) failed (the FAILED lines above; `errors` in the JSON)", file=sys.stderr)
    return 1 if errors else 0


def _run(args, kind: str, cfg: "BenchConfig") -> dict:
    from saguaro_dist.bench import run_grid, run_serving, run_sweep
    progress = not args.no_progress
    if kind == "url":
        return _run_remote(remote_config(args, cfg), progress)
    if kind == "sweep":
        sweep = sweep_config(args, cfg)
        check_system_options(args, (sweep.system,))
        return run_sweep(sweep, progress=progress)
    if kind == "serving":
        serving = serving_config(args, cfg)
        check_system_options(args, serving.base.systems)
        return run_serving(serving, progress=progress)
    check_system_options(args, cfg.systems)
    return run_grid(cfg, progress=progress)
