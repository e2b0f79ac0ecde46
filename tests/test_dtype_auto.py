"""dtype "auto" (vLLM's --dtype auto): each model runs in its own checkpoint's dtype, adjusted to its device.
Old: every edge (Config, CLI, manifests, bench, Helm) refused "auto"."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from engine_helpers import BF16_NEAR_TIE, PROMPTS, assert_greedy_equal, llama_config, save_model, save_perturbed
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.bench.config import BenchConfig
from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.serve import engine_args
from saguaro_dist.config import Config, check_dtype
from saguaro_dist.deploy import k8s
from saguaro_dist.engine.build import build_draft_worker, fit_draft, make_runner
from saguaro_dist.model import device as dev
from saguaro_dist.model.runner import ModelRunner
from saguaro_dist.serve.args import config_from_args

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# ---- the resolution: one pure function ---------------------------------------------------------------

@pytest.mark.parametrize("device, saved, want", [
    ("cuda", "float32", "float16"), ("cuda", "float16", "float16"), ("cuda", "bfloat16", "bfloat16"),
    ("cuda", None, "float16"),  # no dtype in config.json: float32 weights, as transformers and vLLM read it
    ("cuda:1", "float32", "float16"),
    ("cpu", "float32", "float32"), ("cpu", "float16", "bfloat16"), ("cpu", "bfloat16", "bfloat16"),
    ("cpu", None, "float32"),
])
def test_auto_dtype_for_each_device_and_checkpoint_dtype(device, saved, want):
    hf = {"model_type": "llama"} | ({"dtype": saved} if saved else {})
    assert dev.auto_dtype(hf, device) == want
    assert dev.auto_dtype(hf, torch.device(device)) == want


def test_auto_dtype_reads_older_configs_torch_dtype_and_prefers_dtype():
    assert dev.auto_dtype({"torch_dtype": "bfloat16"}, "cuda") == "bfloat16"  # transformers < 4.56 writes torch_dtype
    assert dev.auto_dtype({"torch_dtype": "torch.float16"}, "cpu") == "bfloat16"
    assert dev.auto_dtype({"dtype": "bfloat16", "torch_dtype": "float32"}, "cuda") == "bfloat16"


def test_auto_dtype_refuses_a_dtype_it_cannot_run_naming_it():
    with pytest.raises(ValueError, match="'int8'.*name the dtype instead"):
        dev.auto_dtype({"dtype": "int8"}, "cpu")


def test_resolve_dtype_takes_named_dtypes_whatever_the_checkpoint_says():
    hf = {"dtype": "bfloat16"}
    assert dev.resolve_dtype("float32", hf, "cpu") == torch.float32
    assert dev.resolve_dtype(torch.float16, hf, "cuda") == torch.float16
    assert dev.resolve_dtype("auto", hf, "cpu") == torch.bfloat16


# ---- the edges accept it; the default stays --------------------------------------------------------

def test_config_accepts_auto_and_keeps_float32_by_default():
    check_dtype("auto")
    assert Config(model="m", mode="ar", dtype="auto").dtype == "auto"
    assert Config(model="m", mode="ar").dtype == "float32"
    with pytest.raises(ValueError, match="auto"):  # the message lists it
        Config(model="m", mode="ar", dtype="half")


def test_a_manifest_s_dtype_auto_builds_the_config():
    assert config_from_args({"model": "m", "mode": "ar", "dtype": "auto"}).dtype == "auto"


def test_the_cli_accepts_dtype_auto():
    ns = build_parser().parse_args(["serve", "/models/t", "--mode", "ar", "--dtype", "auto"])
    assert engine_args(ns)["dtype"] == "auto"


def test_the_deploy_generator_passes_dtype_auto_to_the_app():
    settings = k8s.K8sSettings(dtype="auto", gpu=True)
    assert settings.engine_dtype == "auto" and k8s.serve_args(settings)["dtype"] == "auto"


def test_the_helm_values_schema_takes_dtype_auto():
    helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk==0.2.2 (test extra)")
    from test_deploy_helm import CHART
    report = helm.lint(str(CHART), values={"engine": {"dtype": "auto"}}, strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


# ---- tiny checkpoints saved by transformers in each dtype ----------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A target saved in float32, bfloat16, float16 and with no dtype in config.json; a float32 draft."""
    root = tmp_path_factory.mktemp("h17_dtypes")
    model = save_model(root / "float32", llama_config(96, 64, 2), seed=0)
    save_perturbed(root / "draft32", model, seed=1, noise=0.15)
    for dtype in ("bfloat16", "float16"):
        copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(root / dtype)
    save_model(root / "missing", llama_config(96, 64, 2), seed=0)
    path = root / "missing" / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k not in ("dtype", "torch_dtype")}))
    return {name: str(root / name) for name in ("float32", "bfloat16", "float16", "missing", "draft32")} | {"model": model}


@pytest.mark.parametrize("saved, want", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.bfloat16), ("missing", torch.float32)])
def test_a_runner_loads_auto_in_the_resolved_dtype_on_the_cpu(ckpts, saved, want):
    runner = ModelRunner(ckpts[saved], dtype="auto")
    assert runner.dtype == want and {p.dtype for p in runner.model.parameters()} == {want}


