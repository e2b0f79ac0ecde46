"""`saguaro deploy k8s`: print KubeRay manifests (a RayService by default) as YAML on stdout."""
from __future__ import annotations

import argparse
import sys

from saguaro_dist.cli.lora_flags import add_lora_args
from saguaro_dist.cli.flag_checks import check_mode_flags, flag_name, given, refuse_without
from saguaro_dist.cli.frontend_flags import json_list_arg
from saguaro_dist.config import DTYPES, FallbackPolicy, Mode
from saguaro_dist.deploy import k8s
from saguaro_dist.deploy.draft_pool import check_fixed_draft_pool
from saguaro_dist.deploy.settings import check_subdomain
from saguaro_dist.serve.reasoning import ReasoningParser
from saguaro_dist.serve.tool_parsers import ToolCallParser

DEFAULTS = k8s.K8sSettings()
BUILDERS = {"rayservice": k8s.rayservice, "raycluster": k8s.raycluster, "serve-config": k8s.serve_config}
KINDS = sorted([*BUILDERS, "batch-job"])  # batch-job is built from the --batch-* options too (_batch_job)
BATCH_FILES = {"batch_input": "requests.jsonl", "batch_output": "results.jsonl"}  # the --batch-* files' defaults


def register(subparsers) -> None:
    deploy = subparsers.add_parser("deploy", help="deployment manifests")
    targets = deploy.add_subparsers(dest="deploy_target", required=True)
    parser = targets.add_parser("k8s", help="KubeRay RayService / RayCluster YAML (for users without Helm)",
                                description="Write KubeRay manifests to stdout: saguaro deploy k8s ... > rayservice.yaml")
    _add_model_options(parser)
    _add_serve_flag_options(parser)
    _add_speculation_options(parser)
    _add_frontend_options(parser)
    add_lora_args(parser)  # `saguaro serve`'s LoRA flags (vLLM's)
    _add_cluster_options(parser)
    _add_output_options(parser)
    parser.set_defaults(run=run)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default=DEFAULTS.name, help="RayService name (and prefix of its Services)")
    parser.add_argument("--model", default=DEFAULTS.model, help="target model: HF id or a path under /models")
    parser.add_argument("--draft", help=f"draft model (default {DEFAULTS.draft}; --mode sd and ssd only: ar and "
                                        "ngram run none)")
    parser.add_argument("--revision", help="the target's Hub revision: a branch, tag or commit (default main)")
    parser.add_argument("--draft-revision", help="the draft's Hub revision")
    parser.add_argument("--tokenizer", help="a tokenizer (HF id or a path under /models) instead of the target's own")
    parser.add_argument("--tokenizer-revision", help="the tokenizer's Hub revision")
    parser.add_argument("--mode", choices=[m.value for m in Mode],
                        help=f"ar and ngram run no draft: no draft pods, --draft unused (default {DEFAULTS.mode})")
    parser.add_argument("--k", type=int, help=f"speculation length K (default {DEFAULTS.k})")
    parser.add_argument("--fan-out", type=_fan_out,
                        help=f"ssd: branch budget B, or K+1 comma-separated fan-outs F_0,...,F_K (default {DEFAULTS.fan_out})")
    parser.add_argument("--saguaro-c", type=float, help=f"ssd (default {DEFAULTS.saguaro_c})")
    parser.add_argument("--fallback", choices=[f.value for f in FallbackPolicy], help=f"ssd (default {DEFAULTS.fallback})")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULTS.max_batch_size)
    parser.add_argument("--max-model-len", type=int, help="default: the model's own context")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULTS.gpu_memory_utilization,
                        help="share of the GPU's memory (of the pod's on CPU) the engine may use; the KV cache's "
                             "worst case, max-batch-size x max-model-len, must fit what the weights leave of it")
    parser.add_argument("--scheduling-policy", default=DEFAULTS.scheduling_policy, choices=["fcfs", "priority"],
                        help="priority: requests' `priority` field orders the waiting queue (lower first)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on GPU, float32 on CPU; auto: each checkpoint's own (vLLM's)")
    parser.add_argument("--served-model-name", nargs="+",
                        help="model name the OpenAI API reports (default: --model); several: requests may give any, "
                             "replies name the first")
    _add_reply_parser_options(parser)
    parser.add_argument("--generation-config", default=DEFAULTS.generation_config,
                        help="requests' sampling defaults: auto (the model's generation_config.json, as vLLM), "
                             "vllm (none), or a folder in the image / under /models")
    parser.add_argument("--chat-template",
                        help="a Jinja chat template, or a local file of one: its text goes into the manifest")


