"""`saguaro serve`'s HTTP-frontend and speculation flags in the KubeRay manifests (`saguaro deploy k8s`) and the
Helm chart: --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials, --root-path,
--disable-fastapi-docs, --response-role, several --served-model-name, --proposal-top-k, --prompt-lookup-max / -min and
--speculative-config. Same names as `saguaro serve`, checked when the manifest is written, read back by the
app's own parsers (config_from_args, server_options), valid against the KubeRay CRDs, and rendered the same by
the chart (test_deploy_helm's SETTINGS hold them too)."""
from __future__ import annotations

import json
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
FRONTEND_FLAGS = ("--allowed-origins '[\"https://a.example\", \"https://b.example\"]' --allowed-methods '[\"GET\", \"POST\"]' "
                  "--allowed-headers '[\"Authorization\"]' --allow-credentials --root-path /llm --disable-fastapi-docs --response-role bot")
FRONTEND = {"allowed_origins": ("https://a.example", "https://b.example"), "allowed_methods": ("GET", "POST"),
            "allowed_headers": ("Authorization",), "allow_credentials": True, "root_path": "/llm",
            "disable_fastapi_docs": True, "response_role": "bot"}
NGRAM_SPEC = {"method": "ngram", "prompt_lookup_min": 2}
DRAFT_SPEC = {"model": "Qwen/Qwen3-0.6B-Base", "num_speculative_tokens": 6, "revision": "v1"}
NEW_ARGS = {*FRONTEND, "proposal_top_k", "prompt_lookup_max", "prompt_lookup_min", "speculative_config"}
# settings the chart must render as the generator does
CHART_SETTINGS = {
    "frontend": k8s.K8sSettings(**FRONTEND, served_model_name=("qwen", "qwen-latest")),
    "speculation-flags": k8s.K8sSettings(proposal_top_k=8, prompt_lookup_max=5, prompt_lookup_min=2),
    "speculative-config-ngram": k8s.K8sSettings(speculative_config=NGRAM_SPEC),
    "speculative-config-draft": k8s.K8sSettings(speculative_config=DRAFT_SPEC, mode="sd", gpu=True),
}


@pytest.fixture(scope="module")
def crds() -> Path:
    if not (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (the shared/kuberay-crds folder beside the repo)")
    return CRD_DIR


def deploy(argv: str) -> list[dict]:
    return manifests(build_parser().parse_args(["deploy", "k8s", *shlex.split(argv)]))


def app_args(doc: dict) -> dict:
    config = doc if doc.get("kind") is None else yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    return app["args"]


def worker_groups(rayservice: dict) -> list[str]:
    return [g["groupName"] for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]]


# ---- the generator ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["rayservice", "serve-config"])
def test_frontend_flags_reach_the_apps_server_options(kind, monkeypatch):
    monkeypatch.setenv("SAGUARO_API_KEY", "k")  # the pods' Secret: an app naming it refuses to start without it
    (doc,) = deploy(f"--kind {kind} {FRONTEND_FLAGS} --served-model-name qwen qwen-latest")
    args = app_args(doc)
    options = server_options(args, args["model"])
    assert {name: getattr(options.frontend, name) for name in FRONTEND if name != "response_role"} == {
        name: value for name, value in FRONTEND.items() if name != "response_role"}
    assert options.response_role == FRONTEND["response_role"]
    assert (options.served_model_name, options.model_aliases) == ("qwen", ("qwen-latest",))


def test_speculation_flags_reach_the_engine_config():
    (doc,) = deploy("--proposal-top-k 8 --prompt-lookup-max 5 --prompt-lookup-min 2")
    config = config_from_args(app_args(doc))
    assert (config.proposal_top_k, config.prompt_lookup_max, config.prompt_lookup_min) == (8, 5, 2)


def test_ngram_speculative_config_runs_no_draft_pods():
    """The config decides the mode, so the cluster's shape follows it: no draft group, no draft args."""
    (doc,) = deploy(f"--speculative-config '{json.dumps(NGRAM_SPEC)}'")
    args = app_args(doc)
    assert worker_groups(doc) == ["target"] and "draft" not in args
    assert args["speculative_config"] == NGRAM_SPEC
    config = config_from_args(args)
    assert (config.mode.value, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 2, 2)


