"""The Ray Serve application: one deployment whose replicas each hold an `LLM` behind the OpenAI API.

    serve run saguaro_dist.serve.app:build_app model=/path/target draft=/path/draft mode=ssd
or, in a Serve config / KubeRay serveConfigV2:
    import_path: saguaro_dist.serve.app:build_app
    args: {model: ..., draft: ..., k: 4, api_key_env: SAGUARO_API_KEY}
"""
from __future__ import annotations

import dataclasses
import logging

from ray import serve
from ray.serve import Application

from saguaro_dist.serve.api import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_STREAM_INTERVAL_MS, ServerOptions, create_app
from saguaro_dist.serve.args import api_key_from_args, coerce, config_from_args, served_model_names
from saguaro_dist.serve.chat_request import REPLY_ROLE
from saguaro_dist.serve.frontend import frontend_options
from saguaro_dist.serve.ingress import replica_count
from saguaro_dist.serve.lora_models import ServedModels
from saguaro_dist.serve.lora_modules import RUNTIME_UPDATE_ARG, check_lora_modules, lora_modules, runtime_updates_allowed
from saguaro_dist.serve.metrics import ServeMetrics
from saguaro_dist.serve.prompts import load_chat_template
from saguaro_dist.serve.replica_observability import add_metrics_route, adopt_serve_logging, node_metrics_url

log = logging.getLogger(__name__)

APP_IMPORT_PATH = "saguaro_dist.serve.app:build_app"
DEPLOYMENT_NAME = "SaguaroServer"
# Requests a replica accepts at once. Serve's default (5) would queue streams in the proxy instead of
# letting the engine batch them; the engine has its own waiting queue beyond max_batch_size.
MAX_ONGOING_REQUESTS = 256


class SaguaroServer:
    """One replica: loads the engine, then serves the FastAPI app built over it."""

    def __init__(self, args: dict):
        from saguaro_dist import LLM  # heavy (torch, models): only inside the replica

        adopt_serve_logging()  # before the first INFO line: the engine's stats and request lines show
        config = config_from_args(args)
        warn_of_unfillable_batch(config.max_batch_size)
        self._options = server_options(args, config.model)
        # The adapters read here before the model loads (a bad one in a manifest fails each restart in seconds);
        # the engine's target reads them again once it runs (create_app).
        self._models = ServedModels((self._options.served_model_name, *self._options.model_aliases), config,
                                    self._options.lora_modules, replicas=deployment_replicas)
        log.info("loading %s (mode %s) for model name %r", config.model, config.mode.value,
                 self._options.served_model_name)
        self._engine = LLM.from_config(config)
        self._app = None

    def __serve_build_asgi_app__(self):
        metrics = ServeMetrics(self._options.served_model_name)
        self._app = create_app(self._engine, self._options, metrics, self._models)
        add_metrics_route(self._app, node_metrics_url())
        return self._app

    def check_health(self) -> None:
        """Ray Serve's replica health check (every health_check_period_s): a replica whose engine is gone (its
        target actors died) fails it, and Serve replaces the replica with a fresh one, engine and all."""
        self._engine.check_health()

    def stats(self) -> dict:
        """Generations in flight and cancelled on this replica, and its engine's load (a deployment-handle
        call, not a route)."""
        state = self._app.state.saguaro
        return {"running": state.running, "cancelled": state.cancelled, "engine": dataclasses.asdict(self._engine.load)}

    def __del__(self):
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()


