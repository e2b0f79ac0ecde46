"""Pods of the Ray cluster: labels, resources, environment, probes, containers and pod templates."""
from __future__ import annotations

import json

from saguaro_dist.deploy.constants import (
    APP_VERSION,
    CHART_NAME,
    DASHBOARD_PORT,
    DRAIN_ENV,
    DRAIN_MARGIN_S,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    METRICS_PORT,
    MODELS_MOUNT,
    RAY_UID,
    SERVE_PORT,
)
from saguaro_dist.deploy.extra_env import env_entries
from saguaro_dist.deploy.settings import K8sSettings
from saguaro_dist.serve.args import API_KEY_ENV


def selector_labels(s: K8sSettings) -> dict:
    # not app.kubernetes.io/name: KubeRay labels its pods with its own name there
    return {"app.kubernetes.io/part-of": CHART_NAME, "app.kubernetes.io/instance": s.name}


def object_labels(s: K8sSettings) -> dict:
    return {"app.kubernetes.io/name": CHART_NAME, **selector_labels(s), "app.kubernetes.io/version": APP_VERSION,
            "app.kubernetes.io/managed-by": "saguaro"}


def ray_resources_param(resources: dict) -> str:
    """rayStartParams `resources`: KubeRay passes it to `ray start` through a shell, hence the quoting. Keys
    sorted, as the chart's toJson writes them."""
    return json.dumps(json.dumps(resources, separators=(",", ":"), sort_keys=True))


def compute_resources(cpu: str, memory: str, gpus: int) -> dict:
    amounts = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts[GPU_RESOURCE] = gpus
    # requests == limits: Guaranteed QoS, so GPU pods are not evicted under memory pressure
    return {"requests": dict(amounts), "limits": dict(amounts)}


def app_env(s: K8sSettings) -> list:
    """The API key first (the batch Job takes it alone); the HF token where a Secret is named (optional: gated
    models only)."""
    env = [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": s.api_key_secret, "key": s.api_key_secret_key}}}]
    if s.hf_token_secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": s.hf_token_secret, "key": s.hf_token_secret_key, "optional": True}}})
    return env + [{"name": "HF_HOME", "value": f"{MODELS_MOUNT}/hf-cache"}]


def _ray_env(s: K8sSettings) -> list:
    """A Ray container's environment: the app's, Ray's drain window on SIGTERM (explicit: the pod's grace
    period is derived from it), then the user's extra_env (none of these names: K8sSettings refuses them)."""
    return app_env(s) + [{"name": DRAIN_ENV, "value": str(s.drain_timeout_s)}] + env_entries(s.extra_env)


def security_context() -> dict:
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


def ray_container(s: K8sSettings, cpu: str, memory: str, gpus: int, head: bool, serving: bool) -> dict:
    return {"name": "ray-head" if head else "ray-worker", "image": s.container_image,
            "imagePullPolicy": s.pull_policy, "env": _ray_env(s), "ports": _ports(head),
            "resources": compute_resources(cpu, memory, gpus), "securityContext": security_context(),
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


def pull_secrets(s: K8sSettings) -> dict:
    return {"imagePullSecrets": [{"name": name} for name in s.image_pull_secrets]} if s.image_pull_secrets else {}


def pod_template(s: K8sSettings, container: dict, gpus: int, annotations: dict | None = None) -> dict:
    # the grace period outlasts Ray's drain window, or Kubernetes kills the pod while Serve still drains it
    spec = {"containers": [container], "volumes": _volumes(s),
            "securityContext": {"fsGroup": RAY_UID},
            "terminationGracePeriodSeconds": s.drain_timeout_s + DRAIN_MARGIN_S, **pull_secrets(s)}
    if gpus and s.gpu_type:
        spec["nodeSelector"] = {GPU_PRODUCT_LABEL: s.gpu_type}
    if gpus:
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    metadata = {"labels": selector_labels(s), **({"annotations": annotations} if annotations else {})}
    return {"metadata": metadata, "spec": spec}
