"""Offline validation of the deployment manifests against the real schemas.

- ray.io kinds: the KubeRay CRDs' OpenAPI v3 schemas, checked with jsonschema. Made strict the way
  kubeconform's strict mode does (unknown fields are errors, not silently pruned by the API server), so
  a misspelt field fails here instead of vanishing on the cluster.
- built-in kinds (Service, Secret, PersistentVolumeClaim): Kubernetes' own schemas, via
  kubernetes-validate (strict).
- ServiceMonitor: prometheus-operator's schema as shipped in the cloudcoil-models-prometheus-operator
  models (generated from its CRDs).
- serveConfigV2: Ray's own ray.serve.schema.ServeDeploySchema, and the app args through
  saguaro_dist.serve.args.config_from_args.

The validators are test-time tools: their packages (jsonschema, kubernetes-validate, cloudcoil models)
are imported where used, so importing this module needs none of them.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
KUBERNETES_VERSION = "1.30.0"  # oldest Kubernetes we document; its schemas ship with kubernetes-validate


def load_yaml(text: str):
    import yaml

    # the CRDs are ~1 MB each: libyaml's loader reads them 10x faster where PyYAML has it
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def crd_schema(crd_dir: Path, kind: str, version: str = "v1") -> dict:
    """The openAPIV3Schema of `kind` at `version`, from the CRD file in crd_dir."""
    crd = load_yaml((Path(crd_dir) / CRD_FILES[kind]).read_text())
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise ValueError(f"{CRD_FILES[kind]} has no version {version!r}")


def strict(schema: dict) -> dict:
    """A copy where objects with declared properties reject unknown fields (kubeconform -strict)."""
    schema = copy.deepcopy(schema)
    _close_objects(schema)
    return schema


def _close_objects(node) -> None:
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    open_ended = node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in node
    if "properties" in node and not open_ended:
        node["additionalProperties"] = False
    for value in node.values():
        _close_objects(value)


@functools.lru_cache(maxsize=8)
def _crd_validator(crd_dir: str, kind: str, version: str):
    import jsonschema

    # cached: building the strict schema of one CRD takes seconds, validating an object milliseconds
    return jsonschema.Draft7Validator(strict(crd_schema(Path(crd_dir), kind, version)))


def validate_crd_object(obj: dict, crd_dir: Path) -> None:
    """Raise jsonschema.ValidationError where a RayService / RayCluster breaks its CRD schema."""
    api_version = obj.get("apiVersion", "")
    if not api_version.startswith("ray.io/") or obj.get("kind") not in CRD_FILES:
        raise ValueError(f"not a KubeRay object: {api_version} {obj.get('kind')}")
    validator = _crd_validator(str(Path(crd_dir).resolve()), obj["kind"], api_version.split("/", 1)[1])
    validator.validate(obj)


# KubeRay's own checks of gcsFaultToleranceOptions (ray-operator utils/validation.go), which no schema holds:
# the options set what these would, so a cluster carrying both is refused by the operator.
GCS_FT_HEAD_ENV = ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME")
GCS_FT_START_PARAMS = ("redis-password", "redis-username")
GCS_FT_ANNOTATIONS = ("ray.io/ft-enabled", "ray.io/external-storage-namespace")


def validate_gcs_fault_tolerance(obj: dict) -> None:
    """Raise ValueError where a RayService / RayCluster breaks KubeRay's rules for gcsFaultToleranceOptions."""
    spec = obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]
    options = spec.get("gcsFaultToleranceOptions")
    if options is None:
        return
    if options.get("backend", "redis") == "redis" and not options.get("redisAddress"):
        raise ValueError("gcsFaultToleranceOptions with the Redis backend needs redisAddress")
    head = spec["headGroupSpec"]
    env = {e["name"] for c in head["template"]["spec"]["containers"] for e in c.get("env", [])}
    annotations = obj.get("metadata", {}).get("annotations", {})
    clashes = ([f"head env {n}" for n in GCS_FT_HEAD_ENV if n in env]
               + [f"rayStartParams {p}" for p in GCS_FT_START_PARAMS if p in head.get("rayStartParams", {})]
               + [f"annotation {a}" for a in GCS_FT_ANNOTATIONS if a in annotations])
    if clashes:
        raise ValueError(f"gcsFaultToleranceOptions is set: KubeRay refuses {', '.join(clashes)} beside it")


def validate_builtin(obj: dict, kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """Raise kubernetes_validate.ValidationError where a built-in kind breaks Kubernetes' schema."""
    import kubernetes_validate

    kubernetes_validate.validate(obj, kubernetes_version, strict=True)


def validate_service_monitor(obj: dict) -> None:
    """Check a ServiceMonitor against prometheus-operator's schema; unknown fields are errors too."""
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    model = monitoring.ServiceMonitor.model_validate(obj)
    # the models ignore unknown fields: a round trip that loses some means a field it doesn't know
    dumped = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    if _without_empty(dumped) != _without_empty(obj):
        raise ValueError(f"ServiceMonitor has fields prometheus-operator does not know: {obj} vs {dumped}")


def _without_empty(node):
    if isinstance(node, dict):
        return {k: _without_empty(v) for k, v in node.items() if v not in (None, {}, [])}
    if isinstance(node, list):
        return [_without_empty(v) for v in node]
    return node


def validate_serve_config(serve_config_v2: str) -> list[dict]:
    """Parse serveConfigV2 with Ray's ServeDeploySchema and every app's args into an engine Config and the
    server options (as the app's replica does at start-up).

    Returns the applications' args. Does not import the apps (see check_import_path for that).
    """
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from saguaro_dist.serve.app import server_options
    from saguaro_dist.serve.args import config_from_args

    config = ServeDeploySchema.model_validate(yaml.safe_load(serve_config_v2))
    for app in config.applications:
        config_from_args(app.args)
        # api_key_env names the pods' variable (set from a Secret), not this shell's: it is not read here
        server_options({k: v for k, v in app.args.items() if k != "api_key_env"}, app.args["model"])
    return [app.args for app in config.applications]


def validate_object(obj: dict, crd_dir: Path | None) -> None:
    """Validate any object the chart or the generator produces, by kind."""
    kind = obj.get("kind")
    if kind in CRD_FILES:
        if crd_dir is None:
            raise ValueError(f"validating a {kind} needs the KubeRay CRDs (crd_dir)")
        validate_crd_object(obj, crd_dir)
        validate_gcs_fault_tolerance(obj)
        if kind == "RayService":
            validate_serve_config(obj["spec"]["serveConfigV2"])
    elif kind == "ServiceMonitor":
        validate_service_monitor(obj)
    else:
        validate_builtin(obj)


# Labels only the Helm chart sets (it knows its chart version and that Helm manages the release);
# the generator says `managed-by: saguaro` instead. Every other field must be equal.
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")


def comparable(obj, extra_labels: tuple[str, ...] = ()):
    """obj with serveConfigV2 parsed (YAML layout is free) and the Helm-only labels dropped."""
    if isinstance(obj, list):
        return [comparable(item, extra_labels) for item in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, value in obj.items():
        if key == "serveConfigV2":
            value = load_yaml(value)
        elif key == "labels" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in HELM_ONLY_LABELS + extra_labels}
        out[key] = comparable(value, extra_labels)
    return out
