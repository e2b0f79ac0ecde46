"""The Ray cluster spec: a head that runs no work, the target and draft worker groups, GCS fault tolerance.
The worker groups advertise the custom Ray resources the runtime's placement asks for (saguaro_dist.placement)."""
from __future__ import annotations

from saguaro_dist.deploy.constants import DRAFT_WORKERS_ANNOTATION, METRICS_PORT, RAY_VERSION, TP_ANNOTATION
from saguaro_dist.deploy.pods import pod_template, ray_container, ray_resources_param
from saguaro_dist.deploy.settings import K8sSettings
from saguaro_dist.placement import DRAFT_RESOURCE, FRONT_RESOURCE, RESOURCE_PER_ACTOR, TARGET_RESOURCE


def head_group(s: K8sSettings) -> dict:
    # num-cpus 0: the head only coordinates; no Serve replica, rank or draft lands on it. Its probes never
    # check Serve: KubeRay checks the head's proxy itself (a failing head probe would cut the workers off)
    params = {"num-cpus": "0", "dashboard-host": "0.0.0.0", "metrics-export-port": str(METRICS_PORT)}
    container = ray_container(s, s.head_cpu, s.head_memory, 0, head=True, serving=False)
    return {"rayStartParams": params, "template": pod_template(s, container, 0)}


def _worker_group(s: K8sSettings, name: str, resources: dict, gpus: int, replicas: int, serving: bool,
                  annotations: dict) -> dict:
    cpu, memory = (s.target_cpu, s.target_memory) if name == "target" else (s.draft_cpu, s.draft_memory)
    params = {"resources": ray_resources_param(resources), "metrics-export-port": str(METRICS_PORT)}
    container = ray_container(s, cpu, memory, gpus, head=False, serving=serving)
    # min = max = replicas: the app's ranks and draft workers live there, and the engine never asks for more
    # (draft_pool.py), so no autoscaler would add a pod
    return {"groupName": name, "replicas": replicas, "minReplicas": replicas,
            "maxReplicas": replicas, "rayStartParams": params,
            "template": pod_template(s, container, gpus, annotations)}


def target_group(s: K8sSettings, serving: bool = True) -> dict:
    """One pod holding every tensor-parallel rank (TP over NVLink inside a node, not across pods) and the Serve
    replica (its one FRONT_RESOURCE slot), which owns the ranks: on a draft pod, that pod's loss took them too. The
    annotation makes tp a field KubeRay hashes (constants.py TP_ANNOTATION)."""
    resources = {TARGET_RESOURCE: s.tp * RESOURCE_PER_ACTOR, FRONT_RESOURCE: RESOURCE_PER_ACTOR}
    return _worker_group(s, "target", resources, s.tp if s.gpu else 0, 1, serving, {TP_ANNOTATION: str(s.tp)})


def draft_group(s: K8sSettings, serving: bool = True) -> dict:
    """One pod per draft worker, one GPU each: draft_workers pods, the pool the engine starts. The pool's size is
    also an annotation: KubeRay's RayService hashes the cluster spec without the groups' replicas, so a new
    size rolls out a new cluster only through a field it hashes (constants.py DRAFT_WORKERS_ANNOTATION)."""
    resources = {DRAFT_RESOURCE: RESOURCE_PER_ACTOR}
    return _worker_group(s, "draft", resources, 1 if s.gpu else 0, s.draft_workers, serving,
                         {DRAFT_WORKERS_ANNOTATION: str(s.draft_workers)})


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
    spec = {"rayVersion": RAY_VERSION, "enableInTreeAutoscaling": False,  # nothing to add: draft_pool.py
            "headGroupSpec": head_group(s), "workerGroupSpecs": workers}
    if serving and s.gcs_ft_redis_address:
        spec["gcsFaultToleranceOptions"] = gcs_fault_tolerance(s)
    return spec
