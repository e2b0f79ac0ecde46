"""K8sSettings.extra_env: environment variables added to every Ray container (head and workers), e.g. OTEL_* for
the OpenTelemetry exporter of --otlp-traces-endpoint. A name the manifests already set is refused, never overridden:
a second entry of the same name in a container's env would silently win over the generator's (or KubeRay's)."""
from __future__ import annotations

import re
from collections.abc import Mapping

from saguaro_dist.deploy.constants import DRAIN_ENV
from saguaro_dist.serve.args import API_KEY_ENV

# a shell's variable name: Ray's containers start through bash, and every Kubernetes version accepts it
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what pods.py sets (HF_TOKEN even where no Secret is named: a token belongs in --hf-token-secret, not a manifest)
GENERATOR_ENV = frozenset({API_KEY_ENV, "HF_TOKEN", "HF_HOME", DRAIN_ENV})
# what KubeRay's operator sets in a Ray container to tie it to its cluster (ray-operator utils/constant.go)
KUBERAY_SETS = frozenset({"RAY_CLUSTER_NAME", "RAY_IP", "FQ_RAY_IP", "RAY_PORT", "RAY_ADDRESS", "REDIS_PASSWORD",
                          "KUBERAY_GEN_RAY_START_CMD", "RAY_CLOUD_INSTANCE_ID", "RAY_NODE_TYPE_NAME"})
# what KubeRay refuses in a Ray container of this cluster (ray-operator utils/validation.go ValidateRayClusterSpec),
# or sets itself with GCS fault tolerance: the RayService would never start, its reason in the operator's events only
KUBERAY_REFUSES = {
    "RAY_REDIS_ADDRESS": "KubeRay refuses it on the head (it turns GCS fault tolerance on behind its back): give "
                         "the Redis as gcs_ft_redis_address (--gcs-ft-redis-address, gcsFaultTolerance.redisAddress)",
    "REDIS_USERNAME": "KubeRay refuses it on the head: a Redis username belongs in its "
                      "gcsFaultToleranceOptions.redisUsername, which these manifests do not write",
    "RAY_enable_autoscaler_v2": "KubeRay refuses it while enableInTreeAutoscaling is false, as here (the draft pool "
                                "is fixed: no autoscaler)",
    "RAY_external_storage_namespace": "KubeRay sets it with GCS fault tolerance (the cluster's UID, so that a "
                                      "NewCluster upgrade's second cluster never reads the first's Serve state)",
}
KUBERAY_ENV = KUBERAY_SETS | frozenset(KUBERAY_REFUSES)
RESERVED_ENV = GENERATOR_ENV | KUBERAY_ENV
WHAT = "extra_env (--env)"  # the setting, as errors name it


def extra_env(value) -> tuple[tuple[str, str], ...]:
    """(name, value) pairs sorted by name (as Helm ranges over a map) from a mapping, "NAME=VALUE" strings or
    pairs; a bad name, a reserved one, one given twice or a value that is no string is a ValueError."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, str):
        pairs = [_split(value)]
    else:
        pairs = [_split(item) if isinstance(item, str) else tuple(item) for item in value or ()]
    seen = {}
    for name, text in pairs:
        _check(name, text)
        if name in seen:
            raise ValueError(f"{WHAT} gives {name} twice ({seen[name]!r} and {text!r})")
        seen[name] = text
    return tuple(sorted(seen.items()))


def _split(item: str) -> tuple[str, str]:
    name, equals, text = item.partition("=")
    if not equals:
        raise ValueError(f"{WHAT} entries are NAME=VALUE, got {item!r}")
    return name, text


def _check(name, text) -> None:
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        raise ValueError(f"{WHAT}: {name!r} is not an environment variable name (letters, digits and '_', "
                         f"not starting with a digit)")
    if name in KUBERAY_REFUSES:
        raise ValueError(f"{WHAT} cannot set {name}: {KUBERAY_REFUSES[name]}")
    if name in RESERVED_ENV:
        owner = "the manifests set it" if name in GENERATOR_ENV else "KubeRay sets it"
        raise ValueError(f"{WHAT} cannot set {name}: {owner} (its own option, if any, changes it)")
    if not isinstance(text, str):
        raise ValueError(f"{WHAT}: {name}'s value must be a string, got {text!r}")


def env_entries(pairs: tuple[tuple[str, str], ...]) -> list[dict]:
    """A container's env entries for the pairs."""
    return [{"name": name, "value": text} for name, text in pairs]
