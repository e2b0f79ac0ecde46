"""KubeRay manifests for saguaro-dist, built as plain dicts by pure functions.

`saguaro deploy k8s` prints them; the Helm chart in deploy/helm/saguaro-dist renders the same
objects from values (`helm_values(settings)` gives the values for the same settings, and the tests
check that both agree). Layout: a Ray head that runs no work (`num-cpus: "0"`), a target worker
group (one pod holds all tensor-parallel ranks, GPUs = TP size) and a draft worker group (one pod and
one GPU per draft worker). The worker groups advertise the custom Ray resources the runtime's
placement options ask for (saguaro_dist.placement), so ranks and drafts land on their own pods.
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from saguaro_dist.config import DRAFT_MODES, FallbackPolicy, Mode, SchedulingPolicy, parse_enum
from saguaro_dist.placement import DRAFT_RESOURCE, RESOURCE_PER_ACTOR, TARGET_RESOURCE
from saguaro_dist.serve.args import API_KEY_ENV, config_from_args

DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Kubernetes' rule for a Service's name
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a Secret's name
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")  # Kubernetes' rule for a key in a Secret's data
# HOST:PORT of a Redis: a DNS name or IPv4 address, a port 1-65535 (the values schema has the same pattern)
PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
REDIS_ADDRESS = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*:" + PORT)

APP_IMPORT_PATH = "saguaro_dist.serve.app:build_app"
APP_NAME = "saguaro"
CHART_NAME = "saguaro-dist"
APP_VERSION = "0.1.0"
RAY_VERSION = "2.60.0"
SERVE_PORT = 8000
METRICS_PORT = 8080  # Ray's metrics export port on every node
DASHBOARD_PORT = 8265
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set by NVIDIA GPU feature discovery
MODELS_MOUNT = "/models"
RAY_UID = 1000  # the `ray` user of the official Ray images
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"  # Ray's SIGTERM drain window (`ray start --block`)
DRAIN_MARGIN_S = 15  # after the drain window: the raylet and its workers exit before Kubernetes' SIGKILL


class UpgradeStrategy(str, enum.Enum):
    """RayService spec.upgradeStrategy.type: what KubeRay does when the Ray cluster's spec changes."""

    NEW_CLUSTER = "NewCluster"  # blue/green: a second cluster (twice the GPUs for a while), then traffic moves
    NONE = "None"               # no new cluster: cluster changes wait for the RayService to be recreated