def _add_reply_parser_options(parser: argparse.ArgumentParser) -> None:
    """How the replicas read tool calls and reasoning out of replies (vLLM's parsers)."""
    parser.add_argument("--tool-call-parser", choices=[p.value for p in ToolCallParser],
                        help='read tool_choice "auto" replies in this format (hermes: Qwen 2.5 / 3, Hermes; '
                             'llama3_json: Llama 3.1-3.3; mistral; qwen3_coder: Qwen3-Coder; pythonic: Llama 3.2 / 4; '
                             'openai: gpt-oss)')
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                        help='vLLM\'s: tool_choice "auto" (on whenever --tool-call-parser is given; accepted so vLLM '
                             'command lines carry over)')
    parser.add_argument("--reasoning-parser", choices=[p.value for p in ReasoningParser],
                        help="return <think> text (gpt-oss: its analysis channel) as the chat message's reasoning "
                             "(qwen3, deepseek_r1, openai_gptoss)")


def _add_serve_flag_options(parser: argparse.ArgumentParser) -> None:
    """`saguaro serve`'s engine and server flags, same names and meaning; left out, the app's defaults."""
    g = parser.add_argument_group("engine and server (as `saguaro serve`)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens an engine step prefills; longer prompts run in chunks between rounds (default 2048)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse finished sequences' KV for prompts that start with their tokens (default on)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="on GPUs: run every forward eagerly (default: decode and verify steps replay CUDA graphs)")
    g.add_argument("--disable-log-stats", action="store_true", default=None,
                   help="no periodic engine stats line in the pods' logs")
    g.add_argument("--seed", type=int,
                   help="vLLM's engine seed: requests without a seed of their own draw from streams derived from it "
                        "and their order of arrival (default: fresh randomness); a request's seed still wins")
    g.add_argument("--max-request-bytes", type=int, help="largest request body (default 1 MiB)")
    g.add_argument("--stream-interval-ms", type=float,
                   help="streamed tokens closer together than this go out as one SSE chunk (default 50; 0: a chunk "
                        "per engine round)")
    g.add_argument("--enable-log-requests", action="store_true", default=None,
                   help="log an INFO line as each generation starts and ends")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export an OpenTelemetry span per request to this OTLP collector (gRPC unless the pods' "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf); the image needs saguaro-dist[tracing]")
    g.add_argument("--collect-detailed-traces", nargs="+", metavar="{model,worker,all}",
                   help="vLLM's (needs --otlp-traces-endpoint): more attributes on each span: model, the target's "
                        "rounds and acceptance per draft position; worker, the draft workers' tree-cache counts; all")


def _add_speculation_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculation tuning (as `saguaro serve`)")
    g.add_argument("--proposal-top-k", type=int,
                   help="sd / ssd: the draft proposes from its k likeliest tokens (default 0: all); still exact")
    g.add_argument("--prompt-lookup-max", type=int,
                   help="longest n-gram prompt lookup matches: ngram's proposals, SD's / SSD's fast backup (default 3)")
    g.add_argument("--prompt-lookup-min", type=int, help="shortest one (default 1)")
    g.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's speculative config, e.g. '{\"model\": \"DRAFT\", \"num_speculative_tokens\": 4}' or "
                        "'{\"method\": \"ngram\", \"prompt_lookup_max\": 4}': it sets --draft / --k / --mode ngram "
                        "(and so the draft pods) and goes into the app args as given")


def _add_frontend_options(parser: argparse.ArgumentParser) -> None:
    """vLLM's HTTP-frontend flags that are app args. TLS (--ssl-keyfile / --ssl-certfile) is not offered: on
    Kubernetes it terminates at the Ingress or the service mesh (docs/deploy.md)."""
    g = parser.add_argument_group("HTTP frontend (as `saguaro serve`)")
    for name, what in (("origins", "origins"), ("methods", "methods"), ("headers", "request headers")):
        g.add_argument(f"--allowed-{name}", type=json_list_arg(f"--allowed-{name}"), metavar="JSON",
                       help=f'CORS: allowed {what}, a JSON list (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", default=None,
                   help="CORS: allow credentials (cookies, Authorization) in cross-origin requests (default off)")
    g.add_argument("--root-path", help="the path prefix your Ingress serves the API under, e.g. /llm (it may strip "
                                       "it or not; none is written: point one at <name>-serve:8000)")
    g.add_argument("--disable-fastapi-docs", action="store_true", default=None,
                   help="no OpenAPI schema, Swagger UI or ReDoc (/openapi.json, /docs, /redoc)")
    g.add_argument("--response-role", help="a new chat turn's role in replies (vLLM's; default assistant)")


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=DEFAULTS.tp, help="tensor-parallel size = GPUs of the target pod")
    parser.add_argument("--draft-workers", type=int, help=f"draft pods, one GPU each (default {DEFAULTS.draft_workers})")
    # refused, saying why (deploy/draft_pool.py): the engine starts --draft-workers draft workers once, so no
    # autoscaler adds a pod; kept so old command lines hear that rather than "unrecognized arguments"
    parser.add_argument("--draft-max-workers", type=int, help="not supported (only --draft-workers' value): the draft "
                                                              "pool is fixed, --draft-workers")
    parser.add_argument("--autoscaling", action="store_true", help="not supported: the draft pool is fixed, --draft-workers")
    parser.add_argument("--idle-timeout-s", type=int, help="not supported: the draft pool is fixed, --draft-workers")
    parser.add_argument("--image", default=DEFAULTS.image, help="saguaro-dist image (deploy/Dockerfile.cpu or .cuda)")
    parser.add_argument("--image-pull-policy", choices=[p.value for p in k8s.ImagePullPolicy],
                        help="the containers' imagePullPolicy (default: Kubernetes' own: Always for the tag latest "
                             "or none, else IfNotPresent)")
    parser.add_argument("--image-pull-secret", dest="image_pull_secrets", action="append",
                        help="a Secret with the registry's credentials (repeat for several)")
    parser.add_argument("--upgrade-strategy", choices=[u.value for u in k8s.UpgradeStrategy],
                        help=f"when the cluster's spec changes: NewCluster (a second cluster, then traffic moves; "
                             f"twice the GPUs meanwhile) or None (default {DEFAULTS.upgrade_strategy})")
    parser.add_argument("--drain-timeout-s", type=int,
                        help=f"Ray's drain on a pod's SIGTERM, seconds; the pods' grace period is this + "
                             f"{k8s.DRAIN_MARGIN_S} (default {DEFAULTS.drain_timeout_s})")
    parser.add_argument("--env", dest="extra_env", action="append", metavar="NAME=VALUE",
                        help="an environment variable for every Ray container, e.g. OTEL_SERVICE_NAME=saguaro for "
                             "--otlp-traces-endpoint (repeat for several; the manifests' own names are refused)")
    parser.add_argument("--gpu", action="store_true", help="run on NVIDIA GPUs (implied by --gpu-type)")
    parser.add_argument("--gpu-type", help="nvidia.com/gpu.product of the GPU nodes, e.g. NVIDIA-H100-80GB-HBM3")
    _add_secret_options(parser)
    _add_gcs_ft_options(parser)
    for role in ("head", "target", "draft"):
        parser.add_argument(f"--{role}-cpu", help=f"(default {getattr(DEFAULTS, f'{role}_cpu')})")
        parser.add_argument(f"--{role}-memory", help=f"(default {getattr(DEFAULTS, f'{role}_memory')})")


def _add_secret_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Secrets and the weights volume")
    g.add_argument("--api-key-secret", help=f"Secret with the API key (default {DEFAULTS.api_key_secret})")
    g.add_argument("--api-key-secret-key", help=f"its key (default {DEFAULTS.api_key_secret_key})")
    g.add_argument("--hf-token-secret", help=f"Secret with an HF token, for gated models (default "
                                             f"{DEFAULTS.hf_token_secret}, optional; \"\": none)")
    g.add_argument("--hf-token-secret-key", help=f"its key (default {DEFAULTS.hf_token_secret_key})")
    g.add_argument("--models-pvc", help="PVC with the weights, mounted at /models (default: an emptyDir HF cache)")


def _add_gcs_ft_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("GCS fault tolerance (RayService; KubeRay 1.3+)")
    g.add_argument("--gcs-ft-redis-address", metavar="HOST:PORT",
                   help="keep the head's GCS state in this Redis (one you run, highly available), so the workers "
                        "and the Serve app survive a head restart (default: off)")
    g.add_argument("--gcs-ft-redis-password-secret", metavar="NAME[:KEY]", type=_secret_ref,
                   help="the Secret (and its key, default 'password') holding that Redis' password")


def _secret_ref(text: str) -> tuple[str, str]:
    """NAME[:KEY] of a Secret's key; K8sSettings checks both names."""
    name, _, key = text.partition(":")
    if not name or (":" in text and not key):
        raise argparse.ArgumentTypeError(f"expected a Secret as NAME or NAME:KEY, got {text!r}")
    return name, key or k8s.K8sSettings.gcs_ft_redis_password_secret_key


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, default="rayservice",
                        help="raycluster: the same cluster without Serve, for batch jobs; "
                             "serve-config: the Serve config alone, for `serve deploy` on a VM cluster; "
                             "batch-job: a Job running `saguaro run-batch --url` against the RayService --name")
    g = parser.add_argument_group("batch-job")
    g.add_argument("--batch-pvc", help="PVC holding the batch files, mounted at /data")
    g.add_argument("--batch-input", help=f"the OpenAI batch file, relative to the PVC (default {BATCH_FILES['batch_input']})")
    g.add_argument("--batch-output", help=f"where the results go, relative to the PVC (default {BATCH_FILES['batch_output']})")
    parser.add_argument("--service-monitor", action="store_true",
                        help="also write the metrics Service and a prometheus-operator ServiceMonitor")


