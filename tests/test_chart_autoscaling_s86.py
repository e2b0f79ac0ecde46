"""The chart promises no pods the engine would never use. The engine starts num_draft_workers (draft.workers) draft
actors once, each asking saguaro_draft 1, and one target pod's ranks; KubeRay's in-tree autoscaler adds a pod
only for resources that work asks for and no node has. The old chart's autoscaling.enabled / draftMaxWorkers
(maxReplicas above draft.workers) therefore never added a draft pod: the chart now renders fixed groups and
refuses those values, saying why."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from saguaro_dist.deploy import validation
from saguaro_dist.placement import DRAFT_RESOURCE, FRONT_RESOURCE, TARGET_RESOURCE

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "saguaro-dist"
GPU_VALUES = yaml.safe_load((CHART / "values-gpu.yaml").read_text())


def render_rayservice(values: dict | None) -> dict:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="saguaro", namespace="default")
    (doc,) = [d for d in yaml.safe_load_all(files["saguaro-dist/templates/rayservice.yaml"]) if d]
    return doc


def groups(rayservice: dict) -> dict:
    return {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def with_values(base: dict, **sections) -> dict:
    return {**base, **{name: {**base.get(name, {}), **fields} for name, fields in sections.items()}}


@pytest.mark.parametrize("values", [None, GPU_VALUES, with_values(GPU_VALUES, draft={"workers": 4}),
                                    with_values(GPU_VALUES, autoscaling={"draftMaxWorkers": 2})],
                         ids=["default", "gpu", "gpu-4-drafts", "draft-max-equal-to-workers"])
def test_each_group_is_as_many_pods_as_the_engine_asks_for(values):
    """A pod the engine's actors never ask for is one no autoscaler adds: the draft group's maxReplicas is the pool
    num_draft_workers starts, and nothing turns the autoscaler on to wait for more."""
    from saguaro_dist.distributed.placement import engine_needs
    from saguaro_dist.serve.args import config_from_args

    rayservice = render_rayservice(values)
    cluster = rayservice["spec"]["rayClusterConfig"]
    (args,) = validation.validate_serve_config(rayservice["spec"]["serveConfigV2"])
    advertised = {TARGET_RESOURCE: 1, DRAFT_RESOURCE: 1}  # what the groups' rayStartParams name
    needs = engine_needs(config_from_args(args), advertised)
    for name, group in groups(rayservice).items():
        per_pod = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"], name
        for resource, amount in per_pod.items():  # FRONT_RESOURCE: the one Serve replica's, not the engine's
            assert group["maxReplicas"] * amount == (1 if resource == FRONT_RESOURCE else needs[resource]), name
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster


@pytest.mark.parametrize("autoscaling, refused", [({"enabled": True}, "autoscaling.enabled"),
                                                  ({"draftMaxWorkers": 4}, "autoscaling.draftMaxWorkers 4"),
                                                  ({"enabled": True, "draftMaxWorkers": 4}, "autoscaling.enabled"),
                                                  ({"idleTimeoutSeconds": 60}, "autoscaling.idleTimeoutSeconds")])
def test_autoscaling_it_cannot_honour_is_refused_with_the_way_to_scale(autoscaling, refused):
    with pytest.raises(helm.errors.HelmRenderError) as err:
        render_rayservice(with_values(GPU_VALUES, autoscaling=autoscaling))
    message = str(err.value)
    assert f"{refused} is not supported" in message and "draft.workers" in message


def test_values_files_say_the_draft_pool_is_draft_workers():
    """values-gpu.yaml no longer turns it on; values.yaml's autoscaling block says it is not supported."""
    assert "autoscaling" not in GPU_VALUES
    text = (CHART / "values.yaml").read_text()
    assert "grows the draft pool" not in text and "Not supported" in text
