"""Production readiness of the KubeRay manifests, against KubeRay's and Ray's documented practice: the
probes KubeRay would inject (a probe in the manifest replaces KubeRay's whole), a grace period longer
than Ray's drain on SIGTERM, an explicit upgrade strategy, registry credentials. Generator and chart
alike; every object schema-validated (KubeRay v1.7 CRDs, Kubernetes' own schemas), no cluster."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import main
from saguaro_dist.deploy import k8s, validation

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "saguaro-dist"
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds"
GPU_VALUES = yaml.safe_load((CHART / "values-gpu.yaml").read_text())

SETTINGS = {
    "cpu-default": k8s.K8sSettings(),
    "gpu-tp2-drafts2": k8s.K8sSettings(gpu=True, tp=2, draft_workers=2),  # (the chart refuses autoscaling)
    "ar-no-draft": k8s.K8sSettings(mode="ar", draft=None, name="plain"),
    "production-options": k8s.K8sSettings(upgrade_strategy="None", drain_timeout_s=120,
                                          image_pull_secrets=("regcred", "mirror.example.com")),
}
SERVE_CHECK = f"http://localhost:{k8s.SERVE_PORT}/-/healthz"
# KubeRay's injected probes (ray-operator/controllers/ray/utils/constant.go, common/pod.go):
# (timeoutSeconds, readiness failureThreshold); liveness fails after 120 x 5 s everywhere
KUBERAY_READINESS = {"head": (5, 10), "worker": (2, 10), "serving-worker": (2, 1)}


@pytest.fixture(scope="module")
def crds() -> Path:
    if not (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (the shared/kuberay-crds folder beside the repo)")
    return CRD_DIR


def cluster_of(obj: dict) -> dict:
    return obj["spec"].get("rayClusterConfig", obj["spec"])


def pods(obj: dict) -> dict:
    """{group name: pod spec} of a RayService / RayCluster, the head as "head"."""
    cluster = cluster_of(obj)
    specs = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    specs.update({g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    return specs


def role(obj: dict, group: str) -> str:
    if group == "head":
        return "head"
    return "serving-worker" if obj["kind"] == "RayService" else "worker"


def env_of(pod: dict) -> dict:
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


# ---- probes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key", SETTINGS)
def test_rayservice_workers_are_ready_only_with_a_serve_proxy(key):
    """The Serve Service selects every RayService worker and Serve runs proxies only where replicas run
    (proxy_location EveryNode), so a draft pod has none: without the proxy check in its readiness (KubeRay
    adds it, but only where the manifest gives no probe) the Service sends requests there and they fail."""
    s = SETTINGS[key]
    service, batch = k8s.rayservice(s), k8s.raycluster(s)
    for group, pod in pods(service).items():
        readiness = " ".join(pod["containers"][0]["readinessProbe"]["exec"]["command"])
        assert (SERVE_CHECK in readiness) == (group != "head"), group  # KubeRay checks the head's proxy itself
        assert SERVE_CHECK not in " ".join(pod["containers"][0]["livenessProbe"]["exec"]["command"])
    for pod in pods(batch).values():  # no Serve on the batch cluster: its pods must not wait for a proxy
        assert SERVE_CHECK not in " ".join(pod["containers"][0]["readinessProbe"]["exec"]["command"])


@pytest.mark.parametrize("key", SETTINGS)
def test_probe_thresholds_are_kuberays(key):
    """Readiness restarts nothing, so it need not wait out weight loading: a pod whose raylet died (or whose
    proxy drains) leaves the Services within seconds, not after 120 failures (10 minutes, as before). The
    head's checks call two endpoints, hence KubeRay's longer timeout there."""
    s = SETTINGS[key]
    for obj in (k8s.rayservice(s), k8s.raycluster(s)):
        for group, pod in pods(obj).items():
            container = pod["containers"][0]
            readiness, liveness = container["readinessProbe"], container["livenessProbe"]
            timeout_s, failures = KUBERAY_READINESS[role(obj, group)]
            assert (readiness["timeoutSeconds"], readiness["failureThreshold"]) == (timeout_s, failures), group
            assert readiness["failureThreshold"] * readiness["periodSeconds"] <= 50
            assert (liveness["timeoutSeconds"], liveness["failureThreshold"]) == (timeout_s, 120), group


# ---- graceful termination ------------------------------------------------------------------------

@pytest.mark.parametrize("key", SETTINGS)
def test_grace_period_outlasts_rays_drain(key):
    """On SIGTERM `ray start --block` drains the node for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (30 s by
    default) so Serve stops routing there first; Ray's docs ask for a longer terminationGracePeriodSeconds.
    Kubernetes' default is 30 s: the SIGKILL came as the drain window ended."""
    s = SETTINGS[key]
    for obj in (k8s.rayservice(s), k8s.raycluster(s)):
        for group, pod in pods(obj).items():
            drain_s = int(env_of(pod)[k8s.DRAIN_ENV])
            assert drain_s == s.drain_timeout_s
            assert pod["terminationGracePeriodSeconds"] >= drain_s + 10, group
            assert "lifecycle" not in pod["containers"][0]  # no `ray stop` preStop: KubeRay dropped it (#2724)


# ---- upgrades, registry, resources -----------------------------------------------------------------

