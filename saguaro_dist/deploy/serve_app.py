"""The Serve application KubeRay deploys: its args (parsed by saguaro_dist.serve.args) and serveConfigV2."""
from __future__ import annotations

from typing import TYPE_CHECKING

from saguaro_dist.deploy.constants import APP_IMPORT_PATH, APP_NAME, DEPLOYMENT_NAME, SERVE_PORT
from saguaro_dist.placement import FRONT_RESOURCE, RESOURCE_PER_ACTOR
from saguaro_dist.serve.args import API_KEY_ENV

if TYPE_CHECKING:
    from saguaro_dist.deploy.settings import K8sSettings


def serve_args(s: K8sSettings) -> dict:
    """The app args of serveConfigV2; saguaro_dist.serve.args.config_from_args parses them."""
    draft, draft_revision = (s.draft, s.draft_revision) if s.uses_draft else (None, None)
    args = {"model": s.model, "draft": draft, "revision": s.revision, "draft_revision": draft_revision,
            "tokenizer": s.tokenizer, "tokenizer_revision": s.tokenizer_revision,
            "mode": s.mode, "k": s.k,
            # the engine's ranks and drafts run as Ray actors on the pods made for them, whatever their counts:
            # without it a pool of one of each ran a one-host engine inside the Serve replica's process
            "cluster": "auto",
            "fan_out": list(s.fan_out) if isinstance(s.fan_out, tuple) else s.fan_out,
            "saguaro_c": s.saguaro_c, "fallback": s.fallback,
            "tensor_parallel_size": s.tp, "num_draft_workers": s.draft_workers,
            "max_batch_size": s.max_batch_size, "max_model_len": s.max_model_len,
            "gpu_memory_utilization": s.gpu_memory_utilization, "device": s.device, "dtype": s.engine_dtype,
            "api_key_env": API_KEY_ENV, "served_model_name": _plain(s.served_model_name),
            "tool_call_parser": s.tool_call_parser, "reasoning_parser": s.reasoning_parser,
            "scheduling_policy": None if s.scheduling_policy == "fcfs" else s.scheduling_policy,
            "generation_config": None if s.generation_config == "auto" else s.generation_config,
            "chat_template": s.chat_template, **_serve_flag_args(s), **_speculation_args(s), **_frontend_args(s)}
    return {key: value for key, value in args.items() if value is not None}


def _plain(value):
    """Tuples (the settings keep lists as tuples) as lists: YAML and the app read lists."""
    return list(value) if isinstance(value, tuple) else value


def _serve_flag_args(s: K8sSettings) -> dict:
    """`saguaro serve`'s engine and server flags as app args (their Config / server option names): each
    only where the settings leave the app's default, so a manifest names what was chosen."""
    return {"max_num_batched_tokens": s.max_num_batched_tokens,
            "enable_prefix_caching": None if s.enable_prefix_caching else False,
            "enforce_eager": True if s.enforce_eager else None,
            "log_stats_interval_s": 0.0 if s.disable_log_stats else None,
            "seed": s.seed,
            "max_request_bytes": s.max_request_bytes, "stream_interval_ms": s.stream_interval_ms,
            "log_requests": True if s.enable_log_requests else None, "otlp_traces_endpoint": s.otlp_traces_endpoint,
            "collect_detailed_traces": _plain(s.collect_detailed_traces),
            "enable_lora": True if s.enable_lora else None, "max_loras": s.max_loras, "max_lora_rank": s.max_lora_rank,
            "max_cpu_loras": s.max_cpu_loras, "lora_modules": [lora_module_arg(m) for m in s.lora_modules] or None}


def lora_module_arg(m) -> dict:
    """One lora_modules app arg: vLLM's JSON form ({name, path[, base_model_name]})."""
    return {"name": m.name, "path": m.path, **({"base_model_name": m.base_model_name} if m.base_model_name else {})}


def _speculation_args(s: K8sSettings) -> dict:
    """--proposal-top-k, --prompt-lookup-max / -min and --speculative-config, where given. The fields a
    speculative_config sets are already the settings' (mode, draft, k...); it goes in as given, and the app
    checks that it agrees with them, as `saguaro serve` does."""
    return {"proposal_top_k": s.proposal_top_k or None,
            "prompt_lookup_max": s.prompt_lookup_max, "prompt_lookup_min": s.prompt_lookup_min,
            "speculative_config": dict(s.speculative_config) if s.speculative_config is not None else None}


def _frontend_args(s: K8sSettings) -> dict:
    """`saguaro serve`'s HTTP-frontend flags as app args (serve/frontend.py), each where it leaves the default."""
    return {"allowed_origins": _plain(s.allowed_origins), "allowed_methods": _plain(s.allowed_methods),
            "allowed_headers": _plain(s.allowed_headers),
            "allow_credentials": True if s.allow_credentials else None, "root_path": s.root_path,
            "disable_fastapi_docs": True if s.disable_fastapi_docs else None, "response_role": s.response_role}


def replica_actor_options() -> dict:
    """The Serve replica's ray_actor_options on KubeRay: the target pod's FRONT_RESOURCE slot, beside Serve's
    default CPU. Serve's SPREAD put it on a draft pod about N/(N+1) of the time; there it took a CPU pod's only
    CPU from the draft worker, and as the owner of the target's ranks it died with that pod, ranks and all."""
    return {"num_cpus": 1, "resources": {FRONT_RESOURCE: RESOURCE_PER_ACTOR}}


def serve_config(s: K8sSettings) -> dict:
    """The Serve config (ray.serve.schema.ServeDeploySchema) that KubeRay deploys. The deployment's options
    here replace the app's ray_actor_options whole: on a cluster the app sets none (serve/app.py)."""
    app = {"name": APP_NAME, "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": serve_args(s),
           "deployments": [{"name": DEPLOYMENT_NAME, "ray_actor_options": replica_actor_options()}]}
    return {"proxy_location": "EveryNode",
            "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
            "applications": [app]}
