"""GCS fault tolerance (KubeRay gcsFaultToleranceOptions, an external Redis) for the RayService: off by default,
the generator and the Helm chart write the same options, they pass the KubeRay CRDs (strict) and KubeRay's own
rules, and bad values are refused with a message naming the value."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import main
from saguaro_dist.deploy import k8s, validation

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "saguaro-dist"
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds"
OPTIONS = "gcsFaultToleranceOptions"

SETTINGS = {
    "address-only": k8s.K8sSettings(gcs_ft_redis_address="redis:6379"),
    "password-secret": k8s.K8sSettings(gcs_ft_redis_address="redis-master.infra.svc.cluster.local:6380",
                                       gcs_ft_redis_password_secret="redis-auth", gcs_ft_redis_password_secret_key="pw"),
    "gpu-ipv4-default-key": k8s.K8sSettings(gpu=True, tp=2, draft_workers=2, gcs_ft_redis_address="10.0.0.7:6379",
                                            gcs_ft_redis_password_secret="redis-auth"),
}
PASSWORD_REF = {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "pw"}}}


@pytest.fixture(scope="module")
def crds() -> Path:
    if not (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (the shared/kuberay-crds folder beside the repo)")
    return CRD_DIR


# ---- the generator -------------------------------------------------------------------------------

def test_off_by_default():
    s = k8s.K8sSettings()
    assert OPTIONS not in k8s.rayservice(s)["spec"]["rayClusterConfig"]
    assert k8s.helm_values(s)["gcsFaultTolerance"]["redisAddress"] == ""


@pytest.mark.parametrize("key", SETTINGS)
def test_rayservice_carries_the_options_and_passes_the_crd(crds, key):
    s = SETTINGS[key]
    service = k8s.rayservice(s)
    options = service["spec"]["rayClusterConfig"][OPTIONS]
    assert options["redisAddress"] == s.gcs_ft_redis_address
    if s.gcs_ft_redis_password_secret:
        ref = options["redisPassword"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": s.gcs_ft_redis_password_secret, "key": s.gcs_ft_redis_password_secret_key}
    else:
        assert "redisPassword" not in options
    # KubeRay injects the storage namespace (the cluster's UID) and the workers' reconnect timeout: not pinned here
    assert "externalStorageNamespace" not in options
    validation.validate_object(service, crds)  # the CRD, strict, and KubeRay's gcsFaultToleranceOptions rules


def test_password_secret_options():
    assert k8s.gcs_fault_tolerance(SETTINGS["password-secret"]) == {
        "redisAddress": "redis-master.infra.svc.cluster.local:6380", "redisPassword": PASSWORD_REF}
    assert k8s.K8sSettings(gcs_ft_redis_address="r:1", gcs_ft_redis_password_secret="s").gcs_ft_redis_password_secret_key == "password"


def test_batch_raycluster_stays_without(crds):
    """Ray supports GCS fault tolerance for Serve; a batch job's driver dies with the head either way."""
    cluster = k8s.raycluster(SETTINGS["password-secret"])
    assert OPTIONS not in cluster["spec"]
    validation.validate_object(cluster, crds)


@pytest.mark.parametrize("kwargs, message", [
    ({"gcs_ft_redis_address": "redis"}, "gcs_ft_redis_address must be HOST:PORT"),
    ({"gcs_ft_redis_address": "redis://redis:6379"}, "no scheme"),
    ({"gcs_ft_redis_address": "redis:0"}, "a port 1-65535"),
    ({"gcs_ft_redis_address": "redis:65536"}, "got 'redis:65536'"),
    ({"gcs_ft_redis_address": "-redis:6379"}, "a DNS name or IPv4 address"),
    ({"gcs_ft_redis_password_secret": "redis-auth"}, "needs gcs_ft_redis_address"),
    ({"gcs_ft_redis_address": "redis:6379", "gcs_ft_redis_password_secret": "Redis_Auth"}, "must name a Secret"),
    ({"gcs_ft_redis_address": "redis:6379", "gcs_ft_redis_password_secret": "s",
      "gcs_ft_redis_password_secret_key": "a/b"}, "must be a Secret key"),
])
def test_settings_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        k8s.K8sSettings(**kwargs)


def test_empty_strings_mean_off():
    s = k8s.K8sSettings(gcs_ft_redis_address="", gcs_ft_redis_password_secret="")
    assert (s.gcs_ft_redis_address, s.gcs_ft_redis_password_secret) == (None, None)


