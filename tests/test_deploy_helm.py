"""The Helm chart deploy/helm/saguaro-dist: lints and renders (Helm 4's own Go code through
helm-python-sdk, no helm binary), its objects pass the same schema checks as the generator's, and it
renders the generator's objects for the same settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from saguaro_dist.deploy import k8s, validation
from saguaro_dist.placement import DRAFT_RESOURCE, FRONT_RESOURCE, RESOURCE_PER_ACTOR, TARGET_RESOURCE

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "saguaro-dist"
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds"
GPU_VALUES = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
RELEASE = "saguaro"

SETTINGS = {
    "cpu-default": k8s.K8sSettings(),
    "pinned-revisions": k8s.K8sSettings(revision="v2.0", draft_revision="0123abc", tokenizer="org/tok",
                                        tokenizer_revision="v3"),
    "gpu-tp4": k8s.K8sSettings(tp=4, draft_workers=3, gpu_type="NVIDIA-H100-80GB-HBM3", models_pvc="weights",
                               model="/models/target", draft="/models/draft", served_model_name="t",
                               image="registry.example:5000/team/saguaro-dist:0.1.0-cuda"),
    # (no autoscaling: the chart refuses it, tests/test_chart_autoscaling_s86.py)
    "fanout-list": k8s.K8sSettings(gpu=True, k=3, fan_out=(4, 3, 2, 1), draft_workers=5,
                                   mode="sd", fallback="fast", dtype="float16",
                                   saguaro_c=0.5, max_batch_size=16,
                                   max_model_len=8192, gpu_memory_utilization=0.8,
                                   scheduling_policy="priority"),
    "ar-no-draft": k8s.K8sSettings(mode="ar", draft=None, name="plain", head_cpu="1", head_memory="2Gi",
                                   generation_config="vllm", chat_template="{% for m in messages %}{{ m.content }}\n{% endfor %}"),
    "ngram-default-draft-unused": k8s.K8sSettings(mode="ngram", name="lookup", draft_revision="abc"),
    # `saguaro serve`'s engine and server flags, each off its default (seed 0 is a seed, not "unset")
    "serve-flags": k8s.K8sSettings(seed=0, max_num_batched_tokens=512, enable_prefix_caching=False,
                                   enforce_eager=True, disable_log_stats=True, max_request_bytes=4096,
                                   stream_interval_ms=12.5, enable_log_requests=True),
    "serve-flags-largest-chart-seed": k8s.K8sSettings(seed=-(2**53 - 1), stream_interval_ms=0),
    # the HTTP-frontend and speculation flags, and vLLM's speculative_config deciding the mode (no draft pods)
    "frontend-flags": k8s.K8sSettings(allowed_origins=["https://a.example"], allow_credentials=True, root_path="/llm",
                                      disable_fastapi_docs=True, served_model_name=["a", "b"], proposal_top_k=8),
    "speculative-config-ngram": k8s.K8sSettings(speculative_config={"method": "ngram", "prompt_lookup_max": 4}),
}


@pytest.fixture(scope="module")
def crds() -> Path:
    if not (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (the shared/kuberay-crds folder beside the repo)")
    return CRD_DIR


def render(values: dict | None) -> list[dict]:
    """Every object the chart renders for values (NOTES.txt is text, not an object)."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=RELEASE, namespace="default")
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def by_kind(docs: list[dict]) -> dict:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def validate(obj: dict, crds: Path) -> None:
    if obj["kind"] == "ServiceMonitor":
        pytest.importorskip("cloudcoil.models.prometheus_operator",
                            reason="ServiceMonitor schema: pip install cloudcoil-models-prometheus-operator")
    validation.validate_object(obj, crds)


# ---- lint and render ---------------------------------------------------------------------------

@pytest.mark.parametrize("values", [None, GPU_VALUES], ids=["default", "gpu"])
def test_chart_lints_clean(values):
    report = helm.lint(str(CHART), values=values, strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


def test_lint_enforces_the_values_schema():
    report = helm.lint(str(CHART), values={"speculation": {"mode": "fastest"}}, strict=True)
    assert any("mode" in error for error in report["errors"]), report


def test_default_values_render_the_expected_objects(crds):
    docs = render(None)
    assert sorted(by_kind(docs)) == [("RayService", RELEASE), ("Service", f"{RELEASE}-metrics")]
    for obj in docs:
        validate(obj, crds)


def test_gpu_values_render_valid_objects(crds):
    values = {**GPU_VALUES, "rayCluster": {"enabled": True}, "apiKey": {**GPU_VALUES.get("apiKey", {}),
              "secretName": "saguaro-api-key", "secretKey": "api-key", "create": True, "value": "s3cret"}}
    docs = by_kind(render(values))
    assert set(docs) == {("RayService", RELEASE), ("RayCluster", f"{RELEASE}-batch"), ("Service", f"{RELEASE}-metrics"),
                         ("ServiceMonitor", RELEASE), ("Secret", "saguaro-api-key")}
    for obj in docs.values():
        validate(obj, crds)


def test_rendered_serve_config_builds_the_engine_config():
    (rayservice,) = [doc for doc in render(GPU_VALUES) if doc["kind"] == "RayService"]
    (args,) = validation.validate_serve_config(rayservice["spec"]["serveConfigV2"])
    from saguaro_dist.serve.args import config_from_args

    config = config_from_args(args)
    assert (config.tensor_parallel_size, config.num_draft_workers) == (2, 2)
    assert (config.device, config.dtype) == ("cuda", "bfloat16")


def test_rendered_groups_advertise_what_placement_asks_for():
    cluster = by_kind(render(GPU_VALUES))[("RayService", RELEASE)]["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    resources = {name: json.loads(json.loads(g["rayStartParams"]["resources"])) for name, g in groups.items()}
    tp = GPU_VALUES["target"]["tensorParallelSize"]
    assert resources == {"target": {TARGET_RESOURCE: tp * RESOURCE_PER_ACTOR, FRONT_RESOURCE: RESOURCE_PER_ACTOR},
                         "draft": {DRAFT_RESOURCE: RESOURCE_PER_ACTOR}}


# ---- the same objects as the generator ------------------------------------------------------------

@pytest.mark.parametrize("key", SETTINGS)
def test_chart_renders_the_generators_objects(key):
    """Equal up to the labels only Helm sets (helm.sh/chart, managed-by) and serveConfigV2's YAML layout."""
    s = SETTINGS[key]
    rendered = by_kind(render(k8s.helm_values(s)))
    assert validation.comparable(rendered[("RayService", s.name)]) == validation.comparable(k8s.rayservice(s))
    assert validation.comparable(rendered[("Service", f"{s.name}-metrics")]) == validation.comparable(k8s.metrics_service(s))
    values = {**k8s.helm_values(s), "rayCluster": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}}}
    rendered = by_kind(render(values))
    assert validation.comparable(rendered[("RayCluster", f"{s.name}-batch")]) == validation.comparable(k8s.raycluster(s))
    assert validation.comparable(rendered[("ServiceMonitor", s.name)]) == validation.comparable(k8s.service_monitor(s))


def test_gpu_values_file_matches_the_shipped_rayservice():
    """deploy/kuberay/rayservice.yaml (generator output) is what values-gpu.yaml renders. The chart's
    ServiceMonitor also carries metrics.serviceMonitor.labels (for Prometheus' selector)."""
    extra = tuple(GPU_VALUES["metrics"]["serviceMonitor"]["labels"])
    shipped = [d for d in yaml.safe_load_all((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text()) if d]
    assert validation.comparable(by_kind(render(GPU_VALUES)), extra) == validation.comparable(by_kind(shipped), extra)
