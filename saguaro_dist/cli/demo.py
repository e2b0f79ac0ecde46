"""`saguaro demo build`: reproduce the shipped demo model pair."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="the demo model pair (stdlib-trained Llama target + draft)")
    actions = demo.add_subparsers(dest="demo_command", required=True)
    build = actions.add_parser("build", help="train the demo pair (seeded, resumable, 1 CPU thread)")
    build.add_argument("--out", default=None, help="where the pair goes (default: the package's demo/pair)")
    build.add_argument("--work", default=".demo-build", help="scratch dir for tokenizer, token caches and checkpoints")
    budget = build.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="target training steps (default: the recipe's)")
    budget.add_argument("--minutes", type=float, default=None, help="wall-clock training budget instead of steps")
    build.add_argument("--draft-steps", type=int, default=None, help="draft distillation steps (default: the recipe's)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--resume", action="store_true", help="continue from the checkpoints in --work")
    build.set_defaults(run=run_build)


def recipe_from_args(args: argparse.Namespace):
    from saguaro_dist.demo.build import Recipe, check_recipe

    for flag in ("out", "work"):  # Path("") is the current folder: --out "" fell back to the packaged pair
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise ValueError(f"--{flag} is empty; name a folder")
    if args.minutes is not None and not (math.isfinite(args.minutes) and args.minutes > 0):
        raise ValueError(f"--minutes must be a positive number, got {args.minutes}")  # nan ran zero steps
    if args.minutes is not None and args.draft_steps is not None:
        raise ValueError("--draft-steps has no effect with --minutes (the budget sets both models' steps)")
    recipe = Recipe(seed=args.seed, minutes=args.minutes)
    if args.steps is not None:
        recipe = dataclasses.replace(recipe, target_steps=args.steps)
    if args.draft_steps is not None:
        recipe = dataclasses.replace(recipe, draft_steps=args.draft_steps)
    for flag, field in (("--steps", "target_steps"), ("--draft-steps", "draft_steps")):
        value = getattr(recipe, field)
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    check_recipe(recipe)  # a --seed too large for torch failed only after the tokenizer and token caches
    return recipe


def run_build(args: argparse.Namespace) -> int:
    from saguaro_dist.demo.build import PAIR_DIR, build

    recipe = recipe_from_args(args)
    try:
        report = build(recipe, out=PAIR_DIR if args.out is None else args.out, work=args.work, resume=args.resume)
    except KeyboardInterrupt:  # the exit is silent (130): say how not to lose the hours already trained
        log.warning("interrupted; the same command with --resume continues from the checkpoints in %s "
                    "(saved every %g minutes)", args.work, recipe.checkpoint_minutes)
        raise
    summary = {k: report[k] for k in ("params", "steps", "heldout_loss", "greedy", "build_minutes")}
    print(json.dumps(summary, indent=1))
    return 0