@dataclass(frozen=True)
class K8sSettings:
    """What a deployment varies; every field has a Helm value (see helm_values)."""

    name: str = "saguaro"
    model: str = "Qwen/Qwen3-1.7B"
    draft: str | None = "Qwen/Qwen3-0.6B"
    mode: str = "ssd"
    k: int = 4
    fan_out: int | tuple[int, ...] = 12
    saguaro_c: float = 1.0
    fallback: str = "auto"
    max_batch_size: int = 8
    max_model_len: int | None = None  # None: the model's own context; the KV cache's worst case must fit (model/memory.py)
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"   # or "priority": requests' `priority` orders the waiting queue
    dtype: str | None = None          # None: bfloat16 on GPU, float32 on CPU; "auto": each model's checkpoint dtype (vLLM's)
    served_model_name: str | None = None
    tool_call_parser: str | None = None  # tool_choice "auto": hermes (Qwen 2.5 / 3, Hermes), llama3_json, mistral
    reasoning_parser: str | None = None  # <think> text as the message's reasoning: qwen3, deepseek_r1
    generation_config: str = "auto"   # requests' sampling defaults: the model's generation_config.json, or "vllm" (none)
    revision: str | None = None       # the target's Hub revision (branch, tag or commit) when model is a Hub id
    draft_revision: str | None = None
    tokenizer: str | None = None      # a tokenizer (HF id or a path under /models) instead of the target's own
    tokenizer_revision: str | None = None
    chat_template: str | None = None  # a Jinja chat template (the text) instead of the tokenizer's
    tp: int = 1
    draft_workers: int = 1
    image: str | None = None          # None: saguaro-dist:<version>-cuda with GPUs, -cpu without (container_image)
    image_pull_policy: str = "IfNotPresent"
    gpu: bool = False
    gpu_type: str | None = None       # nvidia.com/gpu.product of the nodes to run on
    api_key_secret: str = "saguaro-api-key"
    api_key_secret_key: str = "api-key"
    hf_token_secret: str = "hf-token"
    hf_token_secret_key: str = "token"
    models_pvc: str | None = None     # None: an emptyDir HF cache, filled from the Hub on start
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    target_cpu: str = "4"
    target_memory: str = "16Gi"
    draft_cpu: str = "2"
    draft_memory: str = "8Gi"
    autoscaling: bool = False
    draft_max_workers: int | None = None  # autoscaling bound; None: draft_workers
    idle_timeout_s: int = 60
    upgrade_strategy: str = "NewCluster"  # UpgradeStrategy; None where the cluster can't hold a second copy
    drain_timeout_s: int = 30         # Ray's SIGTERM drain (its default, explicit); the pods' grace period exceeds it
    image_pull_secrets: tuple[str, ...] = ()  # Secrets for a private registry
    # GCS fault tolerance (KubeRay gcsFaultToleranceOptions): the RayService's head keeps its state in a Redis
    # you run, so the workers and the app survive a head restart. None: off (the head is a single point of failure)
    gcs_ft_redis_address: str | None = None          # HOST:PORT
    gcs_ft_redis_password_secret: str | None = None  # Secret holding the Redis password (None: no password)
    gcs_ft_redis_password_secret_key: str = "password"

    def __post_init__(self):
        if isinstance(self.fan_out, list):
            object.__setattr__(self, "fan_out", tuple(self.fan_out))
        if isinstance(self.image_pull_secrets, (list, str)):
            secrets = [self.image_pull_secrets] if isinstance(self.image_pull_secrets, str) else self.image_pull_secrets
            object.__setattr__(self, "image_pull_secrets", tuple(secrets))
        if self.draft == "":
            object.__setattr__(self, "draft", None)  # `--draft ""`: no draft model (mode ar)
        for name in ("gcs_ft_redis_address", "gcs_ft_redis_password_secret"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)  # "" = off, as in the Helm values
        if self.gpu_type and not self.gpu:
            object.__setattr__(self, "gpu", True)  # naming a GPU type asks for GPUs
        self._validate()

    def _validate(self):
        parse_enum(Mode, self.mode, "mode")
        parse_enum(FallbackPolicy, self.fallback, "fallback")
        parse_enum(SchedulingPolicy, self.scheduling_policy, "scheduling_policy")
        parse_enum(UpgradeStrategy, self.upgrade_strategy, "upgrade_strategy")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0 (0: no drain), got {self.drain_timeout_s}")
        bad = [name for name in self.image_pull_secrets if not DNS_SUBDOMAIN.fullmatch(name)]
        if bad:
            raise ValueError(f"image_pull_secrets must name Secrets (DNS-1123 subdomains), got {bad}")
        self._check_gcs_fault_tolerance()
        if self.tp < 1 or self.draft_workers < 1:
            raise ValueError(f"tp and draft_workers must be >= 1, got tp={self.tp}, draft_workers={self.draft_workers}")
        if self.draft_max_workers is not None and self.draft_max_workers < self.draft_workers:
            raise ValueError(f"draft_max_workers ({self.draft_max_workers}) must be >= draft_workers ({self.draft_workers})")
        if not DNS_LABEL.fullmatch(self.name) or len(self.name) > 40:
            raise ValueError(f"name must be 1-40 lowercase letters, digits or '-', starting with a letter and ending "
                             f"with a letter or digit (a DNS-1035 label: it names Services, and KubeRay derives "
                             f"longer names from it), got {self.name!r}")
        config_from_args(serve_args(self))  # the app would reject these args at start-up: fail now
        self._check_cpus()

    def _check_gcs_fault_tolerance(self):
        address, secret, key = (self.gcs_ft_redis_address, self.gcs_ft_redis_password_secret,
                                self.gcs_ft_redis_password_secret_key)
        if address is not None and not REDIS_ADDRESS.fullmatch(address):
            raise ValueError(f"gcs_ft_redis_address must be HOST:PORT (a DNS name or IPv4 address, a port 1-65535; "
                             f"no scheme), got {address!r}")
        if secret is not None and address is None:
            raise ValueError("gcs_ft_redis_password_secret needs gcs_ft_redis_address (the Redis it is the password of)")
        if secret is not None and not DNS_SUBDOMAIN.fullmatch(secret):
            raise ValueError(f"gcs_ft_redis_password_secret must name a Secret (a DNS-1123 subdomain), got {secret!r}")
        if not SECRET_KEY.fullmatch(key):
            raise ValueError(f"gcs_ft_redis_password_secret_key must be a Secret key (letters, digits, '-', '_', '.'), "
                             f"got {key!r}")

    def _check_cpus(self):
        """Ray's CPUs on each worker pod (its CPU limit, truncated as Ray does) must hold what placement asks of
        them, or the ranks or drafts wait for ever. On CPUs each rank takes one CPU, all on the one target pod
        (STRICT_PACK), each draft worker one on its pod; the Serve replica takes one CPU wherever it lands (the
        head has none), and it starts before them: the target pod needs tp + 1 (a replica there first left the
        ranks tp - 1). On GPUs the actors take GPUs, and the replica a CPU of a worker pod."""
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
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    @property
    def engine_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.gpu else "float32")

    @property
    def draft_max(self) -> int:
        return self.draft_max_workers or self.draft_workers

    @property
    def uses_draft(self) -> bool:
        """Whether the mode runs a draft model: without one (ar, ngram) no draft pods, no draft args."""
        return Mode(self.mode) in DRAFT_MODES