def test_draft_speculative_config_names_the_draft_and_k():
    (doc,) = deploy(f"--mode sd --speculative-config '{json.dumps(DRAFT_SPEC)}'")
    args = app_args(doc)
    assert worker_groups(doc) == ["target", "draft"]
    assert (args["draft"], args["k"], args["draft_revision"]) == ("Qwen/Qwen3-0.6B-Base", 6, "v1")
    config = config_from_args(args)
    assert (config.mode.value, config.draft, config.k, config.draft_revision) == ("sd", "Qwen/Qwen3-0.6B-Base", 6, "v1")


def test_defaults_add_no_args():
    """Left out, the app's defaults hold and the manifest names none of them (unchanged manifests); one served
    model name stays a string, as before."""
    assert NEW_ARGS.isdisjoint(k8s.serve_args(k8s.K8sSettings()))
    assert NEW_ARGS.isdisjoint(app_args(deploy("")[0]))
    assert app_args(deploy("--proposal-top-k 0")[0]) == app_args(deploy("")[0])
    assert app_args(deploy("--served-model-name t")[0])["served_model_name"] == "t"
    assert k8s.K8sSettings(served_model_name=["t"]) == k8s.K8sSettings(served_model_name="t")
    assert k8s.K8sSettings(root_path="", allowed_origins=None) == k8s.K8sSettings()


def test_root_path_changes_no_probe():
    """KubeRay's probes (written out) hit the raylet, the GCS and Serve's proxy (/-/healthz), which answer
    outside the app: a root path changes the app args only, never the cluster."""
    plain, prefixed = k8s.K8sSettings(), k8s.K8sSettings(root_path="/llm")
    assert k8s.ray_cluster_spec(prefixed, serving=True) == k8s.ray_cluster_spec(plain, serving=True)
    assert k8s.serve_config(prefixed)["applications"][0]["route_prefix"] == "/"


def test_manifests_pass_the_crd_and_app_checks(crds):
    argv = f"{FRONTEND_FLAGS} --served-model-name a b --proposal-top-k 4 --prompt-lookup-max 4"
    for doc in deploy(argv) + deploy(f"--kind raycluster {argv}") + deploy(
            f"--speculative-config '{json.dumps(NGRAM_SPEC)}'") + deploy(f"--speculative-config '{json.dumps(DRAFT_SPEC)}'"):
        validation.validate_object(doc, crds)


def test_validate_serve_config_accepts_the_generated_config():
    settings = k8s.K8sSettings(**FRONTEND, speculative_config=DRAFT_SPEC, served_model_name=("a", "b"))
    (args,) = validation.validate_serve_config(k8s.to_yaml([k8s.serve_config(settings)]))
    assert args["speculative_config"] == DRAFT_SPEC and args["root_path"] == "/llm"


@pytest.mark.parametrize("argv, message", [
    ("--root-path llm", "root_path must start with '/'"),
    ("--root-path /llm/", "root_path must start with '/'"),
    ("--served-model-name a ''", "served_model_name must be a non-empty name"),
    ("--proposal-top-k -1", "proposal_top_k must be an integer >= 0"),
    ("--prompt-lookup-min 4 --prompt-lookup-max 2", "1 <= min <= max"),
    ("--speculative-config nope", "speculative_config must be a JSON object"),
    ("--speculative-config '[1]'", "speculative_config must be an object"),
    ("--speculative-config '{\"method\": \"eagle\"}'", "method 'eagle' is not supported"),
    ("--speculative-config '{\"model\": \"d\", \"num_speculative_tokens\": 4}' --k 6", "conflicts with k=6"),
    ("--mode ssd --speculative-config '{\"method\": \"ngram\"}'", "mode='ssd' was given"),
    ("--mode ar --speculative-config '{\"model\": \"d\"}'", "mode='ar' was given"),
    ("--speculative-config '{\"method\": \"ngram\"}' --proposal-top-k 4", "--proposal-top-k applies only to --mode sd / ssd"),
])
def test_bad_values_fail_when_the_manifest_is_written(argv, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        deploy(argv)


@pytest.mark.parametrize("argv", ["--allowed-origins '*'", "--allowed-headers '[1]'"])
def test_cors_lists_must_be_json_lists(argv, capsys):
    with pytest.raises(SystemExit):
        deploy(argv)
    assert "must be a" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("allow_credentials", "yes"), ("disable_fastapi_docs", 1),
                                          ("allowed_origins", "*"), ("allowed_methods", [""]), ("root_path", 5), ("response_role", "  "),
                                          ("proposal_top_k", 2.0), ("prompt_lookup_max", True),
                                          ("speculative_config", {"quantization": "fp8"})])
