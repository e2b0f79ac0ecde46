"""vLLM's speculative_config in the KubeRay deployment: K8sSettings, `saguaro deploy k8s` and the Helm chart refuse
one that contradicts a field given beside it, even a field given at its default's value (as `saguaro serve` and
LLM(...) do), and the chart's schema accepts exactly the keys speculative_config.py does."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

import saguaro_dist
from saguaro_dist.cli import build_parser
from saguaro_dist.cli.deploy import manifests
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.speculative_config import _INERT, SUPPORTED_KEYS

CHART = Path(saguaro_dist.__file__).resolve().parents[1] / "deploy" / "helm" / "saguaro-dist"  # the tree under test
DRAFT_SPEC = {"model": "org/draft", "num_speculative_tokens": 5}
NGRAM_SPEC = {"method": "ngram", "prompt_lookup_max": 4}
INERT_SPEC = {key: accepted[-1] for key, (accepted, _) in _INERT.items()}  # each inert key at a value it takes

# the defaults given explicitly beside a config that says otherwise: (K8sSettings fields, the message)
CONFLICTS = {
    "k-at-default": ({"k": 4, "speculative_config": DRAFT_SPEC}, "num_speculative_tokens=5 conflicts with k=4"),
    "mode-ssd-beside-ngram": ({"mode": "ssd", "speculative_config": NGRAM_SPEC}, "mode='ssd' was given"),
    "default-draft-beside-ngram": ({"draft": "Qwen/Qwen3-0.6B", "speculative_config": NGRAM_SPEC},
                                   "takes no draft model"),
    "default-draft-beside-another": ({"draft": "Qwen/Qwen3-0.6B", "speculative_config": DRAFT_SPEC},
                                     "model='org/draft' conflicts with draft='Qwen/Qwen3-0.6B'"),
}
# the same in the chart's values, and the words its message carries
CHART_CONFLICTS = {
    "k-at-default": ({"speculation": {"k": 4, "speculativeConfig": DRAFT_SPEC}},
                     "num_speculative_tokens=5 conflicts with speculation.k=4"),
    "mode-ssd-beside-ngram": ({"speculation": {"mode": "ssd", "speculativeConfig": NGRAM_SPEC}},
                              "runs speculation.mode ngram, but speculation.mode is ssd"),
    "default-draft-beside-ngram": ({"model": {"target": "t", "draft": "Qwen/Qwen3-0.6B"},
                                    "speculation": {"speculativeConfig": NGRAM_SPEC}}, "takes no draft model"),
    "default-draft-beside-another": ({"model": {"target": "t", "draft": "Qwen/Qwen3-0.6B"},
                                      "speculation": {"speculativeConfig": DRAFT_SPEC}},
                                     "model=org/draft conflicts with model.draft=Qwen/Qwen3-0.6B"),
}


def deploy(argv: str) -> list[dict]:
    return manifests(build_parser().parse_args(["deploy", "k8s", *shlex.split(argv)]))


# ---- K8sSettings and `saguaro deploy k8s` --------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CONFLICTS))
def test_settings_refuse_a_config_contradicting_a_field_given_at_its_default(case):
    kwargs, message = CONFLICTS[case]
    with pytest.raises(ValueError, match=message):
        k8s.K8sSettings(**kwargs)


def test_settings_let_the_config_set_the_fields_left_out():
    s = k8s.K8sSettings(speculative_config=DRAFT_SPEC)
    assert (s.draft, s.k, s.mode) == ("org/draft", 5, "ssd")
    s = k8s.K8sSettings(speculative_config=NGRAM_SPEC, k=4)  # k given, the config names none: no conflict
    assert (s.mode, s.k, s.prompt_lookup_max, s.prompt_lookup_min) == ("ngram", 4, 4, 4)
    assert k8s.K8sSettings() == k8s.K8sSettings(draft="Qwen/Qwen3-0.6B", mode="ssd", k=4)  # defaults as before


@pytest.mark.parametrize("argv, message", [
    (f"--k 4 --speculative-config '{json.dumps(DRAFT_SPEC)}'", "conflicts with k=4"),
    (f"--mode ssd --speculative-config '{json.dumps(NGRAM_SPEC)}'", "mode='ssd' was given"),
    (f"--draft Qwen/Qwen3-0.6B --speculative-config '{json.dumps(NGRAM_SPEC)}'", "takes no draft model"),
    (f"--draft '' --speculative-config '{json.dumps(DRAFT_SPEC)}'", "conflicts with draft=''"),
])
def test_cli_refuses_a_config_contradicting_a_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        deploy(argv)


def test_cli_takes_a_config_agreeing_with_the_flags_beside_it():
    (doc,) = deploy(f"--kind serve-config --k 5 --mode sd --speculative-config '{json.dumps(DRAFT_SPEC)}'")
    args = doc["applications"][0]["args"]
    assert (args["draft"], args["k"], args["mode"], args["speculative_config"]) == ("org/draft", 5, "sd", DRAFT_SPEC)


def test_settings_take_vllms_inert_keys():
    assert k8s.K8sSettings(speculative_config={**DRAFT_SPEC, **INERT_SPEC}).speculative_config == {**DRAFT_SPEC,
                                                                                                   **INERT_SPEC}


# ---- the chart ----------------------------------------------------------------------------------

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")


def render_rayservice(values: dict | None) -> dict:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="saguaro", namespace="default")
    docs = [doc for path, text in files.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]
    (rayservice,) = [doc for doc in docs if doc["kind"] == "RayService"]
    return rayservice


@pytest.mark.parametrize("case", sorted(CHART_CONFLICTS))
def test_chart_refuses_a_config_contradicting_a_value_given_at_its_default(case):
    values, message = CHART_CONFLICTS[case]
    with pytest.raises(Exception, match=message):
        render_rayservice(values)


@pytest.mark.parametrize("spec", [{**DRAFT_SPEC, **INERT_SPEC}, {**NGRAM_SPEC, **INERT_SPEC},
                                  {"model": "org/draft", "prompt_lookup_min": 5}])
def test_chart_renders_what_the_generator_does_for_a_config(spec):
    """vLLM's inert keys pass the schema as they pass K8sSettings; a lookup size alone stands for both."""
    settings = k8s.K8sSettings(name="saguaro", speculative_config=spec)
    generated = validation.comparable(k8s.rayservice(settings))
    assert validation.comparable(render_rayservice({"speculation": {"speculativeConfig": spec}})) == generated
    assert validation.comparable(render_rayservice(k8s.helm_values(settings))) == generated


