"""`--lora-modules` as the server and the deploy settings read them (vLLM's flag): parsed, checked against the
served names, each adapter read against the base model; and the switch for runtime loading. No web framework
here: `saguaro deploy` and the CLI read it where FastAPI is not installed."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

RUNTIME_UPDATE_ENVS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "SAGUARO_ALLOW_RUNTIME_LORA_UPDATING")
RUNTIME_UPDATE_ARG = "allow_runtime_lora_updating"  # the app arg that carries the variable to the replicas
_ENV_TRUE = ("1", "true")  # vLLM's reading of the variable
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")  # the app arg's (`serve run` passes text)


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry (vLLM's LoRAModulePath): `name=path`, or JSON with base_model_name."""
    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self):
        for field in ("name", "path"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field).strip():
                raise ValueError(f"lora_modules: {field} must be a non-empty string, got {getattr(self, field)!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"lora_modules {self.name!r}: base_model_name must be a string, got {self.base_model_name!r}")


def parse_lora_module(item) -> LoRAModule:
    """`name=path`, a JSON object {"name", "path", "base_model_name"?} (or the dict itself), as vLLM's flag."""
    if isinstance(item, LoRAModule):
        return item
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as err:
            raise ValueError(f"lora_modules {item!r}: invalid JSON ({err})") from None
    if isinstance(item, dict):
        unknown = sorted(set(item) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"lora_modules {item!r}: unknown key(s) {', '.join(unknown)} (name, path, base_model_name)")
        return LoRAModule(item.get("name"), item.get("path"), item.get("base_model_name"))
    if isinstance(item, str) and "=" in item:
        name, path = item.split("=", 1)
        return LoRAModule(name.strip(), path.strip())
    raise ValueError(f"lora_modules {item!r}: expected name=path or a JSON object with name and path")


def lora_modules(given) -> tuple[LoRAModule, ...]:
    """The app arg: a list of entries, or (from `serve run` / a manifest) one entry or a JSON list as text."""
    if given is None or given == "" or given == []:
        return ()
    if isinstance(given, str) and given.lstrip().startswith("["):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as err:
            raise ValueError(f"lora_modules {given!r}: invalid JSON ({err})") from None
    items = given if isinstance(given, (list, tuple)) else [given]
    return tuple(parse_lora_module(item) for item in items)


def check_lora_modules(modules: tuple[LoRAModule, ...], base_names: tuple[str, ...], enable_lora: bool) -> None:
    """What needs no files: LoRA on, one name each, none a base model's, a base_model_name that is served."""
    if modules and not enable_lora:
        raise ValueError("lora_modules (--lora-modules) need enable_lora (--enable-lora)")
    seen = set()
    for m in modules:
        if m.name in base_names:
            raise ValueError(f"lora_modules: {m.name!r} is a served model name (--served-model-name); "
                             "an adapter needs a name of its own")
        if m.name in seen:
            raise ValueError(f"lora_modules: the name {m.name!r} is given twice")
        if m.base_model_name is not None and m.base_model_name not in base_names:
            raise ValueError(f"lora_modules {m.name!r}: base_model_name {m.base_model_name!r} is not a served model "
                             f"name ({', '.join(base_names)})")
        seen.add(m.name)


def check_adapter(name: str, path: str, config) -> None:
    """Reads the adapter as the engine will load it into the target (config: the engine Config): a ValueError
    with the reason (no adapter there, a rank above max_lora_rank, shapes the base model lacks, ...)."""
    from saguaro_dist.model.hf_config import load_config
    from saguaro_dist.model.loader import resolve_model_dir
    from saguaro_dist.model.lora_adapter import load_adapter
    try:
        base = load_config(resolve_model_dir(config.model, weights=False, revision=config.revision))
        load_adapter(path, base, config.max_lora_rank)
    except (ValueError, OSError) as err:
        raise adapter_refusal(name, path, err) from None


def adapter_refusal(name: str, path: str, err: Exception) -> ValueError:
    """check_adapter's refusal of the adapter `name` at `path` (also a runtime load's, read by the engine here)."""
    return ValueError(f"LoRA adapter {name!r} ({path}): {err}")


def runtime_updates_allowed(given=None) -> bool:
    """Whether the load / unload routes exist: the app arg allow_runtime_lora_updating (`saguaro serve` resolves
    the variable in its own environment and passes it: replicas may not share that), else vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING (or ours, SAGUARO_...) where this runs (`serve run`, a KubeRay manifest)."""
    if given is None or given == "":
        return any(os.environ.get(name, "0").strip().lower() in _ENV_TRUE for name in RUNTIME_UPDATE_ENVS)
    if isinstance(given, bool):
        return given
    word = str(given).strip().lower()
    if word not in (*_TRUE, *_FALSE):
        raise ValueError(f"{RUNTIME_UPDATE_ARG} must be true or false, got {given!r}")
    return word in _TRUE
