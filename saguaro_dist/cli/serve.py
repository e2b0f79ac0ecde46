"""`saguaro serve [MODEL]`: start (or join) a Ray cluster and run the OpenAI-compatible Serve app.

Also home of the engine flags shared with `saguaro generate`.
"""
from __future__ import annotations

import argparse
import gc
import logging
import signal
import time

from saguaro_dist.cli.engine_flags import add_engine_args  # generate, run-batch and tests import it from here
from saguaro_dist.cli.flag_checks import check_mode_flags, flag_name
from saguaro_dist.cli.lora_flags import LORA_ENGINE_FLAGS, add_lora_args, check_adapters_here
from saguaro_dist.cli.frontend_flags import (add_frontend_args, check_tls_applied, frontend_app_args,
                                             serve_logging_config, tls_options)
from saguaro_dist.config import DRAFT_MODES, Mode, parse_enum
from saguaro_dist.serve.args import API_KEY_ENV, api_key_from_args, config_from_args, served_model_names, with_speculative_config
from saguaro_dist.serve.ingress import (Ingress, check_port_free, enable_direct_ingress, free_port, host_port,
                                        replica_count, resolve)
from saguaro_dist.serve.lora_modules import RUNTIME_UPDATE_ARG, runtime_updates_allowed
from saguaro_dist.serve.reasoning import ReasoningParser
from saguaro_dist.serve.tool_parsers import ToolCallParser

log = logging.getLogger(__name__)

APP_NAME = "saguaro"
# flag dest -> Config field (flags default to None so a --config file's values are only overridden on purpose)
ENGINE_FLAGS = {"model": "model", "draft": "draft", "revision": "revision", "draft_revision": "draft_revision",
                "tokenizer": "tokenizer", "tokenizer_revision": "tokenizer_revision", "mode": "mode", "k": "k", "fan_out": "fan_out",
                "fan_out_kind": "fan_out_kind", "adaptive_fan_out": "adaptive_fan_out", "saguaro_c": "saguaro_c", "fallback": "fallback",
                "proposal_top_k": "proposal_top_k", "prompt_lookup_max": "prompt_lookup_max",
                "prompt_lookup_min": "prompt_lookup_min",
                "max_batch_size": "max_batch_size", "max_model_len": "max_model_len", "draft_device": "draft_device",
                "max_num_batched_tokens": "max_num_batched_tokens", "device": "device",
                "dtype": "dtype", "enforce_eager": "enforce_eager", "gpu_memory_utilization": "gpu_memory_utilization", "tp": "tensor_parallel_size", "draft_workers": "num_draft_workers",
                "cluster": "cluster", "draft_executor": "draft_executor", "tree_policy": "tree_policy", "jit_cohorts": "jit_cohorts", "hit_glue": "hit_glue",
                "bonus_draw": "bonus_draw", "ngram_rounds": "ngram_rounds",
                "enable_prefix_caching": "enable_prefix_caching", "scheduling_policy": "scheduling_policy",
                "log_stats_interval_s": "log_stats_interval_s", "generation_config": "generation_config",
                "engine_seed": "seed", "speculative_config": "speculative_config", **LORA_ENGINE_FLAGS}  # --seed: serve and run-batch only (generate's --seed seeds its requests)
SERVE_FLAGS = {"api_key": "api_key", "served_model_name": "served_model_name",
               "max_request_bytes": "max_request_bytes", "stream_interval_ms": "stream_interval_ms",
               "tool_call_parser": "tool_call_parser", "reasoning_parser": "reasoning_parser",
               "log_requests": "log_requests", "chat_template": "chat_template", "lora_modules": "lora_modules",
               "otlp_traces_endpoint": "otlp_traces_endpoint", "collect_detailed_traces": "collect_detailed_traces"}
CHAT_TEMPLATE_HELP = ("a Jinja chat template, or a file holding one, used instead of the tokenizer's (vLLM's "
                      "--chat-template; for models that ship none)")


