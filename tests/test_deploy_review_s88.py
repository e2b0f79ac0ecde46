"""Session 88's deploy review: model.draft "" alone runs ar in the chart as in the generator (it kept ssd, and the
app never started); extraEnv names KubeRay refuses are refused here, saying why; a misspelt chart value fails
lint; the Serve replica asks for the target pod's saguaro_front slot (Serve's spread put it on a draft pod, whose
loss then took the target's ranks); the pools' sizes are pod-template annotations, a field KubeRay's RayService
compares (it leaves replicas out), so a new draft.workers rolls out a new cluster."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from saguaro_dist.deploy import k8s, validation
from saguaro_dist.deploy.constants import DEPLOYMENT_NAME, DRAFT_WORKERS_ANNOTATION, TP_ANNOTATION
from saguaro_dist.placement import DRAFT_RESOURCE, FRONT_RESOURCE, RESOURCE_PER_ACTOR, TARGET_RESOURCE

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")
from test_chart_autoscaling_s86 import CHART, GPU_VALUES, groups, render_rayservice  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def lint_errors(values: dict) -> str:
    return "\n".join(helm.lint(str(CHART), values=values, strict=True)["errors"])


# -- 1. model.draft "" alone: ar ---------------------------------------------------------------------------------
def test_no_draft_alone_runs_ar_in_the_generator_and_the_chart():
    s = k8s.K8sSettings(draft="")
    assert (s.mode, s.draft, s.uses_draft) == ("ar", None, False)
    rendered = render_rayservice({"model": {"draft": ""}})
    assert list(groups(rendered)) == ["target"]  # no draft pods to pay for
    (args,) = validation.validate_serve_config(rendered["spec"]["serveConfigV2"])  # the app starts with these
    assert args["mode"] == "ar" and "draft" not in args
    assert validation.comparable(rendered) == validation.comparable(k8s.rayservice(s))


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_draft_mode_without_a_draft_is_refused_saying_so(mode):
    with pytest.raises(ValueError, match=f"mode '{mode}' needs a draft model, but draft is none"):
        k8s.K8sSettings(draft="", mode=mode)
    with pytest.raises(helm.errors.HelmRenderError, match=f'speculation.mode {mode} needs a draft model, but model.draft is'):
        render_rayservice({"model": {"draft": ""}, "speculation": {"mode": mode}})


# -- 2. extraEnv names KubeRay refuses ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, why", [("RAY_REDIS_ADDRESS", "gcs_ft_redis_address"),
                                       ("REDIS_USERNAME", "gcsFaultToleranceOptions"),
                                       ("RAY_enable_autoscaler_v2", "enableInTreeAutoscaling is false"),
                                       ("RAY_external_storage_namespace", "GCS fault tolerance")])
def test_env_names_kuberay_refuses_are_refused_with_the_reason(name, why):
    with pytest.raises(ValueError, match=f"cannot set {name}: .*{why}"):
        k8s.K8sSettings(extra_env={name: "1"})
    assert name in lint_errors({"extraEnv": {name: "1"}})


# -- 3. misspelt values ------------------------------------------------------------------------------------------
def object_paths(schema: dict, path: tuple = ()):
    """The values objects whose keys the schema lists (free maps such as extraEnv and labels excepted)."""
    if schema.get("type") == "object" and "properties" in schema and path != ("global",):
        yield path
    for key, sub in schema.get("properties", {}).items():
        if isinstance(sub, dict) and key != "speculativeConfig" and key != "modules":
            yield from object_paths(sub, path + (key,))


def nested(path: tuple, leaf: dict) -> dict:
    for key in reversed(path):
        leaf = {key: leaf}
    return leaf


OBJECTS = list(object_paths(SCHEMA))


def test_every_values_object_is_checked():
    assert {("engine",), ("metrics", "serviceMonitor"), ("draft", "resources"), ("gcsFaultTolerance", "redisPassword"),
            ()} <= set(OBJECTS)


@pytest.mark.parametrize("path", OBJECTS, ids=lambda p: ".".join(p) or "top")
def test_a_misspelt_key_fails_lint(path):
    assert "misspeltKey" in lint_errors(nested(path, {"misspeltKey": 1}))


def test_every_documented_key_is_in_the_schema():
    """values.yaml documents every value: each must be one the schema lists (or lint of the defaults fails)."""
    def walk(values: dict, schema: dict, path: str):
        for key, value in values.items():
            assert key in schema.get("properties", {}), f"{path}{key}"
            sub = schema["properties"][key]
            if isinstance(value, dict) and "properties" in sub:
                walk(value, sub, f"{path}{key}.")
    walk(yaml.safe_load((CHART / "values.yaml").read_text()), SCHEMA, "")


@pytest.mark.parametrize("path", sorted(CHART.glob("values*.yaml")), ids=lambda p: p.name)
def test_every_values_file_still_lints(path):
    assert lint_errors(yaml.safe_load(path.read_text())) == ""


# -- 4. the Serve replica on the target pod ----------------------------------------------------------------------
def test_the_serve_replica_asks_for_the_target_pods_front_slot():
    from ray.serve.schema import ServeDeploySchema

    from saguaro_dist.serve.app import DEPLOYMENT_NAME as APP_DEPLOYMENT

    assert DEPLOYMENT_NAME == APP_DEPLOYMENT
    for rendered in (k8s.rayservice(k8s.K8sSettings(draft_cpu="1")), render_rayservice(GPU_VALUES)):
        config = ServeDeploySchema.model_validate(yaml.safe_load(rendered["spec"]["serveConfigV2"]))
        (deployment,) = config.applications[0].deployments
        assert deployment.name == DEPLOYMENT_NAME
        assert deployment.ray_actor_options.resources == {FRONT_RESOURCE: RESOURCE_PER_ACTOR}
        assert deployment.ray_actor_options.num_cpus == 1  # Serve's default, which the target pod's CPUs count
        advertised = {name: json.loads(json.loads(g["rayStartParams"]["resources"]))
                      for name, g in groups(rendered).items()}
        assert advertised["target"][FRONT_RESOURCE] == RESOURCE_PER_ACTOR and FRONT_RESOURCE not in advertised["draft"]
        assert advertised["draft"] == {DRAFT_RESOURCE: RESOURCE_PER_ACTOR} and TARGET_RESOURCE in advertised["target"]


def test_the_vm_launchers_target_node_holds_the_replicas_slot():
    """`--kind serve-config` (the same deployment options) is what `ray up deploy/cluster-launcher.yaml` serves."""
    types = yaml.safe_load((ROOT / "deploy" / "cluster-launcher.yaml").read_text())["available_node_types"]
    assert types["target"]["resources"][FRONT_RESOURCE] == RESOURCE_PER_ACTOR
    assert FRONT_RESOURCE not in types["draft"]["resources"] and FRONT_RESOURCE not in types["head"]["resources"]
    (deployment,) = k8s.serve_config(k8s.K8sSettings())["applications"][0]["deployments"]
    assert deployment["ray_actor_options"]["resources"] == {FRONT_RESOURCE: RESOURCE_PER_ACTOR}


# -- 5. the pools' sizes in a field KubeRay compares ------------------------------------------------------------
def cluster_hash_input(rayservice: dict) -> str:
    """What KubeRay's RayService compares (generateHashWithoutReplicasAndWorkersToDelete): the cluster spec with
    each group's replicas, minReplicas and maxReplicas left out."""
    spec = copy.deepcopy(rayservice["spec"]["rayClusterConfig"])
    for group in spec["workerGroupSpecs"]:
        for field in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(field, None)
    return json.dumps(spec, sort_keys=True)


def test_a_new_draft_pool_size_is_a_change_kuberay_sees():
    base = dict(gpu=True, tp=2, model="/models/t", draft="/models/d")
    two, four = (k8s.rayservice(k8s.K8sSettings(draft_workers=n, **base)) for n in (2, 4))
    assert cluster_hash_input(two) != cluster_hash_input(four)
    assert groups(four)["draft"]["template"]["metadata"]["annotations"] == {DRAFT_WORKERS_ANNOTATION: "4"}
    assert groups(four)["target"]["template"]["metadata"]["annotations"] == {TP_ANNOTATION: "2"}
    scaled = render_rayservice({**GPU_VALUES, "draft": {**GPU_VALUES["draft"], "workers": 4}})
    assert cluster_hash_input(render_rayservice(GPU_VALUES)) != cluster_hash_input(scaled)
    assert groups(scaled)["draft"]["template"]["metadata"]["annotations"] == {DRAFT_WORKERS_ANNOTATION: "4"}


# -- 6. the operator the chart needs -----------------------------------------------------------------------------
def test_the_chart_asks_for_the_kuberay_that_has_gcs_fault_tolerance():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["saguaro-dist/requires"] == "kuberay-operator >= 1.3"