def server_options(args: dict, model: str) -> ServerOptions:
    names = served_model_names(args.get("served_model_name"), model)
    modules = lora_modules(args.get("lora_modules"))
    check_lora_modules(modules, names, bool(coerce("enable_lora", args.get("enable_lora", False), False)))
    return ServerOptions(
        served_model_name=names[0],
        model_aliases=names[1:],
        api_key=api_key_from_args(args),
        max_request_bytes=_positive_int(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
        stream_interval_ms=_number(args, "stream_interval_ms", DEFAULT_STREAM_INTERVAL_MS),
        tool_call_parser=args.get("tool_call_parser") or None,
        reasoning_parser=args.get("reasoning_parser") or None,
        log_requests=bool(coerce("log_requests", args.get("log_requests", False), False)),  # "true" from `serve run`
        chat_template=load_chat_template(args["chat_template"]) if args.get("chat_template") else None,
        frontend=frontend_options(args),
        response_role=_response_role(args),
        lora_modules=modules,
        runtime_lora_updating=runtime_updates_allowed(args.get(RUNTIME_UPDATE_ARG)),
        otlp_traces_endpoint=args.get("otlp_traces_endpoint") or None,  # (its packages checked here, in each replica)
        collect_detailed_traces=args.get("collect_detailed_traces"),  # (refused here without the endpoint)
    )


def _response_role(args: dict):
    """--response-role: a new chat turn's role in replies; ServerOptions refuses a blank or non-string one."""
    value = args.get("response_role")
    return REPLY_ROLE if value is None else value


def _positive_int(args: dict, name: str, default: int) -> int:
    """A manifest's count (a string from `serve run`): 0 or less took every request body for too large (413)."""
    value = args.get(name)
    if value is None or value == "":
        return default
    number = _integer(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return number


def _integer(value) -> int | None:
    """An int, a whole float, or a string of an int; None for anything else (int() read 2.5 as 2)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _number(args: dict, name: str, default: float) -> float:
    value = args.get(name)
    try:
        return default if value is None else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def autoscaling(given: dict, max_batch_size: int) -> dict:
    """Serve's default target of 2 requests per replica added a replica (a whole engine, models and all) while
    the batch had room: the target is a full batch unless the config sets one (Ray Serve LLM overrides Serve's
    default too)."""
    if "target_ongoing_requests" not in given:
        log.info("autoscaling target_ongoing_requests set to max_batch_size %d (Serve's default: 2)", max_batch_size)
    return {"target_ongoing_requests": max_batch_size, **given}


def unfillable_batch(deployment_config, max_batch_size: int) -> list[str]:
    """The settings of the deployment as Serve runs it that are below a full batch: max_ongoing_requests (a
    replica never fills its batch) and autoscaling's target (Serve adds a replica, a whole engine, first)."""
    found = []
    if deployment_config.max_ongoing_requests < max_batch_size:
        found.append(f"max_ongoing_requests {deployment_config.max_ongoing_requests}")
    autoscaling_config = deployment_config.autoscaling_config
    if autoscaling_config is not None and autoscaling_config.get_target_ongoing_requests() < max_batch_size:
        found.append(f"autoscaling_config.target_ongoing_requests {autoscaling_config.get_target_ongoing_requests():g}")
    return found


def warn_of_unfillable_batch(max_batch_size: int) -> None:
    """Said by each replica as it starts. A Serve config's own `deployments:` entry (`serve deploy`, `serve run
    config.yaml`, KubeRay's serveConfigV2) is applied by Serve after build_app, its autoscaling_config replacing
    the app's whole: Serve's default target of 2 then applies unless it names one, and no app code can raise it."""
    config = getattr(serve.get_replica_context(), "_deployment_config", None)  # (no public API carries it)
    found = unfillable_batch(config, max_batch_size) if config is not None else []
    if found:
        log.warning("deployment %s runs with %s, below the engine's max_batch_size %d: Serve adds replicas (each a "
                    "whole engine) or caps requests before a batch fills. A Serve config's deployments: "
                    "autoscaling_config replaces the app's whole (Serve's default target is 2): set "
                    "target_ongoing_requests: %d there (and max_ongoing_requests at least that), or deploy the file "
                    "with `saguaro serve --config`, which does", DEPLOYMENT_NAME, " and ".join(found),
                    max_batch_size, max_batch_size)


def deployment_settings(config, given: dict) -> dict:
    """serve.deployment's options: the caller's, over what a replica holding this engine needs."""
    options = {"name": DEPLOYMENT_NAME,
               # below a full batch a replica could never fill it (and an autoscaling target above it is unreachable)
               "max_ongoing_requests": max(MAX_ONGOING_REQUESTS, config.max_batch_size), **given}
    autoscaling_config = options.get("autoscaling_config")
    if isinstance(autoscaling_config, dict) or (autoscaling_config is None and options.get("num_replicas") == "auto"):
        # "auto" alone is Serve's default autoscaling config, target 2 included: ours goes over it likewise
        options["autoscaling_config"] = autoscaling(autoscaling_config or {}, config.max_batch_size)
    gpus = in_process_gpus(config)
    actor = options.get("ray_actor_options") or {}
    if gpus and "num_gpus" not in actor and not options.get("placement_group_bundles"):
        options["ray_actor_options"] = {**actor, "num_gpus": gpus}
    return options


def in_process_gpus(config) -> int:
    """GPUs a replica must reserve for an engine it runs itself (no cluster: on one, the engine's actors reserve
    theirs). Without them Ray counted the GPU free and put every replica on cuda:0. Ray shows a replica its GPUs as
    cuda:0..n-1, so a config naming cuda:N needs N + 1."""
    if config.cluster is not None:
        return 0
    devices = [config.device] + ([config.draft_device_resolved] if config.uses_draft else [])
    indices = [int(d.partition(":")[2] or 0) for d in devices if d.startswith("cuda")]
    return max(indices) + 1 if indices else 0


def check_runtime_lora(replicas: int | str, allowed: bool) -> None:
    """A runtime LoRA load or unload reaches the one replica that takes the request: with several (or an
    autoscaler that may add some), replicas would serve different adapters under one name. Refused here as the
    app is built; a config file's deployment override applies after that, so each load and unload asks again
    (deployment_replicas)."""
    if allowed and replicas != 1:
        raise ValueError(f"VLLM_ALLOW_RUNTIME_LORA_UPDATING needs one replica (the config asks for {replicas!r}): a "
                         "load_lora_adapter request reaches one replica only; serve the adapters with --lora-modules "
                         "(lora_modules) instead, which every replica loads")


def deployment_replicas() -> int:
    """The replicas this replica's deployment may run now, as Serve last configured it (a `serve deploy` / `serve
    run config.yaml` / serveConfigV2 override of num_replicas or autoscaling included): its num_replicas
    (ReplicaContext.world_size), or autoscaling's max_replicas, which no public API carries (the context's
    deployment config; unreadable, counted as many)."""
    context = serve.get_replica_context()
    config = getattr(context, "_deployment_config", None)
    if config is None:  # a Ray whose context does not carry it: refuse rather than let replicas disagree
        return 2
    autoscaling = config.autoscaling_config
    configured = max(context.world_size or 1, autoscaling.max_replicas if autoscaling is not None else 1)
    return max(configured, running_replicas(context.replica_id.deployment_id))


def running_replicas(deployment_id) -> int:
    """The replicas Serve holds for the deployment now, in any state (public serve.status()): a num_replicas
    change Serve applies without reconfiguring running replicas (a light-weight option, which leaves their
    context's world_size as it was) shows here."""
    app = serve.status().applications.get(deployment_id.app_name)
    deployment = app.deployments.get(deployment_id.name) if app is not None else None
    return sum(deployment.replica_states.values()) if deployment is not None else 1


def build_app(args: dict) -> Application:
    """Serve's application builder (import_path of a Serve config, KubeRay's serveConfigV2, `serve run`): exactly
    one parameter, as Serve requires of a builder; the config's `deployments` options are Serve's to apply (after
    this: an autoscaling_config there replaces ours whole, so each replica warns of a target below a full batch)."""
    return build_deployment(args)


def build_deployment(args: dict, **deployment_options) -> Application:
    """The application with `deployment_options` (serve.deployment's) over a replica's needs: `saguaro serve`'s.
    Validates the arguments here, in the caller, so a bad manifest fails at deploy time with a clear message
    rather than in a crash-looping replica."""
    config = config_from_args(args)
    runtime_lora = server_options(args, config.model).runtime_lora_updating
    options = deployment_settings(config, deployment_options)
    check_runtime_lora(replica_count(options), runtime_lora)
    warn_of_unadvertised_resources(options)
    deployment = serve.deployment(serve.ingress()(SaguaroServer), **options)
    return deployment.bind(dict(args))


def unadvertised_resources(options: dict, advertised: dict) -> list[str]:
    """The custom resources the replica's ray_actor_options ask for that no node advertises."""
    asked = (options.get("ray_actor_options") or {}).get("resources") or {}
    return sorted(name for name in asked if name not in advertised)


def warn_of_unadvertised_resources(options: dict) -> None:
    """Serve would wait for such a replica without a word: `saguaro serve --config` given a serve config generated
    for a KubeRay or cluster-launcher cluster (whose target node advertises saguaro_front), on another cluster. (Serve's
    own builder path applies a config's deployment options after build_app: nothing to check there.) A warning, not
    an error: an autoscaling cluster may still start a node that advertises them."""
    import ray
    missing = unadvertised_resources(options, ray.cluster_resources()) if ray.is_initialized() else []
    if missing:
        log.warning("the replica asks for resources %s, which no node of this Ray cluster advertises: it waits "
                    "until one does (start the target node with them, e.g. ray start --resources "
                    "'{\"saguaro_front\": 1}', or drop them from the deployment's ray_actor_options)", missing)