def cpu_quantity(quantity: str) -> float:
    """A Kubernetes CPU quantity ("4", "2.5", "500m") in CPUs; Ray counts whole ones (it truncates a fraction)."""
    text = str(quantity).strip()
    try:
        cpus = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ValueError(f"not a Kubernetes CPU quantity: {quantity!r} (e.g. \"4\", \"2.5\", \"500m\")") from None
    return float(int(cpus))


# ---- Serve application ----------------------------------------------------------------------

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
            "api_key_env": API_KEY_ENV, "served_model_name": s.served_model_name,
            "tool_call_parser": s.tool_call_parser, "reasoning_parser": s.reasoning_parser,
            "scheduling_policy": None if s.scheduling_policy == "fcfs" else s.scheduling_policy,
            "generation_config": None if s.generation_config == "auto" else s.generation_config,
            "chat_template": s.chat_template}
    return {key: value for key, value in args.items() if value is not None}


def serve_config(s: K8sSettings) -> dict:
    """The Serve config (ray.serve.schema.ServeDeploySchema) that KubeRay deploys."""
    app = {"name": APP_NAME, "route_prefix": "/", "import_path": APP_IMPORT_PATH, "args": serve_args(s)}
    return {"proxy_location": "EveryNode",
            "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
            "applications": [app]}


# ---- Labels, resources, containers ----------------------------------------------------------

def selector_labels(s: K8sSettings) -> dict:
    # not app.kubernetes.io/name: KubeRay labels its pods with its own name there
    return {"app.kubernetes.io/part-of": CHART_NAME, "app.kubernetes.io/instance": s.name}


def object_labels(s: K8sSettings) -> dict:
    return {"app.kubernetes.io/name": CHART_NAME, **selector_labels(s), "app.kubernetes.io/version": APP_VERSION,
            "app.kubernetes.io/managed-by": "saguaro"}


def ray_resources_param(resources: dict) -> str:
    """rayStartParams `resources`: KubeRay passes it to `ray start` through a shell, hence the quoting."""
    return json.dumps(json.dumps(resources, separators=(",", ":")))


