"""Helm values for deploy/helm/saguaro-dist that render the same objects as a K8sSettings."""
from __future__ import annotations

from saguaro_dist.deploy.serve_app import lora_module_arg
from saguaro_dist.deploy.settings import K8sSettings


def _split_image(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:  # no tag, or the colon was a registry port
        return image, "latest"
    return repository, tag


JSON_SAFE_INT = 2**53 - 1  # Helm reads values' numbers as float64: a larger integer changes on the way


def _names(served_model_name) -> str | list[str]:
    """One served model name as a string ("" = the model's), several as a list."""
    return list(served_model_name) if isinstance(served_model_name, tuple) else served_model_name or ""


def _frontend_values(s: K8sSettings) -> dict:
    """The HTTP-frontend values (server.*): null / false / "" = the app's defaults."""
    def listed(value):
        return None if value is None else list(value)
    return {"allowedOrigins": listed(s.allowed_origins), "allowedMethods": listed(s.allowed_methods),
            "allowedHeaders": listed(s.allowed_headers), "allowCredentials": s.allow_credentials,
            "rootPath": s.root_path or "", "disableFastapiDocs": s.disable_fastapi_docs,
            "responseRole": s.response_role or ""}


def helm_values(s: K8sSettings) -> dict:
    """Values for deploy/helm/saguaro-dist that render the same objects as these settings."""
    if s.seed is not None and abs(s.seed) > JSON_SAFE_INT:
        raise ValueError(f"seed {s.seed} is beyond what Helm's values carry exactly (|seed| <= 2**53 - 1); "
                         f"the chart's schema refuses it: use `saguaro deploy k8s`, which takes any int64")
    repository, tag = _split_image(s.container_image)
    return {"fullnameOverride": s.name,
            "image": {"repository": repository, "tag": tag, "pullPolicy": s.image_pull_policy or "",
                      "pullSecrets": list(s.image_pull_secrets)},
            "model": _model_values(s), "speculation": _speculation_values(s), "engine": _engine_values(s),
            "server": {"maxRequestBytes": s.max_request_bytes or 0, "streamIntervalMs": s.stream_interval_ms,
                       "enableLogRequests": s.enable_log_requests, "otlpTracesEndpoint": s.otlp_traces_endpoint or "",
                       "collectDetailedTraces": list(s.collect_detailed_traces or ()),
                       **_frontend_values(s)},
            "lora": {"enable": s.enable_lora, "modules": [lora_module_arg(m) for m in s.lora_modules],
                     "maxLoras": s.max_loras, "maxLoraRank": s.max_lora_rank, "maxCpuLoras": s.max_cpu_loras},
            **_cluster_values(s)}


def _draft_value(s: K8sSettings) -> str | None:
    """model.draft: "" = none. Beside an ngram speculative_config null (not given), as the chart refuses a
    draft given beside one, as K8sSettings does; the settings keep the default draft there, unused."""
    if s.speculative_config is not None and not s.uses_draft:
        return None
    return s.draft or ""


def _model_values(s: K8sSettings) -> dict:
    return {"target": s.model, "draft": _draft_value(s), "servedModelName": _names(s.served_model_name),
            "toolCallParser": s.tool_call_parser or "", "reasoningParser": s.reasoning_parser or "",
            "generationConfig": s.generation_config, "chatTemplate": s.chat_template or "",
            "revision": s.revision or "", "draftRevision": s.draft_revision or "",
            "tokenizer": s.tokenizer or "", "tokenizerRevision": s.tokenizer_revision or ""}


def _speculation_values(s: K8sSettings) -> dict:
    """The settings' speculation fields are what speculative_config resolved to: the chart finds them agreeing."""
    return {"mode": s.mode, "k": s.k, "saguaroC": s.saguaro_c, "fallback": s.fallback,
            "fanOut": list(s.fan_out) if isinstance(s.fan_out, tuple) else s.fan_out,
            "proposalTopK": s.proposal_top_k, "promptLookupMax": s.prompt_lookup_max,
            "promptLookupMin": s.prompt_lookup_min,
            "speculativeConfig": None if s.speculative_config is None else dict(s.speculative_config)}


def _engine_values(s: K8sSettings) -> dict:
    return {"maxBatchSize": s.max_batch_size, "maxModelLen": s.max_model_len or 0,
            "gpuMemoryUtilization": s.gpu_memory_utilization, "dtype": s.dtype or "",
            "schedulingPolicy": s.scheduling_policy, "maxNumBatchedTokens": s.max_num_batched_tokens or 0,
            "enablePrefixCaching": s.enable_prefix_caching, "enforceEager": s.enforce_eager,
            "disableLogStats": s.disable_log_stats, "seed": s.seed}


def _cluster_values(s: K8sSettings) -> dict:
    """The Ray cluster's shape and the Kubernetes objects around it."""
    return {"gpu": {"enabled": s.gpu, "type": s.gpu_type or ""},
            "head": {"resources": {"cpu": s.head_cpu, "memory": s.head_memory}},
            "target": {"tensorParallelSize": s.tp, "resources": {"cpu": s.target_cpu, "memory": s.target_memory}},
            "draft": {"workers": s.draft_workers, "resources": {"cpu": s.draft_cpu, "memory": s.draft_memory}},
            "autoscaling": {"enabled": s.autoscaling, "draftMaxWorkers": s.draft_max_workers or 0},  # (fixed pool)
            "apiKey": {"secretName": s.api_key_secret, "secretKey": s.api_key_secret_key},
            "hfToken": {"secretName": s.hf_token_secret or "", "secretKey": s.hf_token_secret_key},
            "modelStorage": {"pvc": s.models_pvc or ""},
            "upgradeStrategy": s.upgrade_strategy,
            "termination": {"drainTimeoutSeconds": s.drain_timeout_s}, "extraEnv": dict(s.extra_env),
            "gcsFaultTolerance": {"redisAddress": s.gcs_ft_redis_address or "",
                                  "redisPassword": {"secretName": s.gcs_ft_redis_password_secret or "",
                                                    "secretKey": s.gcs_ft_redis_password_secret_key}}}
