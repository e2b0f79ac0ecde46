"""The `saguaro` command. Each subcommand lives in its own module with `register(subparsers)`."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module name -> subcommand; each module defines register(subparsers) and sets a handler via set_defaults(run=...)
SUBCOMMANDS = ("generate", "run_batch", "serve", "bench", "demo", "deploy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro", description="Speculative Speculative Decoding on Ray")
    parser.add_argument("--log-level", type=log_level,
                        help="logging level (DEBUG, INFO, WARNING, ...; default WARNING here, and for `serve` the "
                             "replicas' INFO); `serve` passes a given one to its replicas and the engine's actors")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"saguaro_dist.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"saguaro_dist.cli.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def log_level(text: str) -> str:
    """A level logging knows (logging.basicConfig raised a bare ValueError, with a stack trace, at an unknown one)."""
    if not isinstance(logging.getLevelName(text.upper()), int):
        raise argparse.ArgumentTypeError(f"unknown logging level {text!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return text.upper()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # (None: not given, which `serve` tells apart: its replicas keep Serve's INFO then)
    logging.basicConfig(level=args.log_level or "WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except ValueError as err:  # bad input: a clear message, no stack trace
        print(f"saguaro {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
