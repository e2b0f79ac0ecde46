"""Review fixes in the Kubernetes deployment (saguaro_dist/deploy, `saguaro deploy k8s`, the Helm chart): the chart's
enums are the app's, Secret / PVC / label names are checked before Kubernetes refuses the pods, every setting has a
CLI option, the pull policy defaults as Kubernetes', and Ray's CPUs round up as KubeRay's num-cpus does."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import build_parser, main
from saguaro_dist.config import DTYPES, FallbackPolicy, Mode, SchedulingPolicy
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.lora_request import MAX_LORA_RANKS
from saguaro_dist.serve.reasoning import ReasoningParser
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.speculative_config import _INERT, DRAFT_SAMPLE_TOP_K, SUPPORTED_METHODS

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")
from test_deploy_helm import by_kind, render  # noqa: E402  (after the skip: it needs helm_python too)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "saguaro-dist"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def containers(obj: dict) -> list[dict]:
    spec = obj["spec"].get("rayClusterConfig", obj["spec"])
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return [c for t in templates for c in t["spec"]["containers"]]


def rendered_rayservice(values: dict | None) -> dict:
    (obj,) = [d for d in render(values) if d["kind"] == "RayService"]
    return obj


def assert_chart_renders_the_generators(s: k8s.K8sSettings) -> None:
    rendered = by_kind(render(k8s.helm_values(s)))[("RayService", s.name)]
    assert validation.comparable(rendered) == validation.comparable(k8s.rayservice(s))


# ---- 1. the chart's enums are the Python ones --------------------------------------------------------

def python_enums() -> dict:
    """Each enum of values.schema.json, by its path, and the Python values it must equal."""
    from saguaro_dist.deploy.settings import ImagePullPolicy
    values = lambda enum_type: [m.value for m in enum_type]  # noqa: E731
    return {"image.pullPolicy": ["", *values(ImagePullPolicy)],
            "model.toolCallParser": ["", *values(ToolCallParser)],
            "model.reasoningParser": ["", *values(ReasoningParser)],
            "speculation.mode": [*values(Mode), None],
            "speculation.fallback": values(FallbackPolicy),
            "speculation.speculativeConfig.method": [*SUPPORTED_METHODS, None],
            "speculation.speculativeConfig.draft_sample_method": list(DRAFT_SAMPLE_TOP_K),
            "engine.schedulingPolicy": values(SchedulingPolicy),
            "engine.dtype": ["", *DTYPES],
            "lora.maxLoraRank": [*MAX_LORA_RANKS, None],
            "upgradeStrategy": values(k8s.UpgradeStrategy)}


def schema_enums(node: dict, path: str = "") -> dict:
    found = {path: node["enum"]} if "enum" in node else {}
    for key, child in node.get("properties", {}).items():
        found.update(schema_enums(child, f"{path}.{key}" if path else key))
    return found


def test_the_charts_enums_are_the_apps():
    """Old: toolCallParser and reasoningParser lacked qwen3_coder, pythonic, openai and openai_gptoss, which the
    app and `saguaro deploy k8s` take. speculativeConfig's inert keys are test_deploy_speculative_config's."""
    inert = {f"speculation.speculativeConfig.{key}" for key in _INERT}
    found = {path: enum for path, enum in schema_enums(SCHEMA).items() if path not in inert}
    expected = python_enums()
    assert set(found) == set(expected), "an enum in values.schema.json without its Python source here"
    for path, enum in found.items():
        assert sorted(map(json.dumps, enum)) == sorted(map(json.dumps, expected[path])), path


@pytest.mark.parametrize("settings", [dict(tool_call_parser=p.value) for p in ToolCallParser]
                         + [dict(reasoning_parser=p.value) for p in ReasoningParser],
                         ids=lambda d: next(iter(d.values())))
def test_every_parser_renders_from_the_chart_as_from_the_generator(settings):
    assert_chart_renders_the_generators(k8s.K8sSettings(**settings))


def k8s_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for name in ("deploy", "k8s"):
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


def test_the_clis_choices_are_the_apps():
    from saguaro_dist.deploy.settings import ImagePullPolicy
    options = {a.dest: a for a in k8s_parser()._actions}
    for dest, enum_type in (("mode", Mode), ("fallback", FallbackPolicy), ("scheduling_policy", SchedulingPolicy),
                            ("tool_call_parser", ToolCallParser), ("reasoning_parser", ReasoningParser),
                            ("upgrade_strategy", k8s.UpgradeStrategy), ("image_pull_policy", ImagePullPolicy)):
        assert sorted(options[dest].choices) == sorted(m.value for m in enum_type), dest
    assert sorted(options["dtype"].choices) == sorted(DTYPES)


# ---- 2. names Kubernetes checks only as it creates the pods ---------------------------------------------

@pytest.mark.parametrize("settings, message", [
    (dict(api_key_secret="My_Secret"), "api_key_secret must name a Secret"),
    (dict(api_key_secret=""), "api_key_secret is required"),
    (dict(hf_token_secret="hf.token-"), "hf_token_secret must name a Secret"),
    (dict(api_key_secret_key="api/key"), "api_key_secret_key must be a Secret key"),
    (dict(hf_token_secret_key=""), "hf_token_secret_key must be a Secret key"),
    (dict(models_pvc="Weights"), "models_pvc must name a PersistentVolumeClaim"),
    (dict(image_pull_secrets=["a" * 254]), "at most 253"),
    (dict(gpu_type="NVIDIA H100 80GB HBM3"), "gpu_type must be a node label value"),
    (dict(gpu_type="-H100"), "gpu_type must be a node label value"),
    (dict(gpu_type="H" * 64), "gpu_type must be a node label value"),
    (dict(image_pull_policy="always"), "image_pull_policy must be one of"),
    (dict(idle_timeout_s=0), "idle_timeout_s is not supported"),  # (no autoscaling: no pod to time)
])
def test_names_kubernetes_would_refuse_are_refused_here(settings, message):
    with pytest.raises(ValueError, match=message):
        k8s.K8sSettings(**settings)


@pytest.mark.parametrize("values", [
    {"apiKey": {"secretName": "My_Secret"}}, {"apiKey": {"secretName": ""}}, {"apiKey": {"secretKey": "api/key"}},
    {"hfToken": {"secretName": "hf.token-"}}, {"hfToken": {"secretKey": ""}}, {"modelStorage": {"pvc": "Weights"}},
    {"gpu": {"type": "NVIDIA H100 80GB HBM3"}}, {"image": {"pullSecrets": ["a" * 254]}},
], ids=lambda v: json.dumps(v)[:40])
def test_the_charts_schema_refuses_the_same_names(values):
    with pytest.raises(Exception, match="schema"):
        render(values)


def test_the_charts_name_patterns_are_the_generators():
    props = SCHEMA["properties"]
    subdomain, key, label = k8s.DNS_SUBDOMAIN.pattern, k8s.SECRET_KEY.pattern, k8s.LABEL_VALUE.pattern
    assert props["apiKey"]["properties"]["secretName"]["pattern"] == f"^{subdomain}$"
    assert props["hfToken"]["properties"]["secretName"]["pattern"] == f"^({subdomain})?$"  # "" = no token
    assert props["modelStorage"]["properties"]["pvc"]["pattern"] == f"^({subdomain})?$"  # "" = emptyDir
    for secret in ("apiKey", "hfToken"):
        assert props[secret]["properties"]["secretKey"]["pattern"] == f"^{key}$"
    assert props["gpu"]["properties"]["type"]["pattern"] == f"^({label})?$"


def test_empty_optional_names_mean_none_as_in_the_helm_values():
    """Old: `--hf-token-secret ""` wrote secretKeyRef name '' (the pods never start). Now "" is "no HF token",
    as "" is "none" for the PVC, the GPU type and the other optional settings; the chart agrees."""
    s = k8s.K8sSettings(hf_token_secret="", models_pvc="", gpu_type="")
    assert (s.hf_token_secret, s.models_pvc, s.gpu_type, s.gpu) == (None, None, None, False)
    for c in containers(k8s.rayservice(s)):
        assert "HF_TOKEN" not in {e["name"] for e in c["env"]}
    assert_chart_renders_the_generators(s)


def test_the_cli_takes_no_hf_token_and_refuses_no_api_key(capsys):
    assert main(["deploy", "k8s", "--hf-token-secret", ""]) == 0
    (doc,) = yaml.safe_load_all(capsys.readouterr().out)
    assert all("HF_TOKEN" not in {e["name"] for e in c["env"]} for c in containers(doc))
    assert main(["deploy", "k8s", "--api-key-secret", ""]) == 2
    assert "api_key_secret is required" in capsys.readouterr().err
    assert main(["deploy", "k8s", "--gpu-type", "NVIDIA H100 80GB HBM3"]) == 2
    assert "gpu_type must be a node label value" in capsys.readouterr().err


# ---- 3. every setting has a CLI option; the pull policy defaults as Kubernetes' -----------------------------

# the fields set through another option, deliberately
NO_OPTION_OF_THEIR_OWN = {"gcs_ft_redis_password_secret_key": "--gcs-ft-redis-password-secret NAME:KEY"}


def test_every_setting_has_a_cli_option():
    """values.yaml says every value has a `saguaro deploy k8s` option. Old: --image-pull-policy, the Secrets' keys
    and --idle-timeout-s had none."""
    fields = {f.name for f in dataclasses.fields(k8s.K8sSettings)}
    dests = {a.dest for a in k8s_parser()._actions}
    assert set(NO_OPTION_OF_THEIR_OWN) <= fields - dests
    assert fields - dests - set(NO_OPTION_OF_THEIR_OWN) == set()


def test_the_new_options_reach_the_manifest(capsys):
    assert main(["deploy", "k8s", "--image-pull-policy", "Never", "--api-key-secret-key", "key",
                 "--hf-token-secret-key", "tok"]) == 0
    (doc,) = yaml.safe_load_all(capsys.readouterr().out)
    for c in containers(doc):
        assert c["imagePullPolicy"] == "Never"
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"] if "valueFrom" in e}
        assert refs == {"SAGUARO_API_KEY": "key", "HF_TOKEN": "tok"}
    assert main(["deploy", "k8s", "--idle-timeout-s", "120"]) == 2  # (the draft pool is fixed: nothing to time)
    assert "--idle-timeout-s is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("image, policy", [
    ("reg.example/team/saguaro-dist:latest", "Always"), ("saguaro-dist", "Always"), ("reg.example:5000/s", "Always"),
    ("reg.example:5000/s:1.0", "IfNotPresent"), ("s@sha256:" + "0" * 64, "IfNotPresent"), (None, "IfNotPresent"),
])
def test_the_pull_policy_defaults_as_kubernetes(image, policy):
    """Old: IfNotPresent always, so a :latest image was never pulled again (Kubernetes' default: Always)."""
    s = k8s.K8sSettings(image=image)
    assert {c["imagePullPolicy"] for c in containers(k8s.rayservice(s))} == {policy}
    assert k8s.K8sSettings(image=image, image_pull_policy="IfNotPresent").pull_policy == "IfNotPresent"


def test_the_chart_defaults_the_pull_policy_as_the_generator():
    for s in (k8s.K8sSettings(image="reg.example/s:latest"), k8s.K8sSettings(image="reg.example/s:latest",
                                                                             image_pull_policy="Never")):
        assert_chart_renders_the_generators(s)
    assert {c["imagePullPolicy"] for c in containers(rendered_rayservice({"image": {"tag": "latest"}}))} == {"Always"}


# ---- 4. Ray's CPUs round up, as KubeRay's num-cpus ---------------------------------------------------

def test_cpu_quantities_round_up_as_kuberay():
    """KubeRay sets num-cpus to the limit's Quantity.Value(), which rounds up: "1500m" gives Ray 2 CPUs."""
    assert [k8s.cpu_quantity(q) for q in ("1500m", "1001m", "0.1", "2500m", "3", "0")] == [2, 2, 1, 3, 3, 0]
    for bad in ("-1", "nan", "2 cpus"):
        with pytest.raises(ValueError, match="CPU quantity"):
            k8s.cpu_quantity(bad)


def test_pods_enough_once_rounded_up_are_accepted_by_both():
    """Old: refused, "gives Ray 1 CPU(s)", where KubeRay gives 2."""
    for s in (k8s.K8sSettings(target_cpu="1500m"), k8s.K8sSettings(tp=2, target_cpu="2500m", draft_cpu="100m")):
        assert_chart_renders_the_generators(s)
    with pytest.raises(ValueError, match="gives Ray 1 CPU"):
        k8s.K8sSettings(target_cpu="900m")


# ---- serve-config with --service-monitor; the chart's name limit ----------------------------------------

def test_a_serve_config_takes_no_service_monitor(capsys):
    assert main(["deploy", "k8s", "--kind", "serve-config", "--service-monitor"]) == 2
    assert "--service-monitor" in capsys.readouterr().err


def test_a_batch_pvc_kubernetes_would_refuse_is_refused(capsys):
    assert main(["deploy", "k8s", "--kind", "batch-job", "--batch-pvc", "My_PVC"]) == 2
    assert "--batch-pvc must name a PersistentVolumeClaim" in capsys.readouterr().err


def test_the_chart_refuses_a_release_name_past_40_characters_as_the_generator():
    """Old: the chart cut it to 40 characters (Services named otherwise than asked) where the generator refused."""
    name = "a" * 45
    with pytest.raises(ValueError, match="1-40"):
        k8s.K8sSettings(name=name)
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(Exception, match="1-40"):
            chart.render(None, name=name, namespace="default")


# ---- Secret keys Kubernetes refuses; the pull policy of a tag with a digest ------------------------------

@pytest.mark.parametrize("key", [".", "..", "..key", "...", "a/b"])
def test_secret_keys_kubernetes_refuses_are_refused_by_both(key):
    """Old: ".", ".." and keys starting with ".." passed [-._a-zA-Z0-9]+, which Kubernetes' IsConfigMapKey refuses
    (the pods then never start)."""
    for field in ("api_key_secret_key", "hf_token_secret_key"):
        with pytest.raises(ValueError, match=f"{field} must be a Secret key"):
            k8s.K8sSettings(**{field: key})
    for values in ({"apiKey": {"secretKey": key}}, {"hfToken": {"secretKey": key}},
                   {"gcsFaultTolerance": {"redisAddress": "redis:6379",
                                          "redisPassword": {"secretName": "redis", "secretKey": key}}}):
        with pytest.raises(Exception, match="schema"):
            render(values)


@pytest.mark.parametrize("key", [".key", "a..b", "key.", "-", "_k", "token"])
def test_secret_keys_kubernetes_takes_are_taken_by_both(key):
    s = k8s.K8sSettings(api_key_secret_key=key, hf_token_secret_key=key)
    assert_chart_renders_the_generators(s)


DIGEST = "@sha256:" + "ab" * 32


@pytest.mark.parametrize("image, policy", [
    ("reg.example/s", "Always"), ("reg.example/s:latest", "Always"), ("reg.example/s:v1", "IfNotPresent"),
    ("reg.example:5000/s", "Always"), ("reg.example:5000/s:v1", "IfNotPresent"),
    ("reg.example/s" + DIGEST, "IfNotPresent"), ("reg.example/s:latest" + DIGEST, "Always"),
    ("reg.example/s:v1" + DIGEST, "IfNotPresent"), ("reg.example:5000/s:latest" + DIGEST, "Always"),
])
def test_the_chart_and_the_generator_pull_every_image_form_alike(image, policy):
    """Old: the chart read `reg/s:latest@sha256:...` as not latest (IfNotPresent) where the generator, as Kubernetes'
    ParseImageName, reads the tag latest (Always). The image is the same one (no tag: Kubernetes' :latest)."""
    s = k8s.K8sSettings(image=image)
    generated, rendered = containers(k8s.rayservice(s)), containers(rendered_rayservice(k8s.helm_values(s)))
    assert {c["imagePullPolicy"] for c in generated} == {c["imagePullPolicy"] for c in rendered} == {policy}
    from saguaro_dist.deploy.settings import image_tag

    implicit_latest = "@" not in image and image_tag(image) == "latest" and not image.endswith(":latest")
    assert {c["image"] for c in rendered} == {image + ":latest" if implicit_latest else image}
    assert {c["image"] for c in generated} == {image}
