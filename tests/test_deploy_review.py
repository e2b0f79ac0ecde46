"""The manifests against what the runtime does with them: every pod's CPUs hold what Ray placement asks of
it, GPU deployments run the CUDA image, and the chart refuses names Kubernetes would refuse."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import main
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.placement import DRAFT_RESOURCE, TARGET_RESOURCE
from saguaro_dist.serve.args import config_from_args

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "saguaro-dist"


def pods(obj: dict) -> list[dict]:
    cluster = obj["spec"].get("rayClusterConfig", obj["spec"])
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def worker_cpus(obj: dict, group: str) -> int:
    """The CPUs Ray counts on a worker group's pod: its CPU limit, rounded up (KubeRay's num-cpus)."""
    cluster = obj["spec"].get("rayClusterConfig", obj["spec"])
    (g,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == group]
    return int(k8s.cpu_quantity(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]))


# ---- CPUs against Ray placement -------------------------------------------------------------------

VALID = {
    "cpu-default": k8s.K8sSettings(),
    "cpu-tp2": k8s.K8sSettings(tp=2, target_cpu="3", draft_workers=2, draft_cpu="1"),
    "cpu-ar-tp3": k8s.K8sSettings(mode="ar", draft=None, tp=3, target_cpu="4"),
    "gpu-tp8": k8s.K8sSettings(gpu=True, tp=8, target_cpu="4", draft_cpu="500m"),
}


@pytest.mark.parametrize("key", VALID)
def test_every_pod_holds_what_placement_asks_of_it(key):
    """What the runtime asks (saguaro_dist.distributed.placement on the app's own Config) fits the pods: the
    tp target bundles on the one target pod beside the Serve replica's CPU (Serve's default: 1), a draft
    worker on each draft pod."""
    from saguaro_dist.distributed.placement import draft_options, target_bundle

    s = VALID[key]
    config = config_from_args(k8s.serve_args(s))
    advertised = {TARGET_RESOURCE: s.tp, DRAFT_RESOURCE: s.draft_workers}
    obj = k8s.rayservice(s)
    replica_cpus = 1
    assert target_bundle(config, advertised).get("CPU", 0) * s.tp + replica_cpus <= worker_cpus(obj, "target")
    if s.uses_draft:
        assert draft_options(config, advertised)["num_cpus"] <= worker_cpus(obj, "draft")


@pytest.mark.parametrize("settings, message", [
    (dict(tp=4), "needs 5"),                          # 4 ranks on the default 4 CPUs, and the replica: never placed
    (dict(tp=8), "needs 9"),                          # more ranks than CPUs: the STRICT_PACK group waits for ever
    (dict(mode="ar", draft=None, tp=2, target_cpu="2"), "needs 3"),  # no draft pod for the replica to go to
    (dict(target_cpu="900m"), "gives Ray 1 CPU"),     # KubeRay rounds 0.9 up to 1: the rank and the replica need 2
    (dict(draft_cpu="0"), "draft worker"),            # no CPU: the draft actor (1 CPU) never starts
    (dict(gpu=True, target_cpu="0", mode="ar", draft=None), "Serve replica"),
])
def test_pods_too_small_for_the_placement_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        k8s.K8sSettings(**settings)


def test_cpus_that_only_gpu_actors_would_need_are_not_asked_for():
    k8s.K8sSettings(gpu=True, tp=8)                   # ranks take GPUs: 4 CPUs are plenty
    k8s.K8sSettings(mode="ngram", draft_cpu="0")      # no draft pods
    k8s.K8sSettings(tp=3, target_cpu="4000m")


def test_cpu_quantities_as_ray_counts_them():
    assert [k8s.cpu_quantity(q) for q in ("4", "2.5", "500m", "2000m", 3)] == [4, 3, 1, 2, 3]  # KubeRay rounds up
    with pytest.raises(ValueError, match="CPU quantity"):
        k8s.cpu_quantity("lots")


def test_the_cli_refuses_a_cpu_target_pod_too_small_for_its_ranks(capsys):
    assert main(["deploy", "k8s", "--tp", "4"]) == 2
    assert "needs 5" in capsys.readouterr().err
    assert main(["deploy", "k8s", "--tp", "4", "--target-cpu", "5"]) == 0


# ---- the image ---------------------------------------------------------------------------------------

def images(obj: dict) -> set[str]:
    return {c["image"] for pod in pods(obj) for c in pod["spec"]["containers"]}


def test_gpu_deployments_default_to_the_cuda_image():
    """--gpu with the default image ran the CPU build (CPU-only torch) on GPU nodes: device=cuda failed there."""
    assert images(k8s.rayservice(k8s.K8sSettings(gpu=True))) == {f"saguaro-dist:{k8s.APP_VERSION}-cuda"}
    assert images(k8s.raycluster(k8s.K8sSettings(gpu_type="NVIDIA-L40S"))) == {f"saguaro-dist:{k8s.APP_VERSION}-cuda"}
    assert images(k8s.rayservice(k8s.K8sSettings())) == {f"saguaro-dist:{k8s.APP_VERSION}-cpu"}
    assert images(k8s.rayservice(k8s.K8sSettings(gpu=True, image="reg.io/s:1"))) == {"reg.io/s:1"}
    assert k8s.helm_values(k8s.K8sSettings(gpu=True))["image"] == {"repository": "saguaro-dist",
                                                                    "tag": f"{k8s.APP_VERSION}-cuda",
                                                                    "pullPolicy": "", "pullSecrets": []}


def test_the_cli_with_gpu_writes_the_cuda_image(capsys):
    assert main(["deploy", "k8s", "--gpu"]) == 0
    (doc,) = list(yaml.safe_load_all(capsys.readouterr().out))
    assert images(doc) == {f"saguaro-dist:{k8s.APP_VERSION}-cuda"}


# ---- the Helm chart --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm():
    return pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")


def render(helm, values: dict | None, name: str = "saguaro") -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=name, namespace="default")
    return [doc for path, text in sorted(files.items()) if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def rayservice_of(docs: list[dict]) -> dict:
    (obj,) = [d for d in docs if d["kind"] == "RayService"]
    return obj


def test_the_chart_runs_the_cuda_image_on_gpus_unless_a_tag_is_given(helm):
    assert images(rayservice_of(render(helm, {"gpu": {"enabled": True}}))) == {"saguaro-dist:0.1.0-cuda"}
    assert images(rayservice_of(render(helm, {"gpu": {"type": "NVIDIA-L40S"}}))) == {"saguaro-dist:0.1.0-cuda"}
    assert images(rayservice_of(render(helm, None))) == {"saguaro-dist:0.1.0-cpu"}
    assert images(rayservice_of(render(helm, {"image": {"tag": "dev"}, "gpu": {"enabled": True}}))) == {"saguaro-dist:dev"}


@pytest.mark.parametrize("name", ["1st", "my.release"])
def test_the_chart_refuses_a_release_name_that_cannot_name_services(helm, name):
    """Helm takes release names starting with a digit or holding dots; a Service's name (DNS-1035) may not."""
    with pytest.raises(Exception, match="DNS-1035"):
        render(helm, None, name=name)
    assert rayservice_of(render(helm, {"fullnameOverride": "ok-name"}, name=name))["metadata"]["name"] == "ok-name"