def test_settings_refuse_values_the_app_would_read_otherwise(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0] if field == "speculative_config" else field):
        k8s.K8sSettings(**{field: value})


# ---- the chart ----------------------------------------------------------------------------------

helm = pytest.importorskip("helm_python", reason="Helm chart tests: pip install helm-python-sdk==0.2.2 (test extra)")
from test_deploy_serve_flags import render_rayservice  # noqa: E402 (after the skip: it needs helm_python too)


def test_chart_defaults_add_no_args():
    assert NEW_ARGS.isdisjoint(app_args(render_rayservice(None)))


@pytest.mark.parametrize("name", sorted(CHART_SETTINGS))
def test_chart_renders_the_generators_objects(name, crds):
    settings = CHART_SETTINGS[name]
    rendered = render_rayservice(k8s.helm_values(settings))
    assert validation.comparable(rendered) == validation.comparable(k8s.rayservice(settings))
    validation.validate_object(rendered, crds)


@pytest.mark.parametrize("spec", [NGRAM_SPEC, DRAFT_SPEC, {"model": "ngram", "prompt_lookup_max": 4}])
def test_chart_speculative_config_alone_sets_what_the_generator_does(spec):
    """A chart user gives only speculation.speculativeConfig: the chart derives the mode, the draft pods, k and
    the lookup sizes from it, as K8sSettings does."""
    rendered = render_rayservice({"speculation": {"speculativeConfig": spec}})
    generated = k8s.rayservice(k8s.K8sSettings(name="saguaro", speculative_config=spec))
    assert validation.comparable(rendered) == validation.comparable(generated)


def test_chart_refuses_a_mode_the_speculative_config_cannot_run():
    with pytest.raises(Exception, match="speculation.mode sd or ssd"):
        render_rayservice({"speculation": {"mode": "ar", "speculativeConfig": DRAFT_SPEC}})


@pytest.mark.parametrize("values, field", [
    ({"server": {"rootPath": "llm"}}, "rootPath"),
    ({"server": {"rootPath": "/llm/"}}, "rootPath"),
    ({"server": {"allowedOrigins": "*"}}, "allowedOrigins"),
    ({"server": {"allowedHeaders": [""]}}, "allowedHeaders"),
    ({"server": {"allowCredentials": "yes"}}, "allowCredentials"),
    ({"server": {"disableFastapiDocs": 1}}, "disableFastapiDocs"),
    ({"server": {"responseRole": "  "}}, "responseRole"),
    ({"model": {"target": "t", "servedModelName": []}}, "servedModelName"),
    ({"speculation": {"proposalTopK": -1}}, "proposalTopK"),
    ({"speculation": {"promptLookupMax": 0}}, "promptLookupMax"),
    ({"speculation": {"speculativeConfig": {"method": "eagle"}}}, "method"),
    ({"speculation": {"speculativeConfig": {"quantization": "fp8"}}}, "speculativeConfig"),
    ({"speculation": {"speculativeConfig": {"num_speculative_tokens": 0}}}, "num_speculative_tokens"),
])
def test_chart_schema_refuses_bad_values(values, field):
    report = helm.lint(str(CHART), values=values, strict=True)
    assert any(field in error for error in report["errors"]), report


def test_an_empty_draft_alone_deploys_autoregressively():
    """`--draft ""` means no draft model; without --mode it failed on the default mode ssd."""
    (doc,) = deploy('--kind serve-config --draft ""')
    assert config_from_args(app_args(doc)).mode.value == "ar"


def test_vllms_enable_auto_tool_choice_is_accepted_beside_a_tool_call_parser_only():
    with_flag = deploy("--kind serve-config --tool-call-parser hermes --enable-auto-tool-choice")
    assert with_flag == deploy("--kind serve-config --tool-call-parser hermes")  # it changes nothing here
    with pytest.raises(ValueError, match="--enable-auto-tool-choice only applies with --tool-call-parser"):
        deploy("--enable-auto-tool-choice")