@pytest.mark.parametrize("clash", [
    lambda spec: spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"}),
    lambda spec: spec["headGroupSpec"]["rayStartParams"].update({"redis-password": "x"}),
    lambda spec: spec[OPTIONS].pop("redisAddress"),
], ids=["head-env", "start-param", "no-address"])
def test_validation_applies_kuberays_rules(clash):
    service = copy.deepcopy(k8s.rayservice(SETTINGS["password-secret"]))
    clash(service["spec"]["rayClusterConfig"])
    with pytest.raises(ValueError, match="gcsFaultToleranceOptions"):
        validation.validate_gcs_fault_tolerance(service)


# ---- the CLI -------------------------------------------------------------------------------------

def test_cli_writes_the_options(capsys):
    argv = ["deploy", "k8s", "--gcs-ft-redis-address", "redis-master.infra.svc.cluster.local:6380",
            "--gcs-ft-redis-password-secret", "redis-auth:pw"]
    assert main(argv) == 0
    (doc,) = list(yaml.safe_load_all(capsys.readouterr().out))
    assert doc == k8s.rayservice(SETTINGS["password-secret"])


def test_cli_secret_key_defaults_to_password(capsys):
    assert main(["deploy", "k8s", "--gcs-ft-redis-address", "r:6379", "--gcs-ft-redis-password-secret", "auth"]) == 0
    (doc,) = list(yaml.safe_load_all(capsys.readouterr().out))
    ref = doc["spec"]["rayClusterConfig"][OPTIONS]["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "auth", "key": "password"}


@pytest.mark.parametrize("argv, message", [
    (["--gcs-ft-redis-address", "redis:99999"], "gcs_ft_redis_address must be HOST:PORT"),
    (["--gcs-ft-redis-password-secret", "auth"], "needs gcs_ft_redis_address"),
    (["--gcs-ft-redis-address", "r:1", "--gcs-ft-redis-password-secret", "auth:"], "NAME or NAME:KEY"),
    (["--gcs-ft-redis-address", "r:1", "--kind", "raycluster"], "only applies to the RayService"),
    (["--gcs-ft-redis-address", "r:1", "--kind", "serve-config"], "only applies to the RayService"),
])
def test_cli_refuses_bad_options(capsys, argv, message):
    try:
        code = main(["deploy", "k8s", *argv])
    except SystemExit as exit_:  # argparse's own refusal (the flag's type)
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


# ---- the Helm chart ------------------------------------------------------------------------------

def helm():
    return pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2")


def render(values: dict | None) -> dict:
    with helm().Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="saguaro", namespace="default")
    docs = [doc for path, text in sorted(files.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


@pytest.mark.parametrize("key", SETTINGS)
def test_chart_renders_the_generators_objects(crds, key):
    s = SETTINGS[key]
    rendered = render({**k8s.helm_values(s), "rayCluster": {"enabled": True}})
    for kind, name, built in (("RayService", s.name, k8s.rayservice(s)), ("RayCluster", f"{s.name}-batch", k8s.raycluster(s))):
        validation.validate_object(rendered[(kind, name)], crds)
        assert validation.comparable(rendered[(kind, name)]) == validation.comparable(built)
    assert rendered[("RayService", s.name)]["spec"]["rayClusterConfig"][OPTIONS] == k8s.gcs_fault_tolerance(s)


def test_chart_lints_clean_with_the_option():
    report = helm().lint(str(CHART), values=k8s.helm_values(SETTINGS["password-secret"]), strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("values", [
    {"gcsFaultTolerance": {"redisAddress": "redis"}},
    {"gcsFaultTolerance": {"redisAddress": "redis://redis:6379"}},
    {"gcsFaultTolerance": {"redisAddress": "redis:70000"}},
    {"gcsFaultTolerance": {"redisAddress": "redis:6379", "redisPassword": {"secretName": "Redis_Auth"}}},
    {"gcsFaultTolerance": {"redisAddress": "redis:6379", "redisPassword": {"secretName": "a", "secretKey": "a/b"}}},
], ids=["no-port", "scheme", "port-range", "secret-name", "secret-key"])
def test_chart_schema_refuses_bad_values(values):
    report = helm().lint(str(CHART), values=values, strict=True)
    assert any("gcsFaultTolerance" in error for error in report["errors"]), report


def test_chart_refuses_a_password_without_an_address():
    with pytest.raises(Exception, match="redisPassword.secretName needs gcsFaultTolerance.redisAddress"):
        render({"gcsFaultTolerance": {"redisPassword": {"secretName": "redis-auth"}}})


def test_chart_schema_and_generator_share_the_address_rule():
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    pattern = schema["properties"]["gcsFaultTolerance"]["properties"]["redisAddress"]["pattern"]
    assert pattern == f"^({k8s.REDIS_ADDRESS.pattern})?$"