def test_upgrade_strategy_is_explicit_and_configurable(crds):
    """NewCluster (KubeRay's default) needs a second cluster's GPUs during a cluster upgrade; where the
    cluster can't hold them, None keeps the running one instead of a pending cluster that never schedules."""
    default = k8s.rayservice(k8s.K8sSettings())
    assert default["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    pinned = k8s.rayservice(k8s.K8sSettings(upgrade_strategy="None"))
    assert pinned["spec"]["upgradeStrategy"] == {"type": "None"}
    for obj in (default, pinned):
        validation.validate_object(obj, crds)
    assert "upgradeStrategy" not in k8s.raycluster(k8s.K8sSettings())["spec"]  # a RayService field only
    # the deprecated health thresholds (no effect since KubeRay 1.1) stay out
    assert not {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"} & set(default["spec"])


def test_image_pull_secrets_reach_every_pod(crds):
    s = SETTINGS["production-options"]
    expected = [{"name": "regcred"}, {"name": "mirror.example.com"}]
    for obj in (k8s.rayservice(s), k8s.raycluster(s)):
        validation.validate_object(obj, crds)
        assert all(pod["imagePullSecrets"] == expected for pod in pods(obj).values())
    job = k8s.batch_job(s, "data", "in.jsonl", "out.jsonl")
    validation.validate_builtin(job)
    assert job["spec"]["template"]["spec"]["imagePullSecrets"] == expected
    assert all("imagePullSecrets" not in pod for pod in pods(k8s.rayservice(k8s.K8sSettings())).values())


@pytest.mark.parametrize("key", SETTINGS)
def test_ray_pods_are_guaranteed_qos_with_shared_memory(key):
    """Guards what was already right: requests == limits (Guaranteed QoS; Ray reads its CPUs from the limit),
    /dev/shm in memory for the object store, a head that takes no work, GPU nodes selected and tolerated."""
    s = SETTINGS[key]
    obj = k8s.rayservice(s)
    assert cluster_of(obj)["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group, pod in pods(obj).items():
        container = pod["containers"][0]
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        gpus = container["resources"]["limits"].get(k8s.GPU_RESOURCE, 0)
        assert bool(pod.get("tolerations")) == bool(gpus), group


# ---- the CLI -------------------------------------------------------------------------------------

def test_cli_sets_the_production_options(capsys):
    argv = ["deploy", "k8s", "--upgrade-strategy", "None", "--drain-timeout-s", "120",
            "--image-pull-secret", "regcred", "--image-pull-secret", "mirror.example.com"]
    assert main(argv) == 0
    (doc,) = list(yaml.safe_load_all(capsys.readouterr().out))
    assert doc == k8s.rayservice(SETTINGS["production-options"])


@pytest.mark.parametrize("argv, message", [
    (["--drain-timeout-s", "-1"], "drain_timeout_s must be >= 0"),
    (["--image-pull-secret", "Reg_Cred"], "image_pull_secrets must name Secrets"),
])
def test_cli_rejects_bad_production_options(capsys, argv, message):
    assert main(["deploy", "k8s", *argv]) == 2
    assert message in capsys.readouterr().err


def test_settings_refuse_an_unknown_upgrade_strategy():
    with pytest.raises(ValueError, match="upgrade_strategy must be one of 'NewCluster', 'None'"):
        k8s.K8sSettings(upgrade_strategy="Recreate")  # a RayCluster's strategy, not a RayService's


# ---- the Helm chart ------------------------------------------------------------------------------

def render(values: dict | None) -> dict:
    helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2")
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="saguaro", namespace="default")
    docs = [doc for path, text in sorted(files.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


@pytest.mark.parametrize("key", SETTINGS)
def test_chart_renders_the_same_production_settings(crds, key):
    s = SETTINGS[key]
    rendered = render({**k8s.helm_values(s), "rayCluster": {"enabled": True}})
    for kind, name, built in (("RayService", s.name, k8s.rayservice(s)), ("RayCluster", f"{s.name}-batch", k8s.raycluster(s))):
        validation.validate_object(rendered[(kind, name)], crds)
        assert validation.comparable(rendered[(kind, name)]) == validation.comparable(built)


def test_chart_gpu_values_probe_the_serve_proxy_on_workers():
    service = render(GPU_VALUES)[("RayService", "saguaro")]
    for group, pod in pods(service).items():
        readiness = pod["containers"][0]["readinessProbe"]
        assert (SERVE_CHECK in readiness["exec"]["command"][-1]) == (group != "head")
        assert pod["terminationGracePeriodSeconds"] > int(env_of(pod)[k8s.DRAIN_ENV])


def test_chart_schema_refuses_bad_production_values():
    helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2")
    for values in ({"upgradeStrategy": "Recreate"}, {"termination": {"drainTimeoutSeconds": -5}},
                   {"image": {"repository": "r", "tag": "t", "pullSecrets": ["Bad_Name"]}}):
        report = helm.lint(str(CHART), values=values, strict=True)
        assert report["errors"], values


def test_the_metrics_service_lists_pods_that_are_not_ready():
    """Draft pods hold no Serve proxy, so their readiness (KubeRay's rule) never passes: the metrics Service must
    still list them, or Prometheus loses every draft worker's metrics."""
    spec = k8s.metrics_service(k8s.K8sSettings(name="qwen"))["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
