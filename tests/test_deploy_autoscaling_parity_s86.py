"""The generator (K8sSettings, `saguaro deploy k8s`) agrees with the Helm chart on the draft pool: the engine starts
num_draft_workers draft workers once and never asks Ray for more, so no autoscaler adds a draft pod. The chart
refuses autoscaling.enabled / a draftMaxWorkers other than draft.workers and writes min = max groups
(tests/test_chart_autoscaling_s86.py); the old generator still wrote enableInTreeAutoscaling, autoscalerOptions and
maxReplicas up to draft_max_workers, and the cluster launcher's draft type could grow to 4 nodes."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import build_parser, main
from saguaro_dist.deploy import k8s

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "saguaro-dist"
# the chart's reason, its option spelled draft.workers (saguaro.checkAutoscaling in templates/_helpers.tpl)
CHART_REASON = ("the engine runs a fixed pool: draft.workers ({n}) draft workers, started once, and one target pod; "
                "it never asks Ray for more, so Ray's autoscaler would add no pod. Set draft.workers to the draft "
                "pool you want")


def render_rayservice(values: dict) -> dict:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="saguaro", namespace="default")
    (doc,) = [d for d in yaml.safe_load_all(files["saguaro-dist/templates/rayservice.yaml"]) if d]
    return doc


def sizing(rayservice: dict) -> dict:
    """What decides the pods: each group's replica bounds, and whether an autoscaler runs."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for g in cluster["workerGroupSpecs"]}
    return {"groups": groups, "autoscaler": (cluster["enableInTreeAutoscaling"], cluster.get("autoscalerOptions"))}


# (settings, the chart's autoscaling values for them, what each refuses: the generator's field, the chart's value)
CASES = {
    "left-out": (dict(draft_workers=2), {}, None),
    "max-repeats-workers": (dict(draft_workers=3, draft_max_workers=3), {"draftMaxWorkers": 3}, None),
    "enabled": (dict(draft_workers=2, autoscaling=True), {"enabled": True}, ("autoscaling", "autoscaling.enabled")),
    "max-above-workers": (dict(draft_workers=2, draft_max_workers=4), {"draftMaxWorkers": 4},
                          ("draft_max_workers 4", "autoscaling.draftMaxWorkers 4")),
    "max-below-workers": (dict(draft_workers=3, draft_max_workers=2), {"draftMaxWorkers": 2},
                          ("draft_max_workers 2", "autoscaling.draftMaxWorkers 2")),
    "enabled-and-max": (dict(draft_workers=2, autoscaling=True, draft_max_workers=4),
                        {"enabled": True, "draftMaxWorkers": 4}, ("autoscaling", "autoscaling.enabled")),
}


@pytest.mark.parametrize("key", CASES)
def test_generator_and_chart_refuse_the_same_autoscaling_for_the_same_reason(key):
    settings, autoscaling, refused = CASES[key]
    values = {**k8s.helm_values(k8s.K8sSettings(draft_workers=settings["draft_workers"])), "autoscaling": autoscaling}
    if refused is None:
        s = k8s.K8sSettings(**settings)
        assert sizing(render_rayservice(values)) == sizing(k8s.rayservice(s))
        return
    field, value = refused
    with pytest.raises(ValueError) as generator:
        k8s.K8sSettings(**settings)
    with pytest.raises(helm.errors.HelmRenderError) as chart:
        render_rayservice(values)
    reason = CHART_REASON.format(n=settings["draft_workers"])
    assert f"{value} is not supported: {reason}" in str(chart.value)
    assert f"{field} is not supported: {reason.replace('draft.workers', 'draft_workers')}" in str(generator.value)


