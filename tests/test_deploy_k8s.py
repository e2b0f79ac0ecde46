"""The manifest generator (`saguaro deploy k8s`) and the shipped KubeRay manifests, validated offline:
KubeRay v1.7 CRD schemas (strict), Kubernetes schemas for built-in kinds, prometheus-operator's for the
ServiceMonitor, Ray's ServeDeploySchema for serveConfigV2, and the engine Config for the app args."""
from __future__ import annotations

import importlib
import json
import shlex
from pathlib import Path

import pytest
import yaml

from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.deploy import manifests
from saguaro_dist.config import Config, Mode
from saguaro_dist.deploy import k8s, validation
from saguaro_dist.placement import DRAFT_RESOURCE, FRONT_RESOURCE, RESOURCE_PER_ACTOR, TARGET_RESOURCE
from saguaro_dist.serve.args import API_KEY_ENV, config_from_args

ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds"
SHIPPED = sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))

SETTINGS = {
    "cpu-default": k8s.K8sSettings(),
    "gpu-tp4": k8s.K8sSettings(tp=4, draft_workers=3, gpu_type="NVIDIA-H100-80GB-HBM3", models_pvc="weights",
                               model="/models/target", draft="/models/draft", served_model_name="t"),
    # (draft_max_workers may only repeat draft_workers: the pool is fixed, tests/test_deploy_autoscaling_parity_s86.py)
    "fanout-list": k8s.K8sSettings(gpu=True, k=3, fan_out=(4, 3, 2, 1), draft_workers=5, draft_max_workers=5,
                                   mode="sd", fallback="fast", dtype="float16"),
    "ar-no-draft": k8s.K8sSettings(mode="ar", draft=None, name="plain"),
    "ngram-default-draft-unused": k8s.K8sSettings(mode="ngram", name="lookup"),
}


@pytest.fixture(scope="module")
def crds() -> Path:
    if not (CRD_DIR / "ray.io_rayservices.yaml").is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (the shared/kuberay-crds folder beside the repo)")
    return CRD_DIR


def all_objects(s: k8s.K8sSettings) -> list[dict]:
    return [k8s.rayservice(s), k8s.raycluster(s), k8s.metrics_service(s)]


def needs_monitoring_models():
    pytest.importorskip("cloudcoil.models.prometheus_operator",
                        reason="ServiceMonitor schema: pip install cloudcoil-models-prometheus-operator (test extra)")


def validate(obj: dict, crds: Path) -> None:
    if obj["kind"] == "ServiceMonitor":
        needs_monitoring_models()
    validation.validate_object(obj, crds)


def group(obj: dict, name: str) -> dict:
    cluster = obj["spec"].get("rayClusterConfig", obj["spec"])
    return next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == name)


def advertised(worker_group: dict) -> dict:
    """The custom resources a worker group's `ray start --resources` gets (undo KubeRay's quoting)."""
    return json.loads(json.loads(worker_group["rayStartParams"]["resources"]))


def shipped_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# ---- schemas ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key", SETTINGS)
def test_generated_objects_validate(crds, key):
    for obj in all_objects(SETTINGS[key]):
        validation.validate_object(obj, crds)


@pytest.mark.parametrize("key", SETTINGS)
def test_generated_service_monitor_validates(key):
    needs_monitoring_models()
    validation.validate_service_monitor(k8s.service_monitor(SETTINGS[key]))


@pytest.mark.parametrize("key", SETTINGS)
def test_embedded_serve_service_is_a_valid_service(key):
    service = k8s.rayservice(SETTINGS[key])["spec"]["serveService"]
    validation.validate_builtin({"apiVersion": "v1", "kind": "Service", **service})
    assert service["spec"]["ports"][0]["port"] == k8s.SERVE_PORT == 8000


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_manifests_validate(crds, path):
    docs = shipped_docs(path)
    assert docs, f"{path} holds no object"
    for obj in docs:
        validate(obj, crds)


