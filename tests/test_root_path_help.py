"""--root-path's help says what the flag does since the app composes it with a Serve route_prefix
(serve/middleware.py RootPathMiddleware), not FastAPI's root_path, which would replace that prefix."""
from __future__ import annotations

import argparse

from saguaro_dist.cli import build_parser


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[name]
    return parser


def _root_path_help(*command: str) -> str:
    action = next(a for a in _subparser(build_parser(), *command)._actions if "--root-path" in a.option_strings)
    return action.help


def test_serve_root_path_help_names_its_composition_with_the_serve_route_prefix():
    text = _root_path_help("serve")
    assert "FastAPI" not in text
    assert "reverse proxy" in text and "route_prefix" in text


def test_deploy_root_path_help_is_the_ingress_prefix_not_fastapis_root_path():
    text = _root_path_help("deploy", "k8s")
    assert "FastAPI" not in text
    assert "Ingress" in text and "-serve:8000" in text
