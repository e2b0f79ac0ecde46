"""What a KubeRay deployment varies (K8sSettings), checked at construction: a setting the cluster or the app
would refuse fails here, before any manifest is written."""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from saguaro_dist.config import (
    DRAFT_MODES,
    FallbackPolicy,
    Mode,
    SchedulingPolicy,
    parse_enum,
)
from saguaro_dist.deploy.constants import (
    APP_VERSION,
    DNS_LABEL,
    DNS_SUBDOMAIN,
    LABEL_VALUE,
    MAX_SUBDOMAIN,
    REDIS_ADDRESS,
    SECRET_KEY,
)
from saguaro_dist.deploy.draft_pool import check_fixed_draft_pool
from saguaro_dist.deploy.extra_env import extra_env
from saguaro_dist.deploy.serve_app import serve_args
from saguaro_dist.serve.args import config_from_args, served_model_names
from saguaro_dist.serve.lora_modules import check_lora_modules, lora_modules
from saguaro_dist.serve.frontend import CORS_LIST_ARGS, frontend_options, json_list
from saguaro_dist.serve.tracing import detailed_trace_modules
from saguaro_dist.speculative_config import as_dict, config_fields

# the fields a speculative_config sets (speculative_config.config_fields); one the caller gave (even at its
# default's value) that contradicts the config is refused there
SPECULATION_FIELDS = ("draft", "mode", "k", "draft_revision", "prompt_lookup_max", "prompt_lookup_min")


class LeftOut:
    """The default of a speculation field with one other than None: K8sSettings tells a field left out (a
    speculative_config may set it) from one given at the same value (which must agree with the config), as
    `saguaro serve` tells its flags given from their defaults. __post_init__ replaces it by its value."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


class UpgradeStrategy(str, enum.Enum):
    """RayService spec.upgradeStrategy.type: what KubeRay does when the Ray cluster's spec changes."""

    NEW_CLUSTER = "NewCluster"  # blue/green: a second cluster (twice the GPUs for a while), then traffic moves
    NONE = "None"               # no new cluster: cluster changes wait for the RayService to be recreated


class ImagePullPolicy(str, enum.Enum):
    """A container's imagePullPolicy (Kubernetes'); unset, Kubernetes' default for the image (pull_policy)."""

    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