def _fan_out(text: str) -> int | tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"fan-out must be an int or comma-separated ints, got {text!r}") from None
    return values[0] if len(values) == 1 else values


def settings_from_args(args: argparse.Namespace) -> k8s.K8sSettings:
    """The CLI options whose names are K8sSettings fields, as settings."""
    fields = {f for f in k8s.K8sSettings.__dataclass_fields__}
    values = {key: value for key, value in vars(args).items() if key in fields and value is not None}
    if values.get("gcs_ft_redis_password_secret"):
        values["gcs_ft_redis_password_secret"], values["gcs_ft_redis_password_secret_key"] = values["gcs_ft_redis_password_secret"]
    if values.get("chat_template"):
        from saguaro_dist.serve.prompts import load_chat_template
        values["chat_template"] = load_chat_template(values["chat_template"])  # the text: the pods lack the file
    if values.get("draft") == "" and "mode" not in values and not values.get("speculative_config"):
        values["mode"] = "ar"  # `--draft ""` alone: no draft model, so autoregressive (as a lone serve MODEL)
    return k8s.K8sSettings(**values)


def manifests(args: argparse.Namespace) -> list[dict]:
    check_fixed_draft_pool(args.autoscaling, args.draft_max_workers, args.idle_timeout_s,  # named as flags
                           DEFAULTS.draft_workers if args.draft_workers is None else args.draft_workers, flag_name)
    settings = settings_from_args(args)
    _check_unused(args, settings)
    if args.service_monitor and args.kind == "serve-config":
        raise ValueError("--service-monitor writes Kubernetes objects (a Service, a ServiceMonitor), which have no "
                         "place in --kind serve-config's Serve config file: write them with the RayService's kind")
    docs = [_batch_job(settings, args) if args.kind == "batch-job" else BUILDERS[args.kind](settings)]
    if args.service_monitor:
        docs += [k8s.metrics_service(settings), k8s.service_monitor(settings)]
    return docs


