"""`saguaro serve [MODEL]`: start (or join) a Ray cluster and run the OpenAI-compatible Serve app.

Also home of the engine flags shared with `saguaro generate`.
"""
from __future__ import annotations

import argparse
import logging
import signal
import time

from saguaro_dist.cli.flag_checks import check_mode_flags
from saguaro_dist.config import (DRAFT_MODES, DTYPES, BonusDraw, DraftExecutor, FallbackPolicy, FanOut, HitGlue, Mode,
                                 SchedulingPolicy, TreePolicy, parse_enum)
from saguaro_dist.serve.args import API_KEY_ENV, api_key_from_args, config_from_args, served_model_names
from saguaro_dist.serve.ingress import (Ingress, check_port_free, enable_direct_ingress, free_port, host_port,
                                        replica_count, resolve)
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
                "engine_seed": "seed"}  # --seed: serve and run-batch only (generate's --seed seeds its requests)
SERVE_FLAGS = {"api_key": "api_key", "served_model_name": "served_model_name",
               "max_request_bytes": "max_request_bytes", "stream_interval_ms": "stream_interval_ms",
               "tool_call_parser": "tool_call_parser", "reasoning_parser": "reasoning_parser",
               "log_requests": "log_requests", "chat_template": "chat_template"}
CHAT_TEMPLATE_HELP = ("a Jinja chat template, or a file holding one, used instead of the tokenizer's (vLLM's "
                      "--chat-template; for models that ship none)")


