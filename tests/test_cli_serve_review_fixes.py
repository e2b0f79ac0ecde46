"""`saguaro serve`'s command line refuses bad input before Ray starts, with a clear message (rc 2): what
`saguaro generate` refuses about the model, a second --api-key value, a served_model_name of the wrong type,
an empty model, an api_key_env naming an unset variable. In-process; Ray's start (`_serve`) is replaced by a
recorder, so none of these tests starts Ray and a refused command line is seen never to reach it."""
from __future__ import annotations

import pytest
import torch
import yaml

import saguaro_dist.cli.serve as serve_cli
from saguaro_dist.cli import main
from saguaro_dist.serve.args import api_key_from_args, served_model_names
from test_model_loading_review import cache_snapshot, offline_cache  # noqa: F401 (a fixture)


@pytest.fixture
def served(monkeypatch):
    """The args each `saguaro serve` would have handed to Ray."""
    calls = []
    monkeypatch.setattr(serve_cli, "_serve", lambda args, *rest: calls.append(args) or 0)
    return calls


@pytest.fixture
def target(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def refused(argv, served, capsys) -> str:
    """rc 2, no traceback, and Ray never started: the error line."""
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert not served and "Traceback" not in err
    return err


def config_file(tmp_path, args: dict) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(args))
    return str(path)


# -- 1. the model, checked here as generate checks it, on the embedded cluster -----------------------------
@pytest.mark.parametrize("flags, message", [
    ([], "not a directory and not a Hugging Face id"),
    (["--max-model-len", "100000"], "max_model_len must be in 1..256"),
    (["--tokenizer", "/nonexistent/tok"], "tokenizer '/nonexistent/tok' could not be loaded"),
    (["--draft", "/nonexistent/draft", "--mode", "sd"], "'/nonexistent/draft' is not a directory"),
    pytest.param(["--device", "cuda"], "sees no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_what_generate_refuses_is_refused_before_ray_starts(flags, message, target, served, capsys):
    model = "/nonexistent/model" if not flags else target  # (it failed after ~33 s, as a failed deployment)
    assert message in refused([model, *flags], served, capsys)


def test_a_hub_id_is_served_when_the_cache_holds_it_and_refused_when_not(offline_cache, target, served, capsys):  # noqa: F811
    from pathlib import Path
    cache_snapshot(offline_cache, "tiny-org/llama", Path(target).iterdir())
    assert main(["serve", "tiny-org/llama"]) == 0 and served[0]["model"] == "tiny-org/llama"
    served.clear()
    assert "HF_HUB_OFFLINE is set" in refused(["tiny-org/absent"], served, capsys)


def test_with_address_a_model_not_here_is_left_to_the_cluster(served):
    """The cluster's nodes may hold models (and GPUs) this machine lacks."""
    assert main(["serve", "/models/on-the-cluster", "--device", "cuda", "--address", "ray://head:10001"]) == 0
    assert served[0]["model"] == "/models/on-the-cluster"


def test_a_failed_deployment_names_the_replica_logs():
    err = RuntimeError("Deploying application saguaro failed: Failed to update the deployments ['SaguaroServer'].")
    message = serve_cli.deploy_failure(err, "/tmp/ray/session_x/logs")
    assert "Failed to update the deployments" in message and "/tmp/ray/session_x/logs/serve/" in message
    assert "Serve logs" in serve_cli.deploy_failure(err, None)  # --address: on the cluster's nodes


# -- 2. several API keys (vLLM's); a MODEL after --api-key is not read as one ----------------------------------
def test_several_api_keys_are_taken_and_a_model_after_them_is_not_read_as_one(target, served, capsys):
    err = refused(["--api-key", "key-one", target], served, capsys)
    assert "give MODEL before --api-key" in err and "key-one" not in err  # the key is not echoed
    assert main(["serve", target, "--api-key", "key-one"]) == 0 and served[0]["api_key"] == ["key-one"]
    assert main(["serve", target, "--api-key", "k1", "k2"]) == 0 and served[1]["api_key"] == ["k1", "k2"]


# -- 3. served_model_name: a name or a list of names ---------------------------------------------------------
def test_a_served_model_name_of_the_wrong_type_is_a_clear_error(tmp_path, target, served, capsys):
    err = refused(["--config", config_file(tmp_path, {"model": target, "served_model_name": 5})], served, capsys)
    assert "served_model_name must be a non-empty name or a list of them, got 5" in err
    assert served_model_names(["a", "b"], "m") == ("a", "b") and served_model_names(None, "m") == ("m",)


# -- 4. an empty model is an error; the demo pair only when no model is given ------------------------------
@pytest.mark.parametrize("argv", [[""], ["--model", ""], ["  "]])
def test_an_empty_model_on_the_command_line_is_an_error(argv, served, capsys):
    assert "is empty: name a model folder" in refused(argv, served, capsys)


def test_an_empty_model_in_a_config_file_is_an_error(tmp_path, served, capsys):
    err = refused(["--config", config_file(tmp_path, {"model": ""})], served, capsys)
    assert "model must name a model folder or Hugging Face id, got ''" in err


# -- 5. api_key_env naming an unset variable -------------------------------------------------------------------
def test_api_key_env_naming_an_unset_variable_is_refused(tmp_path, target, served, capsys, monkeypatch):
    monkeypatch.delenv("F10A_UNSET_KEY", raising=False)
    file = config_file(tmp_path, {"model": target, "api_key_env": "F10A_UNSET_KEY"})
    assert "api_key_env names $F10A_UNSET_KEY, which is unset" in refused(["--config", file], served, capsys)
    monkeypatch.setenv("F10A_UNSET_KEY", "from-env")
    assert main(["serve", "--config", file]) == 0 and served[0]["api_key"] == ["from-env"]
    monkeypatch.delenv("SAGUARO_API_KEY", raising=False)
    assert api_key_from_args({}) is None  # the default variable unset: no key, as before


def test_any_of_several_api_keys_authenticates_over_http():
    """vLLM's --api-key K1 K2: each key opens the API, any other bearer is a 401 (the real middleware, real HTTP)."""
    import httpx
    from fastapi import FastAPI

    from http_helpers import serve_on_loopback
    from saguaro_dist.serve.middleware import ApiKeyMiddleware

    app = FastAPI()
    app.get("/v1/models")(lambda: {"data": []})
    app.add_middleware(ApiKeyMiddleware, api_key=api_key_from_args({"api_key": ["k1", "k2"]}))
    with serve_on_loopback(app) as url:
        status = {key: httpx.get(url + "/models", headers={"Authorization": f"Bearer {key}"}).status_code
                  for key in ("k1", "k2", "k3", "k1k2")}
    assert status == {"k1": 200, "k2": 200, "k3": 401, "k1k2": 401}
    with pytest.raises(ValueError, match="non-empty key"):
        api_key_from_args({"api_key": ["k1", ""]})