def test_a_checkpoint_auto_cannot_run_is_named(ckpts, tmp_path):
    path = tmp_path / "int8"
    path.mkdir()
    hf = json.loads((Path(ckpts["float32"]) / "config.json").read_text()) | {"dtype": "int8"}
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"{path}: dtype auto: .*'int8'"):
        ModelRunner(str(path), dtype="auto")


def test_target_and_draft_each_resolve_their_own_checkpoint(ckpts):
    config = Config(model=ckpts["bfloat16"], draft=ckpts["draft32"], mode="sd", k=3, dtype="auto")
    assert make_runner(config.model, config).dtype == torch.bfloat16
    assert build_draft_worker(config, fit_draft(config, None)).runner.dtype == torch.float32


def generate(**kwargs) -> list[list[int]]:
    with LLM(**kwargs) as llm:
        return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize("saved, resolved", [("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "bfloat16")])
def test_greedy_under_auto_equals_plain_ar_at_the_resolved_dtype(ckpts, saved, resolved):
    """On the CPU auto runs each target at its resolved dtype (the float32 draft in float32): ar identical to ar
    at that dtype, sd and ssd greedy-equal to it."""
    want = generate(model=ckpts[saved], mode="ar", dtype=resolved)
    assert generate(model=ckpts[saved], mode="ar", dtype="auto") == want  # the same forwards: identical
    for mode in ("sd", "ssd"):
        got = generate(model=ckpts[saved], draft=ckpts["draft32"], mode=mode, k=3, dtype="auto",
                       draft_executor="thread")
        for prompt, g, w in zip(PROMPTS, got, want):
            assert_greedy_equal(g, w, prompt, ckpts["model"], rel_tie=BF16_NEAR_TIE if resolved == "bfloat16" else 0.0)


def test_bench_resolves_auto_for_the_target_and_records_it(ckpts):
    assert BenchConfig(target=ckpts["bfloat16"], draft=ckpts["draft32"], dtype="auto").dtype == "bfloat16"
    assert BenchConfig(target=ckpts["float32"], draft=ckpts["draft32"], dtype="auto").dtype == "float32"
    assert BenchConfig(target=ckpts["float32"], draft=ckpts["draft32"], dtype="auto", device="cuda").dtype == "float16"
    assert BenchConfig().dtype == "float32"


def test_generate_with_dtype_auto_runs_the_float16_demo_pair_in_bfloat16(capsys):
    """The shipped demo pair is saved in float16: on the CPU auto runs it as bfloat16 does."""
    def run(dtype):
        code = main(["generate", "--mode", "ar", "--dtype", dtype, "--prompt", "def add(a, b):", "--max-tokens", "8",
                     "--temperature", "0", "--json"])
        assert code == 0
        return json.loads(capsys.readouterr().out)["text"]
    assert run("auto") == run("bfloat16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh)")
def test_on_cuda_auto_runs_a_float32_checkpoint_in_float16_as_vllm_does(ckpts):
    assert ModelRunner(ckpts["float32"], device="cuda", dtype="auto").dtype == torch.float16
    assert ModelRunner(ckpts["bfloat16"], device="cuda", dtype="auto").dtype == torch.bfloat16
    want = generate(model=ckpts["float32"], mode="ar", dtype="float16", device="cuda")
    assert generate(model=ckpts["float32"], mode="ar", dtype="auto", device="cuda") == want


def test_deploy_k8s_takes_dtype_auto(capsys):
    """The deploy command listed its own dtypes and refused auto, which the manifest's Config takes."""
    import yaml

    from saguaro_dist.cli import main
    assert main(["deploy", "k8s", "--model", "m", "--draft", "d", "--dtype", "auto"]) == 0
    (doc,) = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "RayService"]
    (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["dtype"] == "auto"


# ---- Gemma 3 in float16 (vLLM's _FLOAT16_NOT_SUPPORTED_MODELS): refused when named, never auto's choice ----
AMPERE, VOLTA = dev.DeviceKind("cuda", (8, 0), "A100"), dev.DeviceKind("cuda", (7, 0), "V100")


@pytest.mark.parametrize("model_type", ["gemma3", "gemma3_text"])
def test_gemma3_refuses_float16_and_auto_picks_a_stable_dtype(model_type):
    hf = {"model_type": model_type, "torch_dtype": "float32"}
    with pytest.raises(ValueError, match=f"float16 is not supported for {model_type}"):
        dev.resolve_dtype("float16", hf, AMPERE)
    assert dev.resolve_dtype("auto", hf, AMPERE) == torch.bfloat16  # auto's float16 for a float32 checkpoint
    assert dev.resolve_dtype("auto", {**hf, "torch_dtype": "bfloat16"}, VOLTA) == torch.float32  # no bf16 there
    assert dev.resolve_dtype("auto", {"model_type": "llama", "torch_dtype": "float32"}, AMPERE) == torch.float16
