"""Runtime LoRA loads checked where the engine reads them, and paths no folder can have: a load on a Ray-cluster
engine is read on rank 0's node (vLLM's load calls the engine's add_lora), so one missing there is refused and no
name serves it; a ~user of an unknown user or a name too long for the file system is "no adapter found" (a 404 on
the route, exit 2 from `saguaro serve`), never a 500 or a traceback. Real tiny checkpoints and PEFT adapters, a
real Ray engine, real HTTP."""
from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from saguaro_dist import LLM
from saguaro_dist.cli import main
from saguaro_dist.config import Config
from saguaro_dist.model.lora_adapter import resolve_adapter_dir
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.lora_models import ServedModels

pytest_plugins = ["test_serve_fixtures"]
peft = pytest.importorskip("peft")
from http_helpers import serve_on_loopback  # noqa: E402
from test_lora_engine import make_adapter  # noqa: E402 (needs peft)

# ~user of no user (expanduser: RuntimeError), names too long for the file system (is_dir: OSError ENAMETOOLONG)
IMPOSSIBLE_PATHS = ("~nosuchuser_xyz/adapter", "/" + "a" * 300, "a" * 5000, "owner/" + "a" * 300)


@pytest.fixture(scope="module")
def adapter(serving_pair, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("runtime_review_loras") / "one"
    make_adapter(serving_pair[0], path, 1, ["q_proj", "v_proj"])
    return str(path)


@pytest.mark.parametrize("path", IMPOSSIBLE_PATHS)
def test_a_path_no_folder_can_have_is_no_adapter(path):
    with pytest.raises(ValueError):  # (the last: the Hub's refusal of an id that long)
        resolve_adapter_dir(path)


def test_a_runtime_load_of_a_path_no_folder_can_have_is_vllms_404(serving_pair):
    config = Config(model=serving_pair[0], mode="ar", enable_lora=True, max_lora_rank=8)
    served = ServedModels(("base",), config)
    for path in IMPOSSIBLE_PATHS:
        with pytest.raises(APIError) as err:
            asyncio.run(served.load("x", path))
        assert (err.value.status, err.value.message) == (404, f"Loading lora x failed: No adapter found for {path}")
    assert served.adapters == {}


def test_saguaro_serve_refuses_a_lora_module_under_an_unknown_home(serving_pair, capsys):
    argv = ["serve", serving_pair[0], "--enable-lora", "--lora-modules", "x=~nosuchuser_xyz/adapter"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "not a directory and not a Hugging Face id" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_runtime_load_missing_where_rank_0_reads_is_refused(serving_pair, adapter, ray_cluster, tmp_path,
                                                              monkeypatch):
    shutil.copytree(adapter, tmp_path / "here_only")
    # Ray's workers keep the directory Ray started in: a relative path found here is missing where rank 0 runs,
    # as a folder on the replica's node but not on the target's
    monkeypatch.chdir(tmp_path)
    with LLM(model=serving_pair[0], mode="ar", cluster="auto", enable_lora=True, max_lora_rank=8) as llm:
        app = create_app(llm, ServerOptions("base", runtime_lora_updating=True))
        with serve_on_loopback(app) as url:
            def load(path):
                return httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, timeout=120)

            def model_ids():
                return [m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]]

            missing = load("here_only")
            assert missing.status_code == 404, missing.text
            message = missing.json()["error"]["message"]
            assert message.startswith("Loading lora x failed: No adapter found for here_only")
            assert "node of the target's rank 0" in message
            assert model_ids() == ["base"]
            assert load(adapter).status_code == 200  # (an absolute path: the same folder for both)
            assert model_ids() == ["base", "x"]
            done = httpx.post(f"{url}/completions", json={"model": "x", "prompt": "hello", "max_tokens": 2},
                              timeout=120)
            assert done.status_code == 200, done.text