def test_chart_schema_accepts_exactly_the_keys_speculative_config_accepts():
    """The schema's speculativeConfig is speculative_config.py's SUPPORTED_KEYS and _INERT, each inert key at
    the values it takes only: they cannot drift apart."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    spec = schema["properties"]["speculation"]["properties"]["speculativeConfig"]
    assert spec["additionalProperties"] is False
    assert set(spec["properties"]) == {*SUPPORTED_KEYS, *_INERT}
    for key, (accepted, _) in _INERT.items():
        assert sorted(map(json.dumps, spec["properties"][key]["enum"])) == sorted(map(json.dumps, accepted)), key


@pytest.mark.parametrize("key", sorted(_INERT))
def test_chart_schema_refuses_an_inert_key_at_another_value(key):
    accepted = _INERT[key][0]
    other = "other" if None in accepted or False in accepted else None
    report = helm.lint(str(CHART), values={"speculation": {"speculativeConfig": {"model": "d", key: other}}},
                       strict=True)
    assert any(key in error for error in report["errors"]), report


def test_settings_under_an_ngram_config_name_no_draft_and_rebuild_from_their_fields():
    """The default draft is no part of an ngram deployment: None, so replace() (which passes every field as
    given) does not meet a draft beside the ngram config."""
    import dataclasses
    s = k8s.K8sSettings(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert (s.mode, s.draft, s.draft_revision) == ("ngram", None, None)
    assert dataclasses.replace(s, name="other").mode == "ngram"
