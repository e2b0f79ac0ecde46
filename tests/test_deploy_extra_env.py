"""`saguaro deploy k8s --env NAME=VALUE` (K8sSettings.extra_env) and the chart's extraEnv: the variables reach every
Ray container of the head and worker pods; a bad name, a name the manifests or KubeRay set, or one given twice is
refused; the chart renders the generator's objects and its schema refuses the same names."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.deploy import manifests
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.deploy.extra_env import RESERVED_ENV

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "deploy" / "helm" / "saguaro-dist" / "values.schema.json").read_text())
OTEL = {"OTEL_SERVICE_NAME": "saguaro", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
OTEL_FLAGS = " ".join(f"--env {name}={value}" for name, value in OTEL.items())


def deploy(argv: str) -> list[dict]:
    return manifests(build_parser().parse_args(["deploy", "k8s", *shlex.split(argv)]))


def ray_containers(doc: dict) -> list[dict]:
    cluster = doc["spec"].get("rayClusterConfig", doc["spec"])
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [group["template"]["spec"]["containers"][0] for group in groups]


def plain_env(container: dict) -> dict:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.parametrize("kind", ["rayservice", "raycluster"])
def test_every_ray_container_gets_the_variables(kind):
    (doc,) = deploy(f"{OTEL_FLAGS} --env EMPTY= --env 'WITH_EQUALS=a=b' --kind {kind}")
    containers = ray_containers(doc)
    assert len(containers) == 3  # head, target, draft
    for container in containers:
        env = plain_env(container)
        assert {k: env.get(k) for k in (*OTEL, "EMPTY", "WITH_EQUALS")} == {**OTEL, "EMPTY": "", "WITH_EQUALS": "a=b"}
        names = [e["name"] for e in container["env"]]
        assert len(names) == len(set(names)) and names[0] == "SAGUARO_API_KEY"  # the generator's entries kept


def test_left_out_the_manifests_are_unchanged():
    assert k8s.K8sSettings().extra_env == ()
    assert k8s.rayservice(k8s.K8sSettings()) == k8s.rayservice(k8s.K8sSettings(extra_env={}))
    assert k8s.helm_values(k8s.K8sSettings())["extraEnv"] == {}


def test_settings_take_a_mapping_strings_or_pairs_alike():
    want = tuple(sorted(OTEL.items()))
    assert k8s.K8sSettings(extra_env=OTEL).extra_env == want
    assert k8s.K8sSettings(extra_env=[f"{k}={v}" for k, v in OTEL.items()]).extra_env == want
    assert k8s.K8sSettings(extra_env=list(OTEL.items())).extra_env == want
    hash(k8s.K8sSettings(extra_env=OTEL))  # the settings stay hashable


@pytest.mark.parametrize("name", sorted(RESERVED_ENV))
def test_a_name_the_manifests_or_kuberay_set_is_refused(name, capsys):
    assert main(["deploy", "k8s", "--env", f"{name}=x"]) == 2
    assert f"cannot set {name}" in capsys.readouterr().err


@pytest.mark.parametrize("entry, message", [
    ("1ABC=x", "not an environment variable name"), ("A-B=x", "not an environment variable name"),
    ("=x", "not an environment variable name"), ("NO_EQUALS", "entries are NAME=VALUE"),
])
def test_a_bad_entry_is_refused_naming_it(entry, message, capsys):
    assert main(["deploy", "k8s", "--env", entry]) == 2
    err = capsys.readouterr().err
    assert "--env" in err and message in err


def test_a_name_given_twice_or_a_value_no_string_is_refused():
    with pytest.raises(ValueError, match="gives A twice"):
        k8s.K8sSettings(extra_env=["A=1", "A=2"])
    with pytest.raises(ValueError, match="must be a string"):
        k8s.K8sSettings(extra_env={"A": 1})


@pytest.mark.parametrize("kind_flags", [["--kind", "serve-config"], ["--kind", "batch-job", "--batch-pvc", "data"]])
def test_kinds_without_ray_pods_refuse_it(kind_flags, capsys):
    assert main(["deploy", "k8s", "--env", "A=1", *kind_flags]) == 2
    assert "--env only applies to the Ray pods" in capsys.readouterr().err


def test_the_chart_schema_refuses_the_reserved_names_as_python_does():
    names = SCHEMA["properties"]["extraEnv"]["propertyNames"]
    assert sorted(names["not"]["enum"]) == sorted(RESERVED_ENV)
    assert names["pattern"] == "^[A-Za-z_][A-Za-z0-9_]*$"


def test_the_chart_renders_the_generators_objects():
    from test_deploy_serve_flags import render_rayservice  # (skips where Helm's library is not installed)

    settings = k8s.K8sSettings(extra_env={**OTEL, "EMPTY": ""})
    rendered = render_rayservice(k8s.helm_values(settings))
    assert validation.comparable(rendered) == validation.comparable(k8s.rayservice(settings))
    for container in ray_containers(rendered):
        assert plain_env(container)["OTEL_SERVICE_NAME"] == "saguaro"


@pytest.mark.parametrize("env", [{"HF_HOME": "/x"}, {"RAY_ADDRESS": "x:1"}, {"1A": "x"}, {"A": 1}])
def test_the_chart_refuses_what_the_settings_refuse(env):
    from test_deploy_serve_flags import render_rayservice  # (skips where Helm's library is not installed)

    with pytest.raises(ValueError):
        k8s.K8sSettings(extra_env=env)
    with pytest.raises(Exception, match="schema"):
        render_rayservice({"extraEnv": env})


def test_values_yaml_default_is_no_extra_env():
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "saguaro-dist" / "values.yaml").read_text())
    assert values["extraEnv"] == {}