def test_strict_validation_catches_typos_and_types(crds):
    """The checks are real: a misspelt field or a wrong type fails (KubeRay would drop or reject it)."""
    import jsonschema

    obj = k8s.rayservice(k8s.K8sSettings())
    group(obj, "draft")["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        validation.validate_object(obj, crds)
    obj = k8s.rayservice(k8s.K8sSettings())
    obj["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        validation.validate_object(obj, crds)


def test_service_monitor_validation_is_real():
    needs_monitoring_models()
    monitor = k8s.service_monitor(k8s.K8sSettings())
    monitor["spec"]["endpoints"][0]["interval"] = "half a minute"
    with pytest.raises(Exception, match="interval"):
        validation.validate_service_monitor(monitor)
    monitor = k8s.service_monitor(k8s.K8sSettings())
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(ValueError, match="does not know"):
        validation.validate_service_monitor(monitor)


# ---- the Serve app -----------------------------------------------------------------------------

@pytest.mark.parametrize("key", SETTINGS)
def test_serve_config_parses_and_builds_the_engine_config(key):
    s = SETTINGS[key]
    (args,) = validation.validate_serve_config(k8s.rayservice(s)["spec"]["serveConfigV2"])
    config = config_from_args(args)
    assert isinstance(config, Config)
    assert (config.tensor_parallel_size, config.num_draft_workers, config.k) == (s.tp, s.draft_workers, s.k)
    assert config.device == ("cuda" if s.gpu else "cpu") and config.model == s.model
    assert args["api_key_env"] == API_KEY_ENV


def test_serve_app_import_path_imports_and_builds(monkeypatch):
    monkeypatch.setenv("SAGUARO_API_KEY", "k")  # the pods' Secret: an app naming it refuses to start without it
    module_name, attribute = k8s.APP_IMPORT_PATH.split(":")
    builder = getattr(importlib.import_module(module_name), attribute)
    from ray.serve import Application

    (args,) = validation.validate_serve_config(k8s.rayservice(SETTINGS["gpu-tp4"])["spec"]["serveConfigV2"])
    assert isinstance(builder(args), Application)  # binds the deployment; starts nothing


def test_api_key_comes_from_the_secret():
    s = k8s.K8sSettings(api_key_secret="my-key", api_key_secret_key="k")
    for obj in (k8s.rayservice(s), k8s.raycluster(s)):
        cluster = obj["spec"].get("rayClusterConfig", obj["spec"])
        pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
        for pod in pods:
            env = {e["name"]: e for e in pod["template"]["spec"]["containers"][0]["env"]}
            assert env[API_KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": "my-key", "key": "k"}


# ---- placement ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key", SETTINGS)
def test_worker_groups_advertise_what_placement_asks_for(key):
    """Each target rank asks for RESOURCE_PER_ACTOR of TARGET_RESOURCE, each draft worker for
    RESOURCE_PER_ACTOR of DRAFT_RESOURCE: the one target pod holds all tp ranks, a draft pod one worker."""
    s = SETTINGS[key]
    for obj in (k8s.rayservice(s), k8s.raycluster(s)):
        target = group(obj, "target")
        assert advertised(target) == {TARGET_RESOURCE: s.tp * RESOURCE_PER_ACTOR, FRONT_RESOURCE: RESOURCE_PER_ACTOR}
        assert target["replicas"] == 1  # (FRONT_RESOURCE: the Serve replica's slot, tests/test_deploy_review_s88.py)
        gpus = target["template"]["spec"]["containers"][0]["resources"]["limits"].get(k8s.GPU_RESOURCE, 0)
        assert gpus == (s.tp if s.gpu else 0)
        if not s.uses_draft:  # ar, ngram: no draft pods to pay for
            assert [g["groupName"] for g in obj["spec"].get("rayClusterConfig", obj["spec"])["workerGroupSpecs"]] == ["target"]
            continue
        draft = group(obj, "draft")
        assert advertised(draft) == {DRAFT_RESOURCE: RESOURCE_PER_ACTOR}
        assert draft["replicas"] == draft["minReplicas"] == draft["maxReplicas"] == s.draft_workers


def test_head_runs_no_work():
    head = k8s.rayservice(k8s.K8sSettings())["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "resources" not in head["rayStartParams"]


def test_launcher_node_types_advertise_what_placement_asks_for():
    launcher = yaml.safe_load((ROOT / "deploy" / "cluster-launcher.yaml").read_text())
    types = launcher["available_node_types"]
    target, draft = types["target"]["resources"], types["draft"]["resources"]
    assert target[TARGET_RESOURCE] == target["GPU"] * RESOURCE_PER_ACTOR  # one rank per GPU
    assert draft[DRAFT_RESOURCE] == RESOURCE_PER_ACTOR and draft["GPU"] == 1
    assert not {TARGET_RESOURCE, DRAFT_RESOURCE} & set(types["head"]["resources"])


def test_cluster_launcher_passes_rays_own_validation():
    """What `ray up` does before launching: fill the provider's defaults, then check Ray's schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    launcher = yaml.safe_load((ROOT / "deploy" / "cluster-launcher.yaml").read_text())
    validate_config(prepare_config(launcher))


# ---- the CLI and the shipped files ---------------------------------------------------------------

def generator_command(path: Path) -> list[str]:
    line = next(l for l in path.read_text().splitlines() if l.startswith("# saguaro deploy k8s"))
    return shlex.split(line[2:])[1:]


@pytest.mark.parametrize("name", ["rayservice.yaml", "raycluster.yaml"])
def test_shipped_manifests_are_the_generators_output(name):
    path = ROOT / "deploy" / "kuberay" / name
    args = build_parser().parse_args(generator_command(path))
    assert shipped_docs(path) == manifests(args), f"regenerate {path} with the command in its header"


def test_cli_writes_the_rayservice(capsys):
    argv = ["deploy", "k8s", "--model", "m", "--draft", "d", "--mode", "ssd", "--k", "3", "--fan-out", "8",
            "--tp", "2", "--draft-workers", "3", "--image", "reg.io:5000/saguaro:1", "--gpu-type", "A100",
            "--api-key-secret", "key"]
    assert main(argv) == 0
    (doc,) = list(yaml.safe_load_all(capsys.readouterr().out))
    expected = k8s.K8sSettings(model="m", draft="d", k=3, fan_out=8, tp=2, draft_workers=3,
                               image="reg.io:5000/saguaro:1", gpu_type="A100", api_key_secret="key")
    assert doc == k8s.rayservice(expected)
    assert "serveConfigV2: |" in k8s.to_yaml([doc])  # readable block, not an escaped one-liner


def test_cli_serve_config_and_fan_out_list(capsys):
    assert main(["deploy", "k8s", "--kind", "serve-config", "--k", "2", "--fan-out", "3,2,1"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["applications"][0]["args"]["fan_out"] == [3, 2, 1]
    assert config_from_args(config["applications"][0]["args"]).mode is Mode.SSD


def test_cli_puts_the_chat_template_text_and_generation_config_in_the_app_args(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SAGUARO_API_KEY", "k")  # the pods' Secret: an app naming it refuses to start without it
    from saguaro_dist.serve.app import server_options
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    argv = ["deploy", "k8s", "--kind", "serve-config", "--chat-template", str(tmp_path / "chat.jinja"),
            "--generation-config", "vllm"]
    assert main(argv) == 0
    args = yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"]
    assert args["chat_template"] == template  # the text: the pods need not have the file
    assert config_from_args(args).generation_config == "vllm" and server_options(args, "m").chat_template == template
    assert main(["deploy", "k8s", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


def test_cli_pins_hub_revisions_in_the_app_args(capsys):
    assert main(["deploy", "k8s", "--kind", "serve-config", "--revision", "v2.0", "--draft-revision", "0123abc"]) == 0
    config = config_from_args(yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"])
    assert (config.revision, config.draft_revision) == ("v2.0", "0123abc")


def test_a_batch_job_runs_run_batch_against_the_rayservice(capsys):
    assert main(["deploy", "k8s", "--kind", "batch-job", "--name", "qwen", "--batch-pvc", "data",
                 "--batch-input", "in/q.jsonl", "--batch-output", "out/r.jsonl"]) == 0
    (job,) = list(yaml.safe_load_all(capsys.readouterr().out))
    validation.validate_builtin(job)  # Kubernetes' own schema, strict
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    service = k8s.serve_service(k8s.K8sSettings(name="qwen"))["metadata"]["name"]
    assert container["command"] == ["saguaro", "run-batch", "-i", "/data/in/q.jsonl", "-o", "/data/out/r.jsonl",
                                    "--url", f"http://{service}:{k8s.SERVE_PORT}"]
    assert container["env"][0]["name"] == API_KEY_ENV and pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "data"
    selector = k8s.metrics_service(k8s.K8sSettings(name="qwen"))["spec"]["selector"]
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()  # nothing to scrape there
    ns = build_parser().parse_args(container["command"][1:])  # the command the Job runs takes these flags
    assert (ns.command, ns.url, ns.input_file) == ("run-batch", f"http://{service}:{k8s.SERVE_PORT}", "/data/in/q.jsonl")


@pytest.mark.parametrize("argv, message", [
    (["--kind", "batch-job"], "needs --batch-pvc"),
    (["--kind", "batch-job", "--batch-pvc", "d", "--batch-input", "/etc/passwd"], "must be a path inside the PVC"),
    (["--kind", "batch-job", "--batch-pvc", "d", "--batch-output", "../x.jsonl"], "must be a path inside the PVC"),
    (["--mode", "sd", "--draft", ""], "needs a draft model"),
    (["--k", "4", "--fan-out", "1,2"], "k+1"),
    (["--draft-workers", "3", "--draft-max-workers", "2"], "--draft-max-workers 2 is not supported"),
    (["--tp", "0"], "tp and draft_workers"),
    (["--name", "Bad_Name"], "DNS-1035 label"),  # Kubernetes would refuse its Services
    (["--name", "2fast"], "DNS-1035 label"),
    (["--name", "x" * 41], "1-40"),
])
def test_cli_rejects_bad_settings(capsys, argv, message):
    assert main(["deploy", "k8s", *argv]) == 2
    assert message in capsys.readouterr().err


def test_modes_without_a_draft_send_no_draft_to_the_engine():
    """ngram with the generator's default draft: the app args carry no draft (ngram would reject one)."""
    args = k8s.serve_args(SETTINGS["ngram-default-draft-unused"])
    assert args["mode"] == "ngram" and "draft" not in args and "draft_revision" not in args
    assert not config_from_args(args).uses_draft