def _check_unused(args: argparse.Namespace, settings: k8s.K8sSettings) -> None:
    """Flags the manifests would leave out: a draft's with a mode that runs none, --batch-* without --kind
    batch-job, --gcs-ft-* without the RayService (after the settings' own checks, which say more)."""
    check_mode_flags(args, Mode(settings.mode), implied=False)
    refuse_without(args, ("enable_auto_tool_choice",), "tool_call_parser")  # vLLM's rule, as `saguaro serve`
    gcs_ft = given(args, ("gcs_ft_redis_address", "gcs_ft_redis_password_secret"))
    if gcs_ft and args.kind != "rayservice":
        raise ValueError(f"{', '.join(map(flag_name, gcs_ft))} only applies to the RayService (--kind rayservice): "
                         f"it configures that Ray cluster, and Ray supports GCS fault tolerance for Serve only")
    if args.extra_env and args.kind not in ("rayservice", "raycluster"):
        raise ValueError(f"--env only applies to the Ray pods (--kind rayservice or raycluster), not --kind {args.kind}")
    batch = given(args, ("batch_pvc", *BATCH_FILES)) if args.kind != "batch-job" else {}
    if batch:
        raise ValueError(f"{', '.join(map(flag_name, batch))} only applies with --kind batch-job")


def _batch_job(settings: k8s.K8sSettings, args: argparse.Namespace) -> dict:
    if not args.batch_pvc:
        raise ValueError("--kind batch-job needs --batch-pvc (the PVC holding the batch files)")
    check_subdomain("--batch-pvc", args.batch_pvc, "a PersistentVolumeClaim")
    paths = {name: default if getattr(args, name) is None else getattr(args, name) for name, default in BATCH_FILES.items()}
    for name, path in paths.items():
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"--{name.replace('_', '-')} must be a path inside the PVC, got {path!r}")
    return k8s.batch_job(settings, args.batch_pvc, paths["batch_input"], paths["batch_output"])


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(k8s.to_yaml(manifests(args)))
    return 0
