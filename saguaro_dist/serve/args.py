"""The Serve application's arguments (as `serve run` YAML, KubeRay serveConfigV2 or the CLI pass them)
turned into an engine Config. One parser for every entry point, so a manifest that parses here runs."""
from __future__ import annotations

import dataclasses
import os

from saguaro_dist.config import Config

API_KEY_ENV = "SAGUARO_API_KEY"
# Serve-only arguments: everything else must be a Config field.
SERVE_ONLY_ARGS = {"api_key", "api_key_env", "served_model_name", "max_request_bytes"}


def config_from_args(args: dict) -> Config:
    """Build and validate the engine Config from app args; unknown keys are a ValueError naming them."""
    config_fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(args) - config_fields - SERVE_ONLY_ARGS)
    if unknown:
        raise ValueError(f"unknown saguaro app argument(s): {', '.join(unknown)}")
    if "model" not in args:
        raise ValueError("saguaro app arguments need 'model'")
    return Config(**{k: v for k, v in args.items() if k in config_fields})


def api_key_from_args(args: dict) -> str | None:
    """The API key: given directly, or read from the environment variable the args name."""
    if args.get("api_key"):
        return str(args["api_key"])
    return os.environ.get(args.get("api_key_env") or API_KEY_ENV) or None