def fan_out_arg(text: str):
    """A budget ("12") or explicit per-position counts ("4,3,2")."""
    parts = [int(p) for p in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


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


def add_engine_args(p: argparse.ArgumentParser, engine_seed: bool = False) -> None:
    """engine_seed: add the engine's --seed (Config.seed), where no per-request --seed takes the name."""
    g = p.add_argument_group("engine")
    g.add_argument("model_tag", nargs="?", metavar="MODEL", help="target model path or HF id (or use --model)")
    g.add_argument("--model", help="target model (default: the shipped demo pair)")
    g.add_argument("--draft", help="draft model (needed for sd / ssd; default: the demo draft with the demo pair)")
    g.add_argument("--revision", help="the target's Hub revision: a branch, tag or commit (vLLM's; default main)")
    g.add_argument("--draft-revision", help="the draft's Hub revision")
    g.add_argument("--tokenizer", help="a tokenizer (folder or HF id) used instead of the target's own (vLLM's)")
    g.add_argument("--tokenizer-revision", help="the tokenizer's Hub revision")
    g.add_argument("--mode", choices=[m.value for m in Mode], help="ar, sd, ssd or ngram (prompt lookup, no draft) (default ssd; ar without draft)")
    g.add_argument("--k", type=int, help="speculation length K (default 4)")
    g.add_argument("--fan-out", type=fan_out_arg, help="branch budget B, or K+1 comma-separated counts")
    g.add_argument("--fan-out-kind", choices=[f.value for f in FanOut])
    g.add_argument("--adaptive-fan-out", dest="adaptive_fan_out", action="store_true", default=None,
                   help="let the draft shrink the fan-out budget while its tree builds outlast verifies")
    g.add_argument("--saguaro-c", type=float, help="Saguaro sampling scale C in [0, 1]")
    g.add_argument("--proposal-top-k", type=int, dest="proposal_top_k",
                   help="the draft proposes from its k likeliest tokens when sampling (exact either way; its "
                        "distributions then travel sparse: worth it with a large vocabulary); 0 (default): all")
    g.add_argument("--prompt-lookup-max", type=int, dest="prompt_lookup_max",
                   help="longest n-gram prompt lookup matches (--mode ngram, and SSD's fast backup; default 3)")
    g.add_argument("--prompt-lookup-min", type=int, dest="prompt_lookup_min", help="shortest one (default 1)")
    g.add_argument("--fallback", choices=[f.value for f in FallbackPolicy])
    g.add_argument("--tree-policy", choices=[t.value for t in TreePolicy],
                   help="ssd: auto (default) runs rounds with or without speculation trees, whichever is measured "
                        "faster at the batch size; always builds a tree every round; never builds none (SD's rounds)")
    g.add_argument("--jit-cohorts", type=int, choices=[1, 2], dest="jit_cohorts",
                   help="ssd rounds without trees: 2 (default) verifies the batch as two cohorts, the draft drafting "
                        "one while the target verifies the other, where measured faster; 1: the batch whole")
    g.add_argument("--hit-glue", choices=[h.value for h in HitGlue],
                   help="ssd: after a hit, whether the tree covers the all-accepted outcome too (one draft forward "
                        "more); auto (default) skips it while the target waits for trees")
    g.add_argument("--bonus-draw", choices=[b.value for b in BonusDraw],
                   help="ssd, sampled rows: coupled (default) draws the tree's bonus candidates from the draft's guess and the "
                        "bonus against them (hit more often, still exact); top_f takes the draft's top-F")
    g.add_argument("--ngram-rounds", action=argparse.BooleanOptionalAction, default=None,
                   help="ssd: let the tree gate run rounds of n-gram proposals alone (no draft, no tree) where they "
                        "measure faster, as on repetitive text, and a row take its n-gram proposal over the "
                        "draft's where that gains more (default on; only with --fallback auto)")
    g.add_argument("--max-batch-size", "--max-num-seqs", type=int, dest="max_batch_size",
                   help="sequences decoded together (vLLM's --max-num-seqs; default 8)")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="prompt tokens an engine step prefills and tokens one forward takes; longer prompts run in "
                        "chunks between decoding rounds (default 2048)")
    g.add_argument("--device", help="cpu, cuda, cuda:0, ...")
    g.add_argument("--draft-device", help="the draft's own device (default: --device), e.g. cuda:1")
    g.add_argument("--dtype", choices=DTYPES,
                   help="the models' dtype (default float32); auto: each model's checkpoint dtype, on CUDA float16 "
                        "for a float32 one (vLLM's), on the CPU bfloat16 for a float16 one")
    g.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=None,
                   help="on CUDA: run every forward eagerly (default: decode and verify steps replay CUDA graphs)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   help="share of the device's memory the engine may use (vLLM's; default 0.9). The KV cache's worst "
                        "case (max-num-seqs x max-model-len) must fit what the weights leave of it: on CUDA it is "
                        "allocated at start-up and a shortfall is an error naming what fits; on the CPU a warning")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse finished sequences' KV for prompts that start with their tokens (default on)")
    g.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy],
                   help="which waiting request takes a free batch slot: fcfs (default) or priority (the request's "
                        "`priority`, lower first; running requests are not preempted)")
    g.add_argument("--generation-config",
                   help="requests' default temperature, top_p, top_k, min_p, repetition_penalty and max_tokens: "
                        "auto (default) from the model's generation_config.json, as vLLM; vllm: none (temperature "
                        "1, no truncation); or a folder holding a generation_config.json")
    g.add_argument("--disable-log-stats", dest="log_stats_interval_s", action="store_const", const=0.0, default=None,
                   help="no periodic engine stats line (default: one every 10 s while serving, as vLLM)")
    g.add_argument("--tp", "--tensor-parallel-size", "-tp", type=int, dest="tp",
                   help="tensor-parallel size of the target (above 1 implies --cluster auto)")
    g.add_argument("--draft-workers", type=int, help="draft actors in the pool (above 1 implies --cluster auto)")
    g.add_argument("--draft-executor", choices=[e.value for e in DraftExecutor],
                   help="where the draft runs. One host: thread, process (a child), or split (just-in-time drafts on "
                        "a thread, trees in a child); default auto: thread for sd, and for ssd split on the CPU, thread "
                        "on the target's GPU, process on a GPU of its own. On Ray: split (the target's rank 0 drafts "
                        "just in time, the draft actors build the trees; auto for ssd on the CPU) or process (the "
                        "draft actors do all)")
    g.add_argument("--cluster", help="run the engine as Ray actors: auto, local or ray://host:port "
                                     "(default: one-host engine inside the server)")
    if engine_seed:
        g.add_argument("--seed", type=int, dest="engine_seed",
                       help="vLLM's engine seed: requests without a seed of their own draw from streams derived from "
                            "it and their order of arrival, so the same requests in the same order reproduce "
                            "(default: fresh randomness); a request's seed still wins")


def engine_args(ns: argparse.Namespace, base: dict | None = None) -> dict:
    """Engine settings from `base` (a config file's args) overridden by the flags actually given."""
    args = dict(base or {})
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
    ns.model = ns.model or ns.model_tag
    # getattr's None: a command without the flag (generate has no engine --seed)
    args.update({field: getattr(ns, dest, None) for dest, field in ENGINE_FLAGS.items() if getattr(ns, dest, None) is not None})
    args = with_default_model(args)
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


