"""The Serve application's arguments (as `serve run` YAML, KubeRay serveConfigV2 or the CLI pass them)
turned into an engine Config. One parser for every entry point, so a manifest that parses here runs."""
from __future__ import annotations

import dataclasses
import json
import os

from saguaro_dist.config import Config
from saguaro_dist.serve.frontend import FRONTEND_ARGS
from saguaro_dist.speculative_config import as_dict, config_fields

API_KEY_ENV = "SAGUARO_API_KEY"
# Serve-only arguments: everything else must be a Config field.
SERVE_ONLY_ARGS = {"api_key", "api_key_env", "served_model_name", "max_request_bytes", "stream_interval_ms",
                   "tool_call_parser", "reasoning_parser", "log_requests", "chat_template", "response_role", "lora_modules",
                   "allow_runtime_lora_updating", "otlp_traces_endpoint", "collect_detailed_traces", *FRONTEND_ARGS}
_NUMBERS = {"int": int, "float": float}
_BOOLS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}
POOL_FIELDS = ("tensor_parallel_size", "num_draft_workers")  # more than one of either runs the engine on Ray


def coerce(name: str, value, default, annotation: str = ""):
    """`serve run app:build_app k=4` passes strings: convert them to the field's type. One that is not of
    that type is a ValueError naming the field and the type (not int()'s "invalid literal for int()")."""
    if not isinstance(value, str):
        return value
    if default is None and value.strip().lower() in ("none", "null", ""):
        return None
    try:
        return _converted(name, value, default, annotation)
    except ValueError:
        raise ValueError(f"{name} must be {_kind(name, default, annotation)}") from None


def _converted(name: str, value: str, default, annotation: str):
    if name == "fan_out":
        parts = [int(v) for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        return parts[0] if len(parts) == 1 else parts
    if isinstance(default, bool):
        word = value.strip().lower()
        if word not in _BOOLS:  # any other word read as False: `adaptive_fan_out: flase` turned it off
            raise ValueError(word)
        return _BOOLS[word]
    if isinstance(default, (int, float)):
        return type(default)(value)
    if isinstance(default, dict):
        return json.loads(value)
    if default is None and annotation.startswith(("int", "float")):  # optional numbers, e.g. max_model_len
        return _NUMBERS[annotation.split()[0]](value)
    return value


def _kind(name: str, default, annotation: str) -> str:
    """What a field's string must spell, for coerce's error."""
    if name == "fan_out":
        return "an integer or comma-separated integers"
    if isinstance(default, bool):
        return "true or false (yes / no, on / off, 1 / 0)"
    if isinstance(default, dict):
        return "a JSON object"
    return "a number" if isinstance(default, float) or annotation.startswith("float") else "an integer"


def config_from_args(args: dict) -> Config:
    """Build and validate the engine Config from app args; unknown keys are a ValueError naming them."""
    args = with_speculative_config(args)
    if not args.get("draft") and "mode" not in args:
        args = {**args, "mode": "ar"}  # a lone target decodes autoregressively (LLM(model), `saguaro serve MODEL`)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    unknown = sorted(set(args) - set(fields) - SERVE_ONLY_ARGS)
    if unknown:
        raise ValueError(f"unknown saguaro app argument(s): {', '.join(unknown)}")
    if "model" not in args:
        raise ValueError("saguaro app arguments need 'model'")
    values = {name: _field_value(fields[name], value) for name, value in args.items() if name in fields}
    if "cluster" not in values and any(_number(values.get(name)) > 1 for name in POOL_FIELDS):
        values["cluster"] = "auto"  # as the CLI's flags: a manifest's pools run on the cluster the app runs on
    return Config(**values)


def with_speculative_config(args: dict) -> dict:
    """vLLM's speculative_config (a dict, or its JSON text from `--speculative-config` or a manifest) replaced by
    the Config fields it names (speculative_config.config_fields): a value that contradicts another argument is
    refused there. The other arguments are compared as their fields' types ("4" from `serve run` is 4)."""
    spec, rest = args.get("speculative_config"), {k: v for k, v in args.items() if k != "speculative_config"}
    if spec is None:
        return rest
    fields = {f.name: f for f in dataclasses.fields(Config)}
    given = {name: _field_value(fields[name], value) for name, value in rest.items() if name in fields}
    return {**rest, **config_fields(as_dict(spec), given)}


def _field_value(f: dataclasses.Field, value):
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    try:
        return coerce(f.name, value, default, str(f.type))
    except (TypeError, ValueError) as err:
        raise ValueError(f"app argument {f.name}={value!r}: {err}") from None


def _number(value) -> float:
    """A pool size as given, for comparing with 1 (Config refuses what is no integer)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def served_model_names(given, model: str) -> tuple[str, ...]:
    """--served-model-name: one name or several (vLLM's: requests may give any, replies name the first)."""
    if given is not None and not isinstance(given, (str, list, tuple)):  # list(5): a TypeError's traceback
        raise ValueError(f"served_model_name must be a non-empty name or a list of them, got {given!r}")
    names = [given] if isinstance(given, str) else list(given or [])
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name must be a non-empty name or a list of them, got {given!r}")
    return tuple(names) or (str(model),)


def api_key_from_args(args: dict) -> tuple[str, ...] | None:
    """The API keys (any one authenticates, as vLLM's --api-key K1 K2): given directly, or read from the
    environment variable the args name. A variable named (api_key_env, SAGUARO_API_KEY included: the manifests
    name it) but unset or empty is an error: the server would take every request unauthenticated, unsaid (a VM
    container that never got the key). None named: $SAGUARO_API_KEY if set, else no key (vLLM's VLLM_API_KEY)."""
    keys = args.get("api_key")
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys] if keys else []
    if not all(isinstance(k, str) and k.strip() for k in keys):  # an empty one would be no key at all
        raise ValueError("api_key must be a non-empty key or a list of them (the keys are not shown)")
    if keys:
        return tuple(keys)
    name = args.get("api_key_env")
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise ValueError(f"api_key_env must name an environment variable, got {name!r}")
    if name and not os.environ.get(name, "").strip():
        raise ValueError(f"api_key_env names ${name}, which is unset or empty: set it, or drop api_key_env to "
                         "serve without a key")
    key = os.environ.get(name or API_KEY_ENV)
    return (key,) if key else None