def port_arg(text: str) -> int:
    """1..65535: socket.bind raised an OverflowError (a stack trace) past it, and 0 fell back to 8000 unsaid."""
    try:
        port = int(text)
    except ValueError:
        port = None
    if port is None or not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in 1..65535, got {text!r}")
    return port


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def engine_args(ns: argparse.Namespace, base: dict | None = None) -> dict:
    """Engine settings from `base` (a config file's args) overridden by the flags actually given."""
    args = dict(base or {})
    check_model_given(ns)
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
    ns.model = ns.model or ns.model_tag
    # getattr's None: a command without the flag (generate has no engine --seed)
    args.update({field: getattr(ns, dest, None) for dest, field in ENGINE_FLAGS.items() if getattr(ns, dest, None) is not None})
    args = with_default_model(with_speculative_config(args))  # its draft first: a lone target would run ar
    implied = ns.mode is None and "mode" not in (base or {})
    try:
        mode = config_from_args(args).mode  # the values' own errors first: a --k 0 is wrong whatever the mode
    except ValueError:  # but a draft the mode leaves unused (Config refuses it too) is named by its flag
        mode = parse_enum(Mode, args.get("mode", Mode.SSD), "mode")
        if args.get("draft") and mode not in DRAFT_MODES:
            check_mode_flags(ns, mode, implied)
        raise
    check_mode_flags(ns, mode, implied)  # before any model loads
    return args


def check_model_given(ns: argparse.Namespace) -> None:
    """An empty MODEL or --model (an unset shell variable, say) is an error: the demo pair is for no model at all."""
    for dest in ("model_tag", "model"):
        if isinstance(getattr(ns, dest, None), str) and not getattr(ns, dest).strip():
            raise ValueError(f"{flag_name(dest)} is empty: name a model folder or Hugging Face id (or give no model "
                             "for the demo pair)")


def with_default_model(args: dict) -> dict:
    """No model given: the shipped demo pair, like `vllm serve` needs no flags for a first try. A model given
    empty (a config file's `model: ""`) is an error, not the demo pair."""
    if "model" in args and not (isinstance(args["model"], str) and args["model"].strip()):
        raise ValueError(f"model must name a model folder or Hugging Face id, got {args['model']!r}")
    if args.get("model"):
        if not args.get("draft") and "mode" not in args:
            args["mode"] = Mode.AR.value  # a lone target: autoregressive, unless --mode ngram
        return args
    try:
        from saguaro_dist.demo import demo_pair
        target, draft = demo_pair()
    except (ImportError, FileNotFoundError) as err:
        raise ValueError(f"no model given (MODEL or --model) and the demo pair is unavailable: {err}") from None
    if parse_enum(Mode, args.get("mode", Mode.SSD), "mode") not in DRAFT_MODES:
        draft = None  # ar and ngram run no draft (ngram refuses one): `--mode ngram` alone failed on the demo's
    return {**args, "model": target, "draft": args.get("draft") or draft}


