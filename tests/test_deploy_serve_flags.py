"""`saguaro serve`'s engine and server flags in the KubeRay manifests (`saguaro deploy k8s`) and the Helm
chart: --seed, --max-num-batched-tokens, --[no-]enable-prefix-caching, --enforce-eager, --disable-log-stats,
--max-request-bytes, --stream-interval-ms, --enable-log-requests. Same names as `saguaro serve`, checked when
the manifest is written, parsed by the app's own code (config_from_args, server_options) and valid against the
KubeRay CRDs. The chart renders the same objects (test_deploy_helm's SETTINGS hold these flags too)."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import build_parser
from saguaro_dist.cli.deploy import manifests
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.serve.app import server_options
from saguaro_dist.serve.args import config_from_args

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "saguaro-dist"
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds"
ALL_FLAGS = ("--seed 1234 --max-num-batched-tokens 512 --no-enable-prefix-caching --enforce-eager --disable-log-stats "
             "--max-request-bytes 4096 --stream-interval-ms 12.5 --enable-log-requests")
# what the app reads from the manifest for ALL_FLAGS: the engine Config's fields and the server options'
ENGINE = {"seed": 1234, "max_num_batched_tokens": 512, "enable_prefix_caching": False, "enforce_eager": True,
          "log_stats_interval_s": 0.0}
SERVER = {"max_request_bytes": 4096, "stream_interval_ms": 12.5, "log_requests": True}
NEW_ARGS = {"seed", "max_num_batched_tokens", "enable_prefix_caching", "enforce_eager", "log_stats_interval_s",
            "max_request_bytes", "stream_interval_ms", "log_requests"}


@pytest.fixture(scope="module")
def crds() -> Path:
    if not (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (the shared/kuberay-crds folder beside the repo)")
    return CRD_DIR


def deploy(argv: str) -> list[dict]:
    return manifests(build_parser().parse_args(["deploy", "k8s", *shlex.split(argv)]))


def app_args(rayservice: dict) -> dict:
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return app["args"]


# ---- the generator ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["rayservice", "serve-config"])
def test_serve_flags_reach_the_apps_engine_and_server(kind, monkeypatch):
    """The flags as `saguaro serve` spells them, read back by the app's own parsers from the manifest."""
    monkeypatch.setenv("SAGUARO_API_KEY", "k")  # the pods' Secret: an app naming it refuses to start without it
    (doc,) = deploy(f"--kind {kind} {ALL_FLAGS}")
    (app,) = (doc if kind == "serve-config" else yaml.safe_load(doc["spec"]["serveConfigV2"]))["applications"]
    config = config_from_args(app["args"])
    assert {name: getattr(config, name) for name in ENGINE} == ENGINE
    options = server_options(app["args"], app["args"]["model"])
    assert {name: getattr(options, name) for name in SERVER} == SERVER


def test_defaults_add_no_args():
    """Left out, the app's own defaults hold and the manifest names none of them (unchanged manifests)."""
    assert NEW_ARGS.isdisjoint(k8s.serve_args(k8s.K8sSettings()))
    assert NEW_ARGS.isdisjoint(app_args(deploy("")[0]))
    assert app_args(deploy("--enable-prefix-caching")[0]) == app_args(deploy("")[0])


def test_seed_zero_is_a_seed():
    assert app_args(deploy("--seed 0")[0])["seed"] == 0
    assert app_args(deploy("--seed -7")[0])["seed"] == -7


def test_rayservice_with_serve_flags_passes_the_crd_and_app_checks(crds):
    for doc in deploy(f"{ALL_FLAGS} --service-monitor") + deploy(f"--kind raycluster {ALL_FLAGS}"):
        if doc["kind"] == "ServiceMonitor":
            continue  # its schema is test_deploy_k8s's business; nothing here changes it
        validation.validate_object(doc, crds)


@pytest.mark.parametrize("argv, message", [
    ("--seed 9223372036854775808", "seed must be an integer"),
    ("--max-num-batched-tokens 0", "max_num_batched_tokens must be an integer >= 1"),
    ("--max-request-bytes 0", "max_request_bytes must be an integer >= 1"),
    ("--stream-interval-ms -1", "stream_interval_ms must be a number in [0, 10000]"),
    ("--stream-interval-ms 10001", "stream_interval_ms must be a number in [0, 10000]"),
])
def test_bad_values_fail_when_the_manifest_is_written(argv, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        deploy(argv)


@pytest.mark.parametrize("field, value", [("enforce_eager", "no"), ("enable_prefix_caching", "false"),
                                          ("disable_log_stats", 1), ("enable_log_requests", "yes"),
                                          ("max_request_bytes", 2.5), ("stream_interval_ms", True), ("seed", True)])
def test_settings_refuse_values_the_app_would_read_otherwise(field, value):
    """A "no" read by truth turned a flag on: the settings take booleans and numbers only."""
    with pytest.raises(ValueError, match=field):
        k8s.K8sSettings(**{field: value})


def test_validator_runs_the_apps_server_checks():
    """validate_serve_config parses the server options as the replica does: a bad one fails offline."""
    config = k8s.serve_config(k8s.K8sSettings())
    config["applications"][0]["args"]["stream_interval_ms"] = 20_000
    with pytest.raises(ValueError, match="stream_interval_ms"):
        validation.validate_serve_config(k8s.to_yaml([config]))


# ---- the chart ----------------------------------------------------------------------------------

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")


def render_rayservice(values: dict | None) -> dict:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="saguaro", namespace="default")
    docs = [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    (rayservice,) = [doc for doc in docs if doc["kind"] == "RayService"]
    return rayservice


def test_chart_defaults_add_no_args():
    assert NEW_ARGS.isdisjoint(app_args(render_rayservice(None)))


def test_chart_renders_the_generators_serve_flags(crds):
    (generated,) = deploy(ALL_FLAGS)
    settings = k8s.K8sSettings(seed=1234, max_num_batched_tokens=512, enable_prefix_caching=False, enforce_eager=True,
                               disable_log_stats=True, max_request_bytes=4096, stream_interval_ms=12.5,
                               enable_log_requests=True)
    rendered = render_rayservice(k8s.helm_values(settings))
    assert validation.comparable(rendered) == validation.comparable(generated)
    validation.validate_object(rendered, crds)


@pytest.mark.parametrize("values, field", [
    ({"engine": {"seed": 2**53}}, "seed"),
    ({"engine": {"seed": 1.5}}, "seed"),
    ({"engine": {"enforceEager": "yes"}}, "enforceEager"),
    ({"engine": {"maxNumBatchedTokens": -1}}, "maxNumBatchedTokens"),
    ({"server": {"maxRequestBytes": -1}}, "maxRequestBytes"),
    ({"server": {"streamIntervalMs": 10_001}}, "streamIntervalMs"),
])
def test_chart_schema_refuses_bad_values(values, field):
    report = helm.lint(str(CHART), values=values, strict=True)
    assert any(field in error for error in report["errors"]), report


def test_helm_values_refuse_a_seed_helm_would_round():
    """Helm reads values' numbers as float64: 2**53 + 1 would render as 2**53. The generator takes it."""
    settings = k8s.K8sSettings(seed=2**53 + 1)
    assert app_args(k8s.rayservice(settings))["seed"] == 2**53 + 1
    with pytest.raises(ValueError, match="2\\*\\*53 - 1"):
        k8s.helm_values(settings)