def with_default_model(args: dict) -> dict:
    """No model given: the shipped demo pair, like `vllm serve` needs no flags for a first try."""
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
def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve",
                              description="Start an embedded Ray cluster (or join --address) and serve "
                                          "/v1/completions, /v1/chat/completions, /v1/models, /health, "
                                          "/tokenize and /detokenize.")
    add_engine_args(p, engine_seed=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=port_arg, help="HTTP port (default 8000)")
    g.add_argument("--api-key", help=f"require this bearer key (default: ${API_KEY_ENV} if set)")
    g.add_argument("--served-model-name", nargs="+", help="the model name clients use (default: the model path); "
                                                          "several: requests may give any, replies name the first")
    g.add_argument("--max-request-bytes", type=positive_int, help="largest request body (default 1 MiB)")
    g.add_argument("--stream-interval-ms", type=float,
                   help="streamed tokens closer together than this go out as one SSE chunk (default 50, as "
                        "Ray Serve LLM; 0: a chunk per engine round)")
    g.add_argument("--tool-call-parser", choices=[p.value for p in ToolCallParser],
                   help='read tool calls out of tool_choice "auto" replies in this format (hermes: <tool_call> JSON '
                        '</tool_call>, Hermes and Qwen 2.5 / 3; llama3_json: Llama 3.1-3.3 JSON calls; mistral: '
                        '[TOOL_CALLS] lists); without it "auto" is a 400')
    g.add_argument("--reasoning-parser", choices=[p.value for p in ReasoningParser],
                   help="return a thinking model's <think> text as the chat message's `reasoning` (qwen3: Qwen3; "
                        "deepseek_r1: DeepSeek-R1, QwQ)")
    g.add_argument("--chat-template", help=CHAT_TEMPLATE_HELP)
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=None,
                   help="log an INFO line as each generation starts and ends (request id, prompt tokens, settings, "
                        "finish reason, timings, acceptance)")
    g.add_argument("--ingress", choices=[i.value for i in Ingress], default=Ingress.AUTO.value,
                   help="who answers on --port: the replica's own HTTP server (direct) or Serve's proxy "
                        "(default auto: direct on the embedded cluster with one replica, else the proxy)")
    g.add_argument("--config", help="a `serve run` YAML config (applications + http_options) or a "
                                    "mapping of app args; flags override it")
    g.add_argument("--address", help="join this Ray cluster instead of starting an embedded one")
    g.add_argument("--num-cpus", type=positive_int, help="CPUs of the embedded Ray cluster (default: all)")
    p.set_defaults(run=run)


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
    args = engine_args(ns, file.args if file else None)
    args.update({field: getattr(ns, dest) for dest, field in SERVE_FLAGS.items() if getattr(ns, dest) is not None})
    if api_key_from_args(args):
        args["api_key"] = api_key_from_args(args)  # resolved here: replicas may not share our environment
    if args.get("chat_template"):
        args["chat_template"] = load_chat_template(args["chat_template"])  # the text: replicas may lack the file
    config = config_from_args(args)
    check_pair_here(config)  # fail fast with a clear message, before Ray starts
    check_generation_config_here(config, embedded=not ns.address)
    served_model_names(args.get("served_model_name"), args["model"])
    host = ns.host or (file.host if file else None) or "127.0.0.1"
    port = ns.port or (file.port if file else None) or 8000
    check_port_free(host, port)
    return _serve(args, host, port, ns, file.deployment_options if file else {})


def _serve(args: dict, host: str, port: int, ns: argparse.Namespace, deployment_options: dict) -> int:
    import ray
    from ray import serve

    from saguaro_dist.serve.app import build_app

    embedded = not ns.address
    ingress = resolve(Ingress(ns.ingress), embedded, replica_count(deployment_options))
    proxy_port = _prepare_ingress(ingress, host, port)  # before Ray starts: its processes read the environment
    # address="local": a fresh embedded cluster, never one another process on this machine started.
    ray.init(address=ns.address or "local", num_cpus=ns.num_cpus if embedded else None,
             include_dashboard=False, log_to_driver=False)
    _stop_on_signals()
    name = served_model_names(args.get("served_model_name"), args["model"])[0]
    url = f"http://{host_port(host, port)}/v1"
    try:
        log.warning("starting %r at %s (%s ingress; Ctrl-C to stop)", name, url, ingress.value)
        serve.start(http_options={"host": host, "port": proxy_port})
        serve.run(build_app(args, **deployment_options), name=APP_NAME, route_prefix="/")
        log.warning("serving %r at %s", name, url)
        while True:
            time.sleep(60)  # a signal interrupts the sleep
    except KeyboardInterrupt:  # SIGINT or SIGTERM, while starting or serving: a clean stop
        pass
    finally:
        _shutdown(serve, ray, embedded)
    return 0


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


def _shutdown(serve, ray, embedded: bool) -> None:
    _ignore_stop_signals()  # a stop asked for twice, or one after a failed start: this shutdown is it
    log.warning("shutting down")
    if embedded:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP_NAME)  # leave the shared cluster and its other apps running