@pytest.mark.parametrize("seconds", [0, 120])
def test_generator_and_chart_refuse_an_idle_timeout_in_the_same_words(seconds):
    """No pod is ever added, so none idles: any idle timeout set is refused, 0 included (the old chart took one
    and used it nowhere, and its schema refused 0 without the reason)."""
    values = {**k8s.helm_values(k8s.K8sSettings(draft_workers=2)), "autoscaling": {"idleTimeoutSeconds": seconds}}
    with pytest.raises(ValueError) as generator:
        k8s.K8sSettings(draft_workers=2, idle_timeout_s=seconds)
    with pytest.raises(helm.errors.HelmRenderError) as chart:
        render_rayservice(values)
    refusal = "is not supported (no pod is ever added, so none idles): " + CHART_REASON.format(n=2)
    assert f"autoscaling.idleTimeoutSeconds {refusal}" in str(chart.value)
    assert f"idle_timeout_s {refusal.replace('draft.workers', 'draft_workers')}" in str(generator.value)


@pytest.mark.parametrize("settings", [k8s.K8sSettings(), k8s.K8sSettings(gpu=True, tp=2, draft_workers=4),
                                      k8s.K8sSettings(draft_workers=2, draft_max_workers=2),
                                      k8s.K8sSettings(mode="ar", draft=None)],
                         ids=["default", "gpu-4-drafts", "max-repeats-workers", "ar-no-draft"])
def test_generated_groups_are_sized_as_the_charts(settings):
    """min = max = the pool the engine starts, no autoscaler: as the chart renders the same settings."""
    generated = sizing(k8s.rayservice(settings))
    assert generated == sizing(render_rayservice(k8s.helm_values(settings)))
    assert generated["autoscaler"] == (False, None)
    drafts = settings.draft_workers if settings.uses_draft else None
    assert generated["groups"].get("draft", (drafts,) * 3) == (drafts,) * 3
    raycluster = k8s.raycluster(settings)["spec"]
    assert raycluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in raycluster


@pytest.mark.parametrize("argv, refused", [
    (["--autoscaling"], "--autoscaling is not supported"),
    (["--draft-workers", "2", "--draft-max-workers", "4"], "--draft-max-workers 4 is not supported"),
    (["--idle-timeout-s", "120"], "--idle-timeout-s is not supported"),
    (["--autoscaling", "--draft-max-workers", "4", "--idle-timeout-s", "120"], "--autoscaling is not supported"),
])
def test_the_cli_refuses_autoscaling_flags_naming_the_flag_to_use(argv, refused, capsys):
    assert main(["deploy", "k8s", *argv]) == 2
    err = capsys.readouterr().err
    assert refused in err and "Set --draft-workers to the draft pool you want" in err


def test_the_cli_takes_a_draft_max_workers_that_repeats_draft_workers(capsys):
    assert main(["deploy", "k8s", "--draft-workers", "3", "--draft-max-workers", "3"]) == 0
    (doc,) = yaml.safe_load_all(capsys.readouterr().out)
    assert sizing(doc)["groups"]["draft"] == (3, 3, 3)


def test_the_cluster_launchers_draft_pool_is_the_serve_configs():
    """`ray up`: the launcher's autoscaler starts the draft nodes the engine's draft workers need, and the pool
    never grows, so the draft type's max_workers is its min_workers, the serve config's --draft-workers."""
    text = (ROOT / "deploy" / "cluster-launcher.yaml").read_text()
    launcher = yaml.safe_load(text)
    command = next(line for line in text.splitlines() if "saguaro deploy k8s" in line)
    words = [w for w in shlex.split(command.lstrip("# ").split(">")[0])[1:] if w != "..."]  # (its elisions)
    args = build_parser().parse_args(words)
    types = launcher["available_node_types"]
    assert types["draft"]["min_workers"] == types["draft"]["max_workers"] == args.draft_workers
    assert types["target"]["min_workers"] == types["target"]["max_workers"] == 1
    assert launcher["max_workers"] == sum(t.get("max_workers", 0) for name, t in types.items() if name != "head")
    assert "grows the draft pool" not in text