# ---- saguaro serve ------------------------------------------------------------------------------
def _add_reply_parsers(g) -> None:
    """How tool calls and reasoning are read out of replies (vLLM's parsers)."""
    g.add_argument("--tool-call-parser", choices=[p.value for p in ToolCallParser],
                   help='read tool calls out of tool_choice "auto" replies in this format (hermes: <tool_call> JSON '
                        '</tool_call>, Hermes and Qwen 2.5 / 3; llama3_json: Llama 3.1-3.3 JSON calls; mistral: '
                        '[TOOL_CALLS] lists; qwen3_coder: Qwen3-Coder XML calls; pythonic: Llama 3.2 / 4 Python lists; '
                        'openai: gpt-oss harmony calls); without it "auto" is a 400')
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='vLLM\'s: tool_choice "auto" (on here whenever --tool-call-parser is given; accepted so vLLM '
                        'command lines run, and like vLLM refused without --tool-call-parser)')
    g.add_argument("--reasoning-parser", choices=[p.value for p in ReasoningParser],
                   help="return a thinking model's <think> text as the chat message's `reasoning` (qwen3: Qwen3; "
                        "deepseek_r1: DeepSeek-R1, QwQ; openai_gptoss: gpt-oss's analysis channel)")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve",
                              description="Start an embedded Ray cluster (or join --address) and serve "
                                          "/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, "
                                          "/health, /metrics, /version, /tokenize, /detokenize and "
                                          "/reset_prefix_cache (docs/serving.md).")
    add_engine_args(p, engine_seed=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=port_arg, help="HTTP port (default 8000)")
    g.add_argument("--api-key", nargs="+", help=f"require this bearer key, or any of several (vLLM's; default: ${API_KEY_ENV} "
                                              "if set); give MODEL before it")
    g.add_argument("--served-model-name", nargs="+", help="the model name clients use (default: the model path); "
                                                          "several: requests may give any, replies name the first")
    g.add_argument("--max-request-bytes", type=positive_int, help="largest request body (default 1 MiB)")
    g.add_argument("--stream-interval-ms", type=float,
                   help="streamed tokens closer together than this go out as one SSE chunk (default 50, as "
                        "Ray Serve LLM; 0: a chunk per engine round)")
    _add_reply_parsers(g)
    g.add_argument("--chat-template", help=CHAT_TEMPLATE_HELP)
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=None,
                   help="log an INFO line as each generation starts and ends (request id, prompt tokens, settings, "
                        "finish reason, timings, acceptance)")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="vLLM's: export an OpenTelemetry span per request (llm_request; the parent is the request's "
                        "traceparent header) to this OTLP collector, e.g. http://localhost:4317 (gRPC; "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: http://localhost:4318/v1/traces); "
                        "needs pip install 'saguaro-dist[tracing]'")
    g.add_argument("--collect-detailed-traces", nargs="+", metavar="{model,worker,all}",
                   help="vLLM's (needs --otlp-traces-endpoint): more attributes on each span, counted per request "
                        "anyway: model, the target's rounds and acceptance per draft position; worker, the draft "
                        "workers' tree-cache hits, misses and fallbacks; all, both (no per-request forward timing)")
    g.add_argument("--ingress", choices=[i.value for i in Ingress], default=Ingress.AUTO.value,
                   help="who answers on --port: the replica's own HTTP server (direct) or Serve's proxy "
                        "(default auto: direct on the embedded cluster with one replica, else the proxy)")
    g.add_argument("--config", help="a `serve run` YAML config (applications + http_options) or a "
                                    "mapping of app args; flags override it")
    g.add_argument("--address", help="join this Ray cluster instead of starting an embedded one")
    g.add_argument("--num-cpus", type=positive_int, help="CPUs of the embedded Ray cluster (default: all)")
    add_frontend_args(p)
    add_lora_args(p)
    p.set_defaults(run=run)


def check_models_here(config, embedded: bool) -> None:
    """On the embedded cluster the replica loads the models on this machine: what `saguaro generate` refuses in
    seconds (a model that is no folder and no Hub id to be had, a max_model_len past it, a --tokenizer or --draft
    that does not load, a GPU this machine lacks) is refused before Ray starts, not as a failed deployment
    half a minute later. With --address models and GPUs may be on the cluster only: local folders' pair check."""
    if not embedded:
        return check_pair_here(config)
    from saguaro_dist.engine.build import fit_draft, target_tokenizer
    from saguaro_dist.model.device import resolve_device
    from saguaro_dist.model.hf_config import load_config
    from saguaro_dist.model.loader import resolve_model_dir
    from saguaro_dist.model.runner_args import check_max_model_len
    resolve_device(config.device)
    if config.uses_draft:
        resolve_device(config.draft_device_resolved)
    target = load_config(resolve_model_dir(config.model, weights=False, revision=config.revision))  # a Hub id: fetched
    check_max_model_len(config.max_model_len or target.max_position_embeddings, target)
    tokenizer = target_tokenizer(config)
    if config.uses_draft:
        fit_draft(config, tokenizer)  # the draft resolved, and the pair's vocabulary


def check_pair_here(config) -> None:
    """A pair that cannot speculate (tokenizers differ, ...) is found before Ray starts when both models are
    folders on this machine; otherwise the replica finds it (with --address they may live on the cluster only)."""
    from pathlib import Path

    from saguaro_dist.engine.build import fit_draft, target_tokenizer
    local = (config.model, config.draft, config.tokenizer or config.model)
    if config.uses_draft and all(Path(p).expanduser().is_dir() for p in local):
        fit_draft(config, target_tokenizer(config))


def generation_defaults(config) -> dict:
    """The sampling defaults the engine takes from the model's generation config (LLM's own function); a
    --generation-config folder that fails is named as such (it read "model path ... is not a directory")."""
    from saguaro_dist.engine.llm import generation_defaults as checked
    try:
        return checked(config)
    except ValueError as err:
        if config.generation_config in ("auto", "vllm"):
            raise
        raise ValueError(f"--generation-config {config.generation_config!r}: {err}") from None


