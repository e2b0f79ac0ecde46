"""KubeRay manifests for saguaro-dist, built as plain dicts by pure functions.

`saguaro deploy k8s` prints them; the Helm chart in deploy/helm/saguaro-dist renders the same
objects from values (`helm_values(settings)` gives the values for the same settings, and the tests
check that both agree). Layout: a Ray head that runs no work (`num-cpus: "0"`), a target worker
group (one pod holds all tensor-parallel ranks, GPUs = TP size) and a draft worker group (one pod and
one GPU per draft worker). The worker groups advertise the custom Ray resources the runtime's
placement options ask for (saguaro_dist.placement), so ranks and drafts land on their own pods.

This module builds the top-level objects and writes YAML; the parts live beside it: settings
(K8sSettings), serve_app (serveConfigV2), pods (containers, pod templates), cluster (the Ray cluster
spec), helm (the chart's values), constants. Their public names are re-exported here, where users and
tests import them from.
"""
from __future__ import annotations

from saguaro_dist.deploy.cluster import (
    draft_group,
    gcs_fault_tolerance,
    head_group,
    ray_cluster_spec,
    target_group,
)
from saguaro_dist.deploy.constants import (
    APP_IMPORT_PATH,
    APP_NAME,
    APP_VERSION,
    CHART_NAME,
    DASHBOARD_PORT,
    DNS_LABEL,
    DNS_SUBDOMAIN,
    DRAIN_ENV,
    DRAIN_MARGIN_S,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    LABEL_VALUE,
    METRICS_PORT,
    MODELS_MOUNT,
    PORT,
    RAY_UID,
    RAY_VERSION,
    REDIS_ADDRESS,
    SECRET_KEY,
    SERVE_PORT,
)
from saguaro_dist.deploy.helm import helm_values
from saguaro_dist.deploy.pods import (
    GCS_HEALTH,
    RAYLET_HEALTH,
    SERVE_HEALTH,
    app_env,
    compute_resources,
    object_labels,
    pull_secrets,
    ray_resources_param,
    security_context,
    selector_labels,
)
from saguaro_dist.deploy.serve_app import serve_args, serve_config
from saguaro_dist.deploy.settings import (
    SPECULATION_FIELDS,
    ImagePullPolicy,
    K8sSettings,
    UpgradeStrategy,
    cpu_quantity,
)

__all__ = [
    # settings and the parts' builders, re-exported
    "K8sSettings", "UpgradeStrategy", "ImagePullPolicy", "cpu_quantity", "SPECULATION_FIELDS", "serve_args",
    "serve_config", "selector_labels",
    "object_labels", "ray_resources_param", "head_group", "target_group", "draft_group", "gcs_fault_tolerance",
    "ray_cluster_spec", "helm_values",
    # constants, re-exported
    "APP_IMPORT_PATH", "APP_NAME", "APP_VERSION", "CHART_NAME", "DASHBOARD_PORT", "DNS_LABEL", "DNS_SUBDOMAIN",
    "DRAIN_ENV", "DRAIN_MARGIN_S", "GPU_PRODUCT_LABEL", "GPU_RESOURCE", "LABEL_VALUE", "METRICS_PORT",
    "MODELS_MOUNT", "PORT", "RAY_UID", "RAY_VERSION", "REDIS_ADDRESS", "SECRET_KEY", "SERVE_PORT", "RAYLET_HEALTH",
    "GCS_HEALTH", "SERVE_HEALTH",
    # this module's own
    "serve_service", "rayservice", "raycluster", "BATCH_MOUNT", "batch_job", "metrics_service", "service_monitor",
    "to_yaml",
]


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
    container = {"name": "run-batch", "image": s.container_image, "imagePullPolicy": s.pull_policy, "command": command,
                 "env": app_env(s)[:1], "resources": compute_resources("1", "1Gi", 0), "securityContext": security_context(),
                 "volumeMounts": [{"name": "data", "mountPath": BATCH_MOUNT}]}
    pod = {"restartPolicy": "Never", "containers": [container], "securityContext": {"fsGroup": RAY_UID},
           "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": pvc}}], **pull_secrets(s)}
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
