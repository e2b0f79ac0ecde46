"""--otlp-traces-endpoint in the KubeRay manifests (`saguaro deploy k8s`) and the Helm chart
(server.otlpTracesEndpoint): the app's own parser reads it back from the manifest; left out, the manifest names none; the chart renders the
generator's objects."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.deploy import manifests
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.serve.app import server_options

ENDPOINT = "http://otel-collector.observability:4317"
CRD_DIR = Path(__file__).resolve().parents[2] / "shared" / "kuberay-crds"


def deploy(argv: str) -> list[dict]:
    return manifests(build_parser().parse_args(["deploy", "k8s", *shlex.split(argv)]))


def app_args(rayservice: dict) -> dict:
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return app["args"]


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    """The manifests name SAGUARO_API_KEY (their pods set it from a Secret): the app's options read it here."""
    monkeypatch.setenv("SAGUARO_API_KEY", "k")


def test_flag_reaches_the_apps_server_options():
    args = app_args(deploy(f"--otlp-traces-endpoint {ENDPOINT}")[0])
    assert args["otlp_traces_endpoint"] == ENDPOINT
    assert server_options(args, args["model"]).otlp_traces_endpoint == ENDPOINT


def test_left_out_the_manifest_names_none():
    assert "otlp_traces_endpoint" not in app_args(deploy("")[0])
    assert k8s.helm_values(k8s.K8sSettings())["server"]["otlpTracesEndpoint"] == ""


@pytest.mark.parametrize("value", [" ", "\t\n", 4317])
def test_settings_refuse_what_is_no_url(value):
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        k8s.K8sSettings(otlp_traces_endpoint=value)


def test_chart_renders_the_generators_endpoint():
    from test_deploy_serve_flags import render_rayservice  # (skips where Helm's library is not installed)

    assert "otlp_traces_endpoint" not in app_args(render_rayservice(None))
    (generated,) = deploy(f"--otlp-traces-endpoint {ENDPOINT}")
    rendered = render_rayservice(k8s.helm_values(k8s.K8sSettings(otlp_traces_endpoint=ENDPOINT)))
    assert app_args(rendered)["otlp_traces_endpoint"] == ENDPOINT
    assert validation.comparable(rendered) == validation.comparable(generated)
    if (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        validation.validate_object(rendered, CRD_DIR)


def test_empty_endpoint_means_no_tracing_as_in_serve_and_the_chart(capsys):
    """Old: `saguaro deploy k8s --otlp-traces-endpoint ""` exited 2 ("must be a URL"), where `saguaro serve` and the
    chart's "" mean no tracing (as "" means none for the other optional deploy settings)."""
    assert k8s.K8sSettings(otlp_traces_endpoint="").otlp_traces_endpoint is None
    assert "otlp_traces_endpoint" not in app_args(deploy('--otlp-traces-endpoint ""')[0])
    assert main(["deploy", "k8s", "--otlp-traces-endpoint", ""]) == 0
    assert "otlp_traces_endpoint" not in app_args(yaml.safe_load(capsys.readouterr().out))


@pytest.mark.parametrize("value", [" ", "   ", "\t"])
def test_the_chart_refuses_a_blank_endpoint_as_the_generator(value):
    """Old: the chart passed "   " to the replicas, whose ServerOptions refuses it: every replica failed to start."""
    from test_deploy_serve_flags import render_rayservice  # (skips where Helm's library is not installed)

    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        k8s.K8sSettings(otlp_traces_endpoint=value)
    with pytest.raises(Exception, match="schema"):
        render_rayservice({"server": {"otlpTracesEndpoint": value}})
    assert "otlp_traces_endpoint" not in app_args(render_rayservice({"server": {"otlpTracesEndpoint": ""}}))


def test_detailed_traces_reach_the_manifest_and_the_apps_server_options():
    """--collect-detailed-traces was a `saguaro serve` flag only: `saguaro deploy k8s` had none."""
    from saguaro_dist.serve.tracing import DetailedTraces

    args = app_args(deploy(f"--otlp-traces-endpoint {ENDPOINT} --collect-detailed-traces model worker")[0])
    assert args["collect_detailed_traces"] == ["model", "worker"]
    assert server_options(args, args["model"]).collect_detailed_traces == {DetailedTraces.MODEL, DetailedTraces.WORKER}
    assert "collect_detailed_traces" not in app_args(deploy(f"--otlp-traces-endpoint {ENDPOINT}")[0])
    assert k8s.K8sSettings(collect_detailed_traces="model, all", otlp_traces_endpoint=ENDPOINT
                           ).collect_detailed_traces == ("model", "all")  # vLLM's comma-separated text too
    assert k8s.helm_values(k8s.K8sSettings())["server"]["collectDetailedTraces"] == []


@pytest.mark.parametrize("argv", ["--collect-detailed-traces all", "--collect-detailed-traces model --kind serve-config",
                                  "--collect-detailed-traces all --otlp-traces-endpoint ''"])
def test_detailed_traces_without_an_endpoint_are_refused_at_deploy(argv, capsys):
    """As `saguaro serve` refuses them (vLLM's rule): else every replica would fail at start-up."""
    assert main(["deploy", "k8s", *shlex.split(argv)]) == 2
    err = capsys.readouterr().err
    assert "requires `--otlp-traces-endpoint`" in err and "Traceback" not in err, err


def test_an_unknown_detailed_trace_module_is_refused_at_deploy():
    with pytest.raises(ValueError, match=r"'scheduler' is not one of \['model', 'worker', 'all'\]"):
        k8s.K8sSettings(otlp_traces_endpoint=ENDPOINT, collect_detailed_traces=["scheduler"])


def test_chart_renders_the_generators_detailed_traces_and_refuses_them_without_an_endpoint():
    from test_deploy_serve_flags import render_rayservice  # (skips where Helm's library is not installed)

    settings = k8s.K8sSettings(otlp_traces_endpoint=ENDPOINT, collect_detailed_traces=["all"])
    (generated,) = deploy(f"--otlp-traces-endpoint {ENDPOINT} --collect-detailed-traces all")
    rendered = render_rayservice(k8s.helm_values(settings))
    assert app_args(rendered)["collect_detailed_traces"] == ["all"]
    assert validation.comparable(rendered) == validation.comparable(generated)
    if (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        validation.validate_object(rendered, CRD_DIR)
    with pytest.raises(Exception, match="collectDetailedTraces requires server.otlpTracesEndpoint"):
        render_rayservice({"server": {"collectDetailedTraces": ["model"]}})
    with pytest.raises(Exception, match="schema"):
        render_rayservice({"server": {"otlpTracesEndpoint": ENDPOINT, "collectDetailedTraces": ["scheduler"]}})


def test_comma_separated_detailed_traces_render_alike_in_the_generator_and_the_chart():
    """`--collect-detailed-traces model,worker` (vLLM's comma form) kept "model,worker" as one name: the
    manifest worked, but the chart's schema refused the same settings' Helm values."""
    settings = k8s.K8sSettings(otlp_traces_endpoint=ENDPOINT, collect_detailed_traces=["model,worker"])
    assert settings.collect_detailed_traces == ("model", "worker")
    assert k8s.helm_values(settings)["server"]["collectDetailedTraces"] == ["model", "worker"]
    args = app_args(deploy(f"--otlp-traces-endpoint {ENDPOINT} --collect-detailed-traces model,worker")[0])
    assert args["collect_detailed_traces"] == ["model", "worker"]
