"""vLLM's LoRA flags (--enable-lora, --lora-modules, --max-loras, --max-lora-rank) in the KubeRay manifests (`saguaro
deploy k8s`, K8sSettings) and the Helm chart: the app args read back by the app's own parsers (config_from_args,
server_options), refused combinations refused when the manifest is written (and by the chart's values schema), and the
chart rendering the generator's objects."""
from __future__ import annotations

import shlex

import pytest
import yaml

from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.deploy import manifests
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.serve.app import server_options
from saguaro_dist.serve.args import config_from_args
from saguaro_dist.serve.lora_modules import LoRAModule

FLAGS = ("--enable-lora --max-loras 2 --max-lora-rank 32 --served-model-name base --lora-modules a=/models/a "
         """'{"name": "b", "path": "org/b", "base_model_name": "base"}'""")
MODULES = (LoRAModule("a", "/models/a"), LoRAModule("b", "org/b", "base"))


def deploy(argv: str) -> list[dict]:
    return manifests(build_parser().parse_args(["deploy", "k8s", *shlex.split(argv)]))


def app_args(doc: dict) -> dict:
    config = doc if doc.get("kind") is None else yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    return app["args"]


@pytest.mark.parametrize("kind", ["rayservice", "serve-config"])
def test_lora_flags_reach_the_engine_and_the_server(kind, monkeypatch):
    monkeypatch.setenv("SAGUARO_API_KEY", "k")  # the pods' Secret: an app naming it refuses to start without it
    (doc,) = deploy(f"--kind {kind} {FLAGS}")
    args = app_args(doc)
    config = config_from_args(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 32)
    assert server_options(args, args["model"]).lora_modules == MODULES


def test_settings_take_modules_as_dicts_or_text_and_defaults_add_no_args():
    s = k8s.K8sSettings(enable_lora=True, lora_modules=[{"name": "a", "path": "/models/a"}, "c=/models/c"])
    assert s.lora_modules == (LoRAModule("a", "/models/a"), LoRAModule("c", "/models/c"))
    assert not {"enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras"} & set(
        app_args(k8s.rayservice(k8s.K8sSettings())))


@pytest.mark.parametrize("settings, message", [
    (dict(lora_modules=["a=/models/a"]), "need enable_lora"),
    (dict(enable_lora=True, lora_modules=["a=/m/a", "a=/m/b"]), "given twice"),
    (dict(enable_lora=True, served_model_name="m", lora_modules=["m=/m/a"]), "is a served model name"),
    (dict(enable_lora=True, lora_modules=[{"name": "a", "path": "/m/a", "base_model_name": "x"}]), "not a served model"),
    (dict(enable_lora=True, lora_modules=["nopath"]), "expected name=path"),
    (dict(enable_lora=True, max_lora_rank=12), "max_lora_rank must be one of"),
    (dict(enable_lora=True, max_loras=0), "max_loras must be"),
    (dict(enable_lora="yes"), "enable_lora must be true or false"),
])
def test_refused_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        k8s.K8sSettings(**settings)


def test_refused_flags(capsys):
    assert main(["deploy", "k8s", "--lora-modules", "a=/models/a"]) == 2
    assert "need enable_lora" in capsys.readouterr().err


# ---- the Helm chart ------------------------------------------------------------------------------

def test_chart_renders_the_generators_lora_args(monkeypatch):
    monkeypatch.setenv("SAGUARO_API_KEY", "k")  # the pods' Secret: an app naming it refuses to start without it
    from test_deploy_helm import by_kind, render  # needs helm-python-sdk (skips there without it)
    s = k8s.K8sSettings(enable_lora=True, max_loras=2, max_lora_rank=32, max_cpu_loras=3, served_model_name="base",
                        lora_modules=MODULES)
    values = k8s.helm_values(s)
    assert values["lora"] == {"enable": True, "maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 3, "modules": [
        {"name": "a", "path": "/models/a"}, {"name": "b", "path": "org/b", "base_model_name": "base"}]}
    rendered = by_kind(render(values))[("RayService", s.name)]
    assert validation.comparable(rendered) == validation.comparable(k8s.rayservice(s))
    assert server_options(app_args(rendered), s.model).lora_modules == MODULES


def test_chart_schema_refuses_bad_lora_values():
    helm = pytest.importorskip("helm_python")
    from test_deploy_helm import CHART
    for bad in ({"maxLoraRank": 12}, {"modules": [{"name": "a"}]}, {"enable": "yes"}, {"maxLoras": 0},
                {"maxCpuLoras": 0}):
        report = helm.lint(str(CHART), values={"lora": bad}, strict=True)
        assert report["errors"], bad