@pytest.mark.parametrize("values, message", [
    ({"target": {"tensorParallelSize": 4}}, "needs 5"),
    ({"speculation": {"mode": "ar"}, "target": {"tensorParallelSize": 2, "resources": {"cpu": "2"}}}, "needs 3"),
    ({"draft": {"resources": {"cpu": "0"}}}, "draft worker"),
])
def test_the_chart_refuses_pods_too_small_for_the_placement(helm, values, message):
    with pytest.raises(Exception, match=message):
        render(helm, values)


def test_the_chart_renders_the_generators_objects_for_a_cpu_tp_deployment(helm):
    s = k8s.K8sSettings(tp=3, target_cpu="4", gpu=False)
    rendered = rayservice_of(render(helm, k8s.helm_values(s)))
    assert validation.comparable(rendered) == validation.comparable(k8s.rayservice(s))


def test_the_app_runs_its_pools_as_ray_actors_whatever_their_sizes():
    """Old: a manifest named no cluster, so a pool of one target rank and one draft worker (the defaults) ran a
    one-host engine inside the Serve replica's process, beside the pods made for them."""
    from test_deploy_helm import render
    for s in (k8s.K8sSettings(), k8s.K8sSettings(mode="ar", draft=None), k8s.K8sSettings(tp=2, target_cpu="3")):
        assert config_from_args(k8s.serve_args(s)).cluster == "auto"
    (service,) = [d for d in render(None) if d["kind"] == "RayService"]
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert config_from_args(app["args"]).cluster == "auto"