def check_generation_config_here(config, embedded: bool) -> None:
    """A bad generation config found before Ray starts (it failed in the replica): when its folder is on this
    machine, or named outright for the embedded cluster, whose replica looks for it here."""
    from pathlib import Path

    source = config.generation_config
    folder = config.model if source == "auto" else source
    if source != "vllm" and (Path(folder).expanduser().is_dir() or (embedded and source != "auto")):
        generation_defaults(config)


def run(ns: argparse.Namespace) -> int:
    from saguaro_dist.serve.config_file import load_serve_config
    from saguaro_dist.serve.prompts import load_chat_template  # (pydantic: not for `saguaro --help`)

    if ns.address and ns.num_cpus:
        raise ValueError("--num-cpus sizes the embedded cluster: unused with --address (the cluster has its own)")
    file = load_serve_config(ns.config) if ns.config else None
    if ns.api_key and len(ns.api_key) > 1 and not (ns.model_tag or ns.model or (file and "model" in file.args)):
        raise ValueError("several --api-key values and no MODEL: --api-key takes every value after it (vLLM's), "
                         "so give MODEL before --api-key")  # (else the model's path became a key, the demo served)
    args = engine_args(ns, file.args if file else None)
    args.update({field: getattr(ns, dest) for dest, field in SERVE_FLAGS.items() if getattr(ns, dest) is not None})
    if ns.enable_auto_tool_choice and not args.get("tool_call_parser"):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format auto replies' calls are "
                         "read in), as in vLLM")
    args.update(frontend_app_args(ns))
    if api_key_from_args(args):
        args["api_key"] = list(api_key_from_args(args))  # resolved here: replicas may not share our environment
    if args.get("chat_template"):
        args["chat_template"] = load_chat_template(args["chat_template"])  # the text: replicas may lack the file
    args[RUNTIME_UPDATE_ARG] = runtime_updates_allowed(args.get(RUNTIME_UPDATE_ARG))  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    # resolved here (or a config file's app arg): replicas may not share our environment
    config = config_from_args(args)
    from saguaro_dist.serve.app import check_runtime_lora, server_options  # (imports Ray Serve: not at the start)
    options = server_options(args, args["model"])  # every server option the replica reads (names, CORS, root
    # path, role, LoRA modules, a config file's too) checked before Ray starts, and before the models' files
    check_models_here(config, embedded=not ns.address)  # fail fast with a clear message, before Ray starts
    check_generation_config_here(config, embedded=not ns.address)
    check_adapters_here(options.lora_modules, config, embedded=not ns.address)
    check_runtime_lora(replica_count(_deployment_options(file, ns)), options.runtime_lora_updating)
    host = ns.host or (file.host if file else None) or "127.0.0.1"
    port = ns.port or (file.port if file else None) or 8000
    check_port_free(host, port)
    tls = tls_options(ns)  # a key pair that cannot serve is refused before Ray starts
    return _serve(args, host, port, ns, _deployment_options(file, ns), tls, file.route_prefix if file else "/")


def _deployment_options(file, ns: argparse.Namespace) -> dict:
    """The config file's deployment settings, and the logging flags' (the replica writes direct ingress's
    access log)."""
    from saguaro_dist.serve.replica_observability import with_log_level

    options = dict(file.deployment_options) if file else {}
    if serve_logging_config(ns):
        options["logging_config"] = serve_logging_config(ns)
    return with_log_level(options, getattr(ns, "log_level", None), getattr(ns, "uvicorn_log_level", None) is not None)


def _serve(args: dict, host: str, port: int, ns: argparse.Namespace, deployment_options: dict, tls: dict,
           route_prefix: str) -> int:
    import ray
    from ray import serve

    from saguaro_dist.serve.app import build_deployment
    from saguaro_dist.serve.replica_observability import job_logging, local_metrics_export_port

    embedded = not ns.address
    ingress = resolve(Ingress(ns.ingress), embedded, replica_count(deployment_options))
    proxy_port = _prepare_ingress(ingress, host, port)  # before Ray starts: its processes read the environment
    # address="local": a fresh embedded cluster, never one another process on this machine started.
    ray.init(address=ns.address or "local", num_cpus=ns.num_cpus if embedded else None,
             include_dashboard=False, log_to_driver=False, job_config=job_logging(getattr(ns, "log_level", None)))
    _stop_on_signals()
    name = served_model_names(args.get("served_model_name"), args["model"])[0]
    url = f"{'https' if tls else 'http'}://{host_port(host, port)}{route_prefix.rstrip('/')}/v1"
    serving = False
    try:
        log.warning("starting %r at %s (%s ingress; Ctrl-C to stop)", name, url, ingress.value)
        _start_serve(serve, {"host": host, "port": proxy_port, **tls}, deployment_options.get("logging_config"),
                     proxy_is_public=ingress is not Ingress.DIRECT)
        try:
            serve.run(build_deployment(args, **deployment_options), name=APP_NAME, route_prefix=route_prefix)
        except RuntimeError as err:  # the replica's failure: Serve's traceback named neither it nor its log
            raise ValueError(deploy_failure(err, _ray_logs_dir(ray) if embedded else None)) from None
        serving = True
        log.warning("serving %r at %s; Prometheus metrics at %s/metrics (this node's Ray metrics export, also on "
                    "port %s)", name, url, url.removesuffix("/v1"), local_metrics_export_port(ray))
        while True:
            time.sleep(60)  # a signal interrupts the sleep
    except KeyboardInterrupt:  # SIGINT or SIGTERM, while starting or serving: a clean stop
        pass
    finally:
        _shutdown(serve, ray, embedded, serving)
    return 0