@dataclass(frozen=True)
class K8sSettings:
    """What a deployment varies; every field has a Helm value (see helm_values)."""

    name: str = "saguaro"
    model: str = "Qwen/Qwen3-1.7B"
    draft: str | None = LeftOut("Qwen/Qwen3-0.6B")  # LeftOut: the value, once constructed
    mode: str = LeftOut("ssd")
    k: int = LeftOut(4)
    fan_out: int | tuple[int, ...] = 12
    saguaro_c: float = 1.0
    fallback: str = "auto"
    max_batch_size: int = 8
    max_model_len: int | None = None  # None: the model's own context; the KV cache's worst case must fit (model/memory.py)
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"   # or "priority": requests' `priority` orders the waiting queue
    dtype: str | None = None          # None: bfloat16 on GPU, float32 on CPU; "auto": each model's checkpoint dtype (vLLM's)
    served_model_name: str | tuple[str, ...] | None = None  # several: requests may give any, replies name the first
    tool_call_parser: str | None = None  # tool_choice "auto"'s reply format: a serve/tool_parsers.py ToolCallParser
    reasoning_parser: str | None = None  # <think> text as the message's reasoning: a serve/reasoning.py ReasoningParser
    generation_config: str = "auto"   # requests' sampling defaults: the model's generation_config.json, or "vllm" (none)
    revision: str | None = None       # the target's Hub revision (branch, tag or commit) when model is a Hub id
    draft_revision: str | None = None
    tokenizer: str | None = None      # a tokenizer (HF id or a path under /models) instead of the target's own
    tokenizer_revision: str | None = None
    chat_template: str | None = None  # a Jinja chat template (the text) instead of the tokenizer's
    # `saguaro serve`'s engine and server flags of the same names; None / the default: the app's own default,
    # and the manifest leaves the arg out
    max_num_batched_tokens: int | None = None  # tokens an engine step prefills (longer prompts in chunks); None: 2048
    enable_prefix_caching: bool = True
    enforce_eager: bool = False       # on CUDA: every forward eager, no CUDA graphs
    disable_log_stats: bool = False   # no periodic engine stats line in the pods' logs
    seed: int | None = None           # vLLM's engine seed: unseeded requests draw from it and their order of arrival
    max_request_bytes: int | None = None     # largest request body; None: 1 MiB
    stream_interval_ms: float | None = None  # streamed tokens closer than this share an SSE chunk; None: 50
    enable_log_requests: bool = False  # an INFO line as each generation starts and ends
    otlp_traces_endpoint: str | None = None  # vLLM's: an OTLP collector for each request's span (serve/tracing.py)
    collect_detailed_traces: tuple[str, ...] | None = None  # vLLM's: model / worker / all; needs otlp_traces_endpoint
    proposal_top_k: int = 0           # sd / ssd: the draft proposes from its k likeliest tokens (0: all); still exact
    prompt_lookup_max: int | None = None  # n-gram sizes prompt lookup matches (ngram, and SD's / SSD's fast backup)
    prompt_lookup_min: int | None = None  # None: the engine's 3 / 1
    # vLLM's speculative_config (a dict or its JSON): it sets draft / mode / k / draft_revision / prompt_lookup_*
    # here (so the cluster gets its draft pods or none), and the app args carry it as given
    speculative_config: Mapping | None = None
    # `saguaro serve`'s HTTP-frontend flags (vLLM's); None / False: the app's defaults (CORS "*", no credentials)
    allowed_origins: tuple[str, ...] | None = None  # CORS, each a list of strings (or its JSON)
    allowed_methods: tuple[str, ...] | None = None
    allowed_headers: tuple[str, ...] | None = None
    allow_credentials: bool = False
    root_path: str | None = None      # the path prefix a reverse proxy (the Ingress) serves the API under, e.g. /llm
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    response_role: str | None = None  # a new chat turn's role in replies (vLLM's --response-role; None: assistant)
    # vLLM's LoRA flags: adapters served by name (each {name, path[, base_model_name]} or "name=path"; a path under
    # /models or a Hub id), checked at each replica's start-up against the base model
    enable_lora: bool = False
    lora_modules: tuple = ()
    max_loras: int | None = None      # None: the engine's 1
    max_lora_rank: int | None = None  # None: the engine's 16
    max_cpu_loras: int | None = None  # None: the engine's (max_loras)
    tp: int = 1
    draft_workers: int = 1
    image: str | None = None          # None: saguaro-dist:<version>-cuda with GPUs, -cpu without (container_image)
    image_pull_policy: str | None = None  # an ImagePullPolicy; None: Kubernetes' default for the image (pull_policy)
    gpu: bool = False
    gpu_type: str | None = None       # nvidia.com/gpu.product of the nodes to run on (a label value)
    api_key_secret: str = "saguaro-api-key"
    api_key_secret_key: str = "api-key"
    hf_token_secret: str | None = "hf-token"  # None / "": no HF token (public models only)
    hf_token_secret_key: str = "token"
    models_pvc: str | None = None     # None: an emptyDir HF cache, filled from the Hub on start
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    target_cpu: str = "4"
    target_memory: str = "16Gi"
    draft_cpu: str = "2"
    draft_memory: str = "8Gi"
    # refused (draft_pool.py): the engine starts draft_workers draft workers once, so no autoscaler adds a pod;
    # kept so a caller passing them hears why. draft_max_workers may repeat draft_workers
    autoscaling: bool = False
    draft_max_workers: int | None = None
    idle_timeout_s: int | None = None
    upgrade_strategy: str = "NewCluster"  # UpgradeStrategy; None where the cluster can't hold a second copy
    drain_timeout_s: int = 30         # Ray's SIGTERM drain (its default, explicit); the pods' grace period exceeds it
    image_pull_secrets: tuple[str, ...] = ()  # Secrets for a private registry
    # more environment for every Ray container (e.g. OTEL_* for tracing): a {NAME: VALUE} mapping or "NAME=VALUE"
    # strings, kept as sorted (name, value) pairs; a name the manifests or KubeRay set is refused (deploy/extra_env.py)
    extra_env: tuple[tuple[str, str], ...] = ()
    # GCS fault tolerance (KubeRay gcsFaultToleranceOptions): the RayService's head keeps its state in a Redis
    # you run, so the workers and the app survive a head restart. None: off (the head is a single point of failure)
    gcs_ft_redis_address: str | None = None          # HOST:PORT
    gcs_ft_redis_password_secret: str | None = None  # Secret holding the Redis password (None: no password)
    gcs_ft_redis_password_secret_key: str = "password"

    def __post_init__(self):
        given = self._given_speculation()  # before "" becomes None: `--draft ""` beside a config is a conflict
        if isinstance(self.fan_out, list):
            object.__setattr__(self, "fan_out", tuple(self.fan_out))
        if isinstance(self.image_pull_secrets, (list, str)):
            secrets = [self.image_pull_secrets] if isinstance(self.image_pull_secrets, str) else self.image_pull_secrets
            object.__setattr__(self, "image_pull_secrets", tuple(secrets))
        if self.draft == "":
            object.__setattr__(self, "draft", None)  # `--draft ""`: no draft model
            if "mode" not in given and self.speculative_config is None:
                object.__setattr__(self, "mode", Mode.AR.value)  # so autoregressive, as `saguaro deploy k8s --draft ""`
        object.__setattr__(self, "extra_env", extra_env(self.extra_env))
        for name in ("gcs_ft_redis_address", "gcs_ft_redis_password_secret", "hf_token_secret", "models_pvc",
                     "gpu_type", "image_pull_policy", "otlp_traces_endpoint"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)  # "" = off, as in the Helm values
        if self.gpu_type and not self.gpu:
            object.__setattr__(self, "gpu", True)  # naming a GPU type asks for GPUs
        self._normalize_serve_options()
        self._apply_speculative_config(given)
        self._validate()

    def _given_speculation(self) -> dict:
        """The speculation fields the caller gave (not None: None is "not given", as in config_fields), as
        given; those left out take their defaults."""
        given = {}
        for name in SPECULATION_FIELDS:
            value = getattr(self, name)
            if isinstance(value, LeftOut):
                object.__setattr__(self, name, value.value)
            elif value is not None:
                given[name] = value
        return given

    def _normalize_serve_options(self):
        """Lists as tuples (the settings stay hashable), JSON text as what it spells, "" as unset (as in the
        Helm values), one served model name as that name (the manifest then reads as before)."""
        for name in CORS_LIST_ARGS:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, json_list(name, getattr(self, name)))
        for name in ("root_path", "response_role"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        object.__setattr__(self, "lora_modules", lora_modules(self.lora_modules))  # LoRAModule each, hashable
        traces = self.collect_detailed_traces  # a list, or vLLM's comma-separated text; "" / [] = none
        names = [part for n in ([traces] if isinstance(traces, str) else traces or ()) for part in str(n).split(",")]
        object.__setattr__(self, "collect_detailed_traces", tuple(n.strip() for n in names if n.strip()) or None)
        names = self.served_model_name
        if names == "" or (isinstance(names, (list, tuple)) and not names):
            object.__setattr__(self, "served_model_name", None)
        elif isinstance(names, (list, tuple)):
            object.__setattr__(self, "served_model_name", names[0] if len(names) == 1 else tuple(names))

    def _apply_speculative_config(self, given: dict):
        """speculative_config's fields replace those the caller left out (the cluster's shape follows the
        mode); one given that says something else is refused, even at its default's value, as `saguaro serve`
        refuses it."""
        spec = as_dict(self.speculative_config)
        if spec is None:
            return
        object.__setattr__(self, "speculative_config", spec)
        for name, value in config_fields(spec, given).items():
            object.__setattr__(self, name, getattr(value, "value", value))  # Mode.NGRAM -> "ngram"
        if not self.uses_draft:  # (ngram) no draft: the settings say so, and rebuilt from their fields stay valid
            object.__setattr__(self, "draft", None)
            object.__setattr__(self, "draft_revision", None)

    def _validate(self):
        parse_enum(Mode, self.mode, "mode")
        parse_enum(FallbackPolicy, self.fallback, "fallback")
        parse_enum(SchedulingPolicy, self.scheduling_policy, "scheduling_policy")
        parse_enum(UpgradeStrategy, self.upgrade_strategy, "upgrade_strategy")
        if self.image_pull_policy is not None:
            parse_enum(ImagePullPolicy, self.image_pull_policy, "image_pull_policy")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0 (0: no drain), got {self.drain_timeout_s}")
        self._check_object_names()
        self._check_gcs_fault_tolerance()
        self._check_server_options()
        if self.tp < 1 or self.draft_workers < 1:
            raise ValueError(f"tp and draft_workers must be >= 1, got tp={self.tp}, draft_workers={self.draft_workers}")
        check_fixed_draft_pool(self.autoscaling, self.draft_max_workers, self.idle_timeout_s, self.draft_workers)
        if not DNS_LABEL.fullmatch(self.name) or len(self.name) > 40:
            raise ValueError(f"name must be 1-40 lowercase letters, digits or '-', starting with a letter and ending "
                             f"with a letter or digit (a DNS-1035 label: it names Services, and KubeRay derives "
                             f"longer names from it), got {self.name!r}")
        if self.uses_draft and not self.draft:
            raise ValueError(f"mode {self.mode!r} needs a draft model, but draft is none (\"\"): give draft, or "
                             f"mode ar or ngram (mode left out beside draft \"\": ar)")
        config_from_args(serve_args(self))  # the app would reject these args at start-up: fail now
        self._check_cpus()

    def _check_server_options(self):
        """The app checks its server options only when a replica starts (config_from_args below checks the
        engine's): check them now, as `saguaro serve` does its flags. The flags are booleans here (serve_args
        turns them into args by truth), so a "no" must fail, not read as on."""
        size, interval = self.max_request_bytes, self.stream_interval_ms
        if size is not None and (type(size) is not int or size < 1):
            raise ValueError(f"max_request_bytes must be an integer >= 1, got {size!r}")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float))
                                     or not 0 <= interval <= 10_000):
            raise ValueError(f"stream_interval_ms must be a number in [0, 10000], got {interval!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "disable_log_stats", "enable_log_requests",
                     "allow_credentials", "disable_fastapi_docs", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("proposal_top_k", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if value is not None and type(value) is not int:  # Config's own check takes 2.0 or True for 2 / 1
                raise ValueError(f"{name} must be an integer, got {value!r}")
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and (not isinstance(endpoint, str) or not endpoint.strip()):
            raise ValueError(f"otlp_traces_endpoint must be a URL such as http://collector:4317, got {endpoint!r}")
        detailed_trace_modules(self.collect_detailed_traces, endpoint)  # vLLM's rule: none without the endpoint
        if self.root_path is not None and not isinstance(self.root_path, str):
            raise ValueError(f"root_path must be a path such as /llm, got {self.root_path!r}")
        if self.response_role is not None and (not isinstance(self.response_role, str) or not self.response_role.strip()):
            raise ValueError(f"response_role must be a non-empty role name (vLLM's --response-role), "
                             f"got {self.response_role!r}")
        args = serve_args(self)
        check_lora_modules(self.lora_modules, served_model_names(args.get("served_model_name"), self.model),
                           self.enable_lora)
        frontend_options(args)  # the replica's own checks (root_path's shape)

    def _check_object_names(self):
        """Names Kubernetes checks only as it creates the pods (a refusal then shows in the operator's events
        alone, the RayService never ready): the Secrets, their keys, the PVC, the GPU type's label value."""
        if self.api_key_secret == "":
            raise ValueError("api_key_secret is required: the Secret holding the API key (the pods refuse to start "
                             "without it)")
        check_subdomain("api_key_secret", self.api_key_secret, "a Secret")
        check_secret_key("api_key_secret_key", self.api_key_secret_key)
        if self.hf_token_secret is not None:
            check_subdomain("hf_token_secret", self.hf_token_secret, "a Secret")
        check_secret_key("hf_token_secret_key", self.hf_token_secret_key)
        if self.models_pvc is not None:
            check_subdomain("models_pvc", self.models_pvc, "a PersistentVolumeClaim")
        for name in self.image_pull_secrets:
            check_subdomain("image_pull_secrets", name, "Secrets")
        gpu_type = self.gpu_type
        if gpu_type is not None and (not isinstance(gpu_type, str) or not LABEL_VALUE.fullmatch(gpu_type)):
            raise ValueError(f"gpu_type must be a node label value (the nodes' nvidia.com/gpu.product, e.g. "
                             f"NVIDIA-H100-80GB-HBM3: at most 63 letters, digits, '-', '_' or '.', a letter or digit "
                             f"at each end), got {gpu_type!r}")

    def _check_gcs_fault_tolerance(self):
        address, secret, key = (self.gcs_ft_redis_address, self.gcs_ft_redis_password_secret,
                                self.gcs_ft_redis_password_secret_key)
        if address is not None and not REDIS_ADDRESS.fullmatch(address):
            raise ValueError(f"gcs_ft_redis_address must be HOST:PORT (a DNS name or IPv4 address, a port 1-65535; "
                             f"no scheme), got {address!r}")
        if secret is not None and address is None:
            raise ValueError("gcs_ft_redis_password_secret needs gcs_ft_redis_address (the Redis it is the password of)")
        if secret is not None:
            check_subdomain("gcs_ft_redis_password_secret", secret, "a Secret")
        check_secret_key("gcs_ft_redis_password_secret_key", key)

    def _check_cpus(self):
        """Ray's CPUs on each worker pod (its CPU limit, rounded up as KubeRay does) must hold what placement asks of
        them, or the ranks or drafts wait for ever. On CPUs each rank takes one CPU, all on the one target pod
        (STRICT_PACK), each draft worker one on its pod; the Serve replica takes one CPU on the target pod (it asks
        for the pod's FRONT_RESOURCE, serve_app.py), and it starts before them: the target pod needs tp + 1. On
        GPUs the actors take GPUs, and the replica a CPU of the target pod."""
        need = {"target": self.tp + 1 if not self.gpu else 1}
        if self.uses_draft and not self.gpu:
            need["draft"] = 1
        for role, cpus in need.items():
            quantity = getattr(self, f"{role}_cpu")
            if cpu_quantity(quantity) < cpus:
                why = (f"one per tensor-parallel rank ({self.tp}, packed on that pod) and one for the Serve replica"
                       if role == "target" and not self.gpu else
                       "the Serve replica's" if role == "target" else "the draft worker's")
                raise ValueError(f"{role}_cpu {quantity!r} gives Ray {int(cpu_quantity(quantity))} CPU(s) on the {role} "
                                 f"pod; it needs {cpus}: {why}")

    @property
    def container_image(self) -> str:
        """The image the pods run: `image`, or the one built from deploy/Dockerfile.cuda (GPUs) or .cpu."""
        return self.image or f"saguaro-dist:{APP_VERSION}-{'cuda' if self.gpu else 'cpu'}"

    @property
    def pull_policy(self) -> str:
        """image_pull_policy, or Kubernetes' default for the image: Always for the tag latest (or none), else
        IfNotPresent. Written out, so that the manifest says what the pods do."""
        if self.image_pull_policy is not None:
            return ImagePullPolicy(self.image_pull_policy).value
        latest = image_tag(self.container_image) == "latest"
        return (ImagePullPolicy.ALWAYS if latest else ImagePullPolicy.IF_NOT_PRESENT).value

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    @property
    def engine_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.gpu else "float32")

    @property
    def uses_draft(self) -> bool:
        """Whether the mode runs a draft model: without one (ar, ngram) no draft pods, no draft args."""
        return Mode(self.mode) in DRAFT_MODES


def cpu_quantity(quantity: str) -> float:
    """A Kubernetes CPU quantity ("4", "2.5", "500m") in the CPUs Ray gets: KubeRay passes the pod's limit to
    `ray start --num-cpus` as Quantity.Value(), which rounds a fraction up ("1500m" gives Ray 2)."""
    text = str(quantity).strip()
    try:
        cpus = Decimal(text[:-1]) / 1000 if text.endswith("m") else Decimal(text)
    except InvalidOperation:
        raise ValueError(f"not a Kubernetes CPU quantity: {quantity!r} (e.g. \"4\", \"2.5\", \"500m\")") from None
    if not cpus.is_finite() or cpus < 0:
        raise ValueError(f"not a Kubernetes CPU quantity: {quantity!r} (e.g. \"4\", \"2.5\", \"500m\")")
    return float(math.ceil(cpus))


def image_tag(image: str) -> str:
    """An image's tag as Kubernetes reads it: "latest" where it names none (and no digest), "" for a digest alone."""
    name, _, digest = image.partition("@")
    repository, _, tag = name.rpartition(":")
    if not repository or "/" in tag:  # no tag: the colon, if any, was a registry's port
        return "" if digest else "latest"
    return tag


def check_subdomain(field: str, value, what: str) -> None:
    """A Secret's or PVC's name: Kubernetes refuses a pod naming another as it creates it."""
    if not isinstance(value, str) or len(value) > MAX_SUBDOMAIN or not DNS_SUBDOMAIN.fullmatch(value):
        raise ValueError(f"{field} must name {what} (a DNS-1123 subdomain: lowercase letters, digits, '-' or '.', a "
                         f"letter or digit at each end, at most {MAX_SUBDOMAIN} characters), got {value!r}")


def check_secret_key(field: str, value) -> None:
    if not isinstance(value, str) or len(value) > MAX_SUBDOMAIN or not SECRET_KEY.fullmatch(value):
        raise ValueError(f"{field} must be a Secret key (letters, digits, '-', '_', '.', not starting with '..' nor "
                         f"'.' alone; at most {MAX_SUBDOMAIN} characters), got {value!r}")