def _compute(cpu: str, memory: str, gpus: int) -> dict:
    amounts = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts[GPU_RESOURCE] = gpus
    # requests == limits: Guaranteed QoS, so GPU pods are not evicted under memory pressure
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env(s: K8sSettings) -> list:
    return [
        {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": s.api_key_secret, "key": s.api_key_secret_key}}},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": s.hf_token_secret, "key": s.hf_token_secret_key, "optional": True}}},
        {"name": "HF_HOME", "value": f"{MODELS_MOUNT}/hf-cache"},
    ]


def _ray_env(s: K8sSettings) -> list:
    """A Ray container's environment: the app's, and Ray's drain window on SIGTERM (explicit: the pod's grace
    period is derived from it)."""
    return _env(s) + [{"name": DRAIN_ENV, "value": str(s.drain_timeout_s)}]


def _security_context() -> dict:
    return {"runAsNonRoot": True, "runAsUser": RAY_UID, "allowPrivilegeEscalation": False}


def _ports(head: bool) -> list:
    ports = [{"name": "metrics", "containerPort": METRICS_PORT}]
    if head:
        ports = [{"name": "gcs-server", "containerPort": 6379},
                 {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                 {"name": "client", "containerPort": 10001},
                 {"name": "serve", "containerPort": SERVE_PORT}] + ports
    return ports


# KubeRay's own probes (pod.go, initReadinessProbe / initLivenessProbe), written out: a probe given in
# the manifest replaces KubeRay's whole, so each must hold all KubeRay's checks and thresholds.
RAYLET_HEALTH = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
GCS_HEALTH = f"wget -T 2 -q -O- http://localhost:{DASHBOARD_PORT}/api/gcs_healthz | grep success"
# A RayService's workers are ready only with a healthy Serve proxy on the pod: the Serve Service selects
# every worker, and Serve runs proxies only where replicas run (EveryNode), so a draft pod has none.
SERVE_HEALTH = f"wget -T 2 -q -O- http://localhost:{SERVE_PORT}/-/healthz | grep success"


def _probe(checks: list, initial_delay_s: int, timeout_s: int, failures: int) -> dict:
    return {"exec": {"command": ["bash", "-c", " && ".join(checks)]}, "initialDelaySeconds": initial_delay_s,
            "periodSeconds": 5, "timeoutSeconds": timeout_s, "failureThreshold": failures}


def _probes(head: bool, serving: bool) -> dict:
    """serving: a RayService worker. Liveness waits 10 minutes (120 x 5 s) before a restart; readiness restarts
    nothing and has no start-up to wait out, and a serving worker leaves the Service at its proxy's first
    failure (a draining proxy fails it): KubeRay's values."""
    checks = [RAYLET_HEALTH, GCS_HEALTH] if head else [RAYLET_HEALTH]
    timeout_s = 5 if head else 2  # the head's checks call two endpoints
    if serving:
        readiness = _probe(checks + [SERVE_HEALTH], 10, timeout_s, 1)
    else:
        readiness = _probe(checks, 10, timeout_s, 10)
    return {"readinessProbe": readiness, "livenessProbe": _probe(checks, 30, timeout_s, 120)}


def _container(s: K8sSettings, cpu: str, memory: str, gpus: int, head: bool, serving: bool) -> dict:
    return {"name": "ray-head" if head else "ray-worker", "image": s.container_image,
            "imagePullPolicy": s.image_pull_policy, "env": _ray_env(s), "ports": _ports(head),
            "resources": _compute(cpu, memory, gpus), "securityContext": _security_context(),
            "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT},
                             {"name": "dshm", "mountPath": "/dev/shm"}],
            **_probes(head, serving)}