def deploy_failure(err: Exception, logs_dir: str | None) -> str:
    """serve.run's RuntimeError as one line that says where the replica's own error is."""
    where = (f"{logs_dir}/serve/ (replica_*.log)" if logs_dir else
             "the cluster's Serve logs (/tmp/ray/session_latest/logs/serve/ on the replica's node, or the dashboard)")
    reason = (str(err).strip().splitlines() or [""])[0]
    return f"the Serve app did not start ({reason}); the replica's error is in {where}"


def _ray_logs_dir(ray) -> str | None:
    try:  # Ray's own node object: no public API names the session's log folder
        return ray._private.worker._global_node.get_logs_dir_path()
    except AttributeError:
        return None


def _start_serve(serve, http_options: dict, logging_config: dict | None, proxy_is_public: bool = True) -> None:
    """Serve's controller and HTTP servers: both ingress paths take TLS and logging from these options."""
    from ray.serve.context import _get_global_client

    serve.start(http_options=http_options, logging_config=logging_config)
    http_config = _get_global_client().http_config
    if proxy_is_public:  # (direct ingress: the replica answers on --port, the proxy's own is any)
        check_address_applied(http_config, http_options["host"], http_options["port"])
    check_tls_applied(http_config, {k: v for k, v in http_options.items() if k.startswith("ssl_")})


def check_address_applied(http_config, host: str, port: int) -> None:
    """On a joined cluster whose Serve already runs, serve.start keeps that Serve's host and port: refuse rather
    than log a URL nothing answers on (as check_tls_applied does for TLS)."""
    if (http_config.host, http_config.port) != (host, port):
        raise ValueError(f"--host {host} --port {port}: Serve already runs on this cluster at "
                         f"{host_port(http_config.host, http_config.port)}, and its proxies cannot move: give "
                         f"--host {http_config.host} --port {http_config.port}, or shut Serve down there first")


def _prepare_ingress(ingress: Ingress, host: str, port: int) -> int:
    """The port Serve's proxy listens on: the public one, or a spare one when the replica takes it."""
    if ingress is not Ingress.DIRECT:
        return port
    enable_direct_ingress(port)
    return free_port(host)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM (Kubernetes, systemd) both end the server cleanly, as Ctrl-C: also while serve.run
    waits for the replica (a model loading, a replica Ray cannot place), which a flag set by the handler never
    interrupted, so the signal was lost. Signals during the shutdown that follows are ignored."""
    def stop(*_):
        _ignore_stop_signals()
        raise KeyboardInterrupt
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _shutdown(serve, ray, embedded: bool, serving: bool) -> None:
    _ignore_stop_signals()  # a stop asked for twice, or one after a failed start: this shutdown is it
    log.warning("shutting down")
    if embedded:
        # Serve's graceful stop drains a serving replica; one still starting (a model loading, a replica Ray
        # cannot place) never answers it, and Serve waited graceful_shutdown_timeout_s (20 s) before killing
        # it. Before serving there is nothing to drain: the embedded Ray's shutdown ends every actor at once.
        if serving:
            serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP_NAME)  # leave the shared cluster and its other apps running
    # The process exits next: its final garbage collections walked all ~400k objects imported (torch, Ray, ...),
    # longer than Serve's and Ray's whole stop on a loaded machine. Frozen, they are left to the exit.
    gc.freeze()