def _volumes(s: K8sSettings) -> list:
    if s.models_pvc:
        models = {"name": "models", "persistentVolumeClaim": {"claimName": s.models_pvc}}
    else:
        models = {"name": "models", "emptyDir": {}}
    # Ray's object store lives in /dev/shm; the container default (64 MiB) is far too small
    return [models, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def _pull_secrets(s: K8sSettings) -> dict:
    return {"imagePullSecrets": [{"name": name} for name in s.image_pull_secrets]} if s.image_pull_secrets else {}


def _pod_template(s: K8sSettings, container: dict, gpus: int) -> dict:
    # the grace period outlasts Ray's drain window, or Kubernetes kills the pod while Serve still drains it
    spec = {"containers": [container], "volumes": _volumes(s),
            "securityContext": {"fsGroup": RAY_UID},
            "terminationGracePeriodSeconds": s.drain_timeout_s + DRAIN_MARGIN_S, **_pull_secrets(s)}
    if gpus and s.gpu_type:
        spec["nodeSelector"] = {GPU_PRODUCT_LABEL: s.gpu_type}
    if gpus:
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": selector_labels(s)}, "spec": spec}


# ---- Ray cluster -----------------------------------------------------------------------------

def head_group(s: K8sSettings) -> dict:
    # num-cpus 0: the head only coordinates; no Serve replica, rank or draft lands on it. Its probes never
    # check Serve: KubeRay checks the head's proxy itself (a failing head probe would cut the workers off)
    params = {"num-cpus": "0", "dashboard-host": "0.0.0.0", "metrics-export-port": str(METRICS_PORT)}
    container = _container(s, s.head_cpu, s.head_memory, 0, head=True, serving=False)
    return {"rayStartParams": params, "template": _pod_template(s, container, 0)}


def _worker_group(s: K8sSettings, name: str, resources: dict, gpus: int, bounds: tuple, serving: bool) -> dict:
    replicas, max_replicas = bounds
    cpu, memory = (s.target_cpu, s.target_memory) if name == "target" else (s.draft_cpu, s.draft_memory)
    params = {"resources": ray_resources_param(resources), "metrics-export-port": str(METRICS_PORT)}
    container = _container(s, cpu, memory, gpus, head=False, serving=serving)
    # minReplicas = replicas: the app's ranks and draft workers live there; only extra pods come and go
    return {"groupName": name, "replicas": replicas, "minReplicas": replicas,
            "maxReplicas": max_replicas, "rayStartParams": params,
            "template": _pod_template(s, container, gpus)}


def target_group(s: K8sSettings, serving: bool = True) -> dict:
    """One pod holding every tensor-parallel rank: TP over NVLink inside a node, not across pods."""
    resources = {TARGET_RESOURCE: s.tp * RESOURCE_PER_ACTOR}
    return _worker_group(s, "target", resources, s.tp if s.gpu else 0, (1, 1), serving)


def draft_group(s: K8sSettings, serving: bool = True) -> dict:
    """One pod per draft worker, one GPU each; the pool scales up to draft_max."""
    resources = {DRAFT_RESOURCE: RESOURCE_PER_ACTOR}
    return _worker_group(s, "draft", resources, 1 if s.gpu else 0, (s.draft_workers, s.draft_max), serving)


def gcs_fault_tolerance(s: K8sSettings) -> dict:
    """KubeRay's gcsFaultToleranceOptions (KubeRay 1.3+). KubeRay sets the head's RAY_REDIS_ADDRESS and
    REDIS_PASSWORD from it, RAY_external_storage_namespace on every pod (left to KubeRay: the cluster's UID, so a
    NewCluster upgrade's second cluster never reads the first's Serve state), and the workers' GCS reconnect
    timeout (600 s, past the head's restart). No `backend` field: KubeRay before 1.7 has none (Redis is the default)."""
    options = {"redisAddress": s.gcs_ft_redis_address}
    if s.gcs_ft_redis_password_secret:
        options["redisPassword"] = {"valueFrom": {"secretKeyRef": {
            "name": s.gcs_ft_redis_password_secret, "key": s.gcs_ft_redis_password_secret_key}}}
    return options


def ray_cluster_spec(s: K8sSettings, serving: bool = True) -> dict:
    """serving: the cluster of a RayService (its workers' readiness includes their Serve proxy). GCS fault
    tolerance goes on that one only: Ray supports it for Serve, and a batch job's driver dies with the head anyway."""
    workers = [target_group(s, serving), draft_group(s, serving)] if s.uses_draft else [target_group(s, serving)]
    spec = {"rayVersion": RAY_VERSION, "enableInTreeAutoscaling": s.autoscaling,
            "headGroupSpec": head_group(s), "workerGroupSpecs": workers}
    if serving and s.gcs_ft_redis_address:
        spec["gcsFaultToleranceOptions"] = gcs_fault_tolerance(s)
    if s.autoscaling:
        spec["autoscalerOptions"] = {"upscalingMode": "Default", "idleTimeoutSeconds": s.idle_timeout_s}
    return spec


# ---- Top-level objects -----------------------------------------------------------------------

def _metadata(s: K8sSettings, name: str) -> dict:
    return {"name": name, "labels": object_labels(s)}


def serve_service(s: K8sSettings) -> dict:
    """The Service in front of the Serve proxies (KubeRay keeps its selector on ready proxies)."""
    return {"metadata": _metadata(s, f"{s.name}-serve"),
            "spec": {"type": "ClusterIP", "ports": [
                {"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT, "protocol": "TCP"}]}}


def rayservice(s: K8sSettings) -> dict:
    """The RayService: the Ray cluster plus the Serve app KubeRay deploys and keeps healthy on it."""
    spec = {"upgradeStrategy": {"type": s.upgrade_strategy}, "serveConfigV2": to_yaml([serve_config(s)]),
            "serveService": serve_service(s), "rayClusterConfig": ray_cluster_spec(s, serving=True)}
    return {"apiVersion": "ray.io/v1", "kind": "RayService",
            "metadata": _metadata(s, s.name), "spec": spec}


def raycluster(s: K8sSettings) -> dict:
    """A RayCluster with the same groups, for batch generation jobs (`ray job submit`)."""
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": _metadata(s, f"{s.name}-batch"), "spec": ray_cluster_spec(s, serving=False)}


BATCH_MOUNT = "/data"


def batch_job(s: K8sSettings, pvc: str, input_file: str, output_file: str) -> dict:
    """A Job that runs `saguaro run-batch --url` against the RayService's Serve Service: an OpenAI batch
    file on a PVC (mounted at /data) in, its results beside it. No GPU and no model in the Job's pod; the
    RayService does the work. backoffLimit 0: a retry would resend every line, so a rerun is the user's call."""
    command = ["saguaro", "run-batch", "-i", f"{BATCH_MOUNT}/{input_file}", "-o", f"{BATCH_MOUNT}/{output_file}",
               "--url", f"http://{s.name}-serve:{SERVE_PORT}"]
    container = {"name": "run-batch", "image": s.container_image, "imagePullPolicy": s.image_pull_policy, "command": command,
                 "env": _env(s)[:1], "resources": _compute("1", "1Gi", 0), "securityContext": _security_context(),
                 "volumeMounts": [{"name": "data", "mountPath": BATCH_MOUNT}]}
    pod = {"restartPolicy": "Never", "containers": [container], "securityContext": {"fsGroup": RAY_UID},
           "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": pvc}}], **_pull_secrets(s)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(s, f"{s.name}-run-batch"),
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": _job_pod_labels(s)}, "spec": pod}}}


def _job_pod_labels(s: K8sSettings) -> dict:
    """Not selector_labels: the metrics Service selects by those, and this pod has no metrics to scrape."""
    return {"app.kubernetes.io/name": f"{CHART_NAME}-run-batch", "app.kubernetes.io/instance": s.name,
            "app.kubernetes.io/managed-by": "saguaro"}


def metrics_service(s: K8sSettings) -> dict:
    """A headless Service over every Ray pod's metrics port, for Prometheus to scrape. Not-ready pods too: a
    RayService worker holding no Serve proxy (a draft pod) is never Ready, as KubeRay's own probe has it."""
    spec = {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector_labels(s),
            "ports": [{"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"}]}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(s, f"{s.name}-metrics"), "spec": spec}


def service_monitor(s: K8sSettings, interval: str = "30s") -> dict:
    """prometheus-operator's ServiceMonitor for metrics_service."""
    spec = {"selector": {"matchLabels": selector_labels(s)},
            "endpoints": [{"port": "metrics", "interval": interval, "path": "/metrics"}]}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _metadata(s, s.name), "spec": spec}


# ---- Helm ------------------------------------------------------------------------------------

def _split_image(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:  # no tag, or the colon was a registry port
        return image, "latest"
    return repository, tag


def helm_values(s: K8sSettings) -> dict:
    """Values for deploy/helm/saguaro-dist that render the same objects as these settings."""
    repository, tag = _split_image(s.container_image)
    return {
        "fullnameOverride": s.name,
        "image": {"repository": repository, "tag": tag, "pullPolicy": s.image_pull_policy,
                  "pullSecrets": list(s.image_pull_secrets)},
        "model": {"target": s.model, "draft": s.draft or "", "servedModelName": s.served_model_name or "",
                  "toolCallParser": s.tool_call_parser or "", "reasoningParser": s.reasoning_parser or "",
                  "generationConfig": s.generation_config, "chatTemplate": s.chat_template or "",
                  "revision": s.revision or "", "draftRevision": s.draft_revision or "",
                  "tokenizer": s.tokenizer or "", "tokenizerRevision": s.tokenizer_revision or ""},
        "speculation": {"mode": s.mode, "k": s.k, "saguaroC": s.saguaro_c, "fallback": s.fallback,
                        "fanOut": list(s.fan_out) if isinstance(s.fan_out, tuple) else s.fan_out},
        "engine": {"maxBatchSize": s.max_batch_size, "maxModelLen": s.max_model_len or 0,
                   "gpuMemoryUtilization": s.gpu_memory_utilization, "dtype": s.dtype or "",
                   "schedulingPolicy": s.scheduling_policy},
        "gpu": {"enabled": s.gpu, "type": s.gpu_type or ""},
        "head": {"resources": {"cpu": s.head_cpu, "memory": s.head_memory}},
        "target": {"tensorParallelSize": s.tp, "resources": {"cpu": s.target_cpu, "memory": s.target_memory}},
        "draft": {"workers": s.draft_workers, "resources": {"cpu": s.draft_cpu, "memory": s.draft_memory}},
        "autoscaling": {"enabled": s.autoscaling, "draftMaxWorkers": s.draft_max_workers or 0,
                        "idleTimeoutSeconds": s.idle_timeout_s},
        "apiKey": {"secretName": s.api_key_secret, "secretKey": s.api_key_secret_key},
        "hfToken": {"secretName": s.hf_token_secret, "secretKey": s.hf_token_secret_key},
        "modelStorage": {"pvc": s.models_pvc or ""},
        "upgradeStrategy": s.upgrade_strategy,
        "termination": {"drainTimeoutSeconds": s.drain_timeout_s},
        "gcsFaultTolerance": {"redisAddress": s.gcs_ft_redis_address or "",
                              "redisPassword": {"secretName": s.gcs_ft_redis_password_secret or "",
                                                "secretKey": s.gcs_ft_redis_password_secret_key}},
    }


# ---- YAML ------------------------------------------------------------------------------------

def _yaml_dumper():
    import yaml  # only for output: the builders above need no YAML

    class Dumper(yaml.SafeDumper):
        pass

    def str_block(dumper, value):
        # multi-line strings (serveConfigV2) as readable `|` blocks, not escaped one-liners
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, str_block)
    return Dumper


def to_yaml(docs: list[dict]) -> str:
    """Documents as one YAML stream, keys in the order they were built."""
    import yaml

    return yaml.dump_all(docs, Dumper=_yaml_dumper(), sort_keys=False, default_flow_style=False)
