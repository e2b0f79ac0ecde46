"""A runtime LoRA load (POST /v1/load_lora_adapter) on an engine in the server's own process reads the adapter's
files once (the engine's add, whose copy it keeps), with the server's answers for bad adapters as before (vLLM's
404 for no adapter, a 400 naming why one cannot run, and no id spent); a load whose wait for the engine timed out
leaves nothing of its id in the engine once its late add ran. Real tiny checkpoint, PEFT adapters, engine, HTTP."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import saguaro_dist.engine.lora_slots as lora_slots
import saguaro_dist.model.lora_adapter as lora_adapter
from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.lora_models import ServedModels
from saguaro_dist.serve.lora_modules import check_adapter

pytest_plugins = ["test_serve_fixtures"]
pytest.importorskip("peft")
from test_lora_engine import make_adapter  # noqa: E402 (needs peft)


@pytest.fixture(scope="module")
def adapters(serving_pair, tmp_path_factory) -> dict:
    root, target = tmp_path_factory.mktemp("load_once"), serving_pair[0]
    make_adapter(target, root / "one", 1, ["q_proj", "v_proj"])
    make_adapter(target, root / "wide", 3, ["q_proj"], r=16, alpha=16)  # above max_lora_rank 8
    (root / "config_only").mkdir()
    (root / "config_only" / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 1}')
    (root / "empty").mkdir()
    return {name: str(root / name) for name in ("one", "wide", "config_only", "empty")}


@pytest.fixture(scope="module")
def llm(serving_pair):
    with LLM(model=serving_pair[0], mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8,
             max_cpu_loras=4) as llm:
        yield llm


def served(llm) -> ServedModels:
    """The server's ServedModels as create_app wires it to an engine in this process."""
    models = ServedModels(("base",), llm.config)
    models.check_on_target(llm.check_lora_adapter, llm.add_lora)
    return models


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The paths load_adapter read (the real function, counted), the server's and the engine's."""
    seen, real = [], lora_adapter.load_adapter

    def counted(path, *args, **kwargs):
        seen.append(str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(lora_adapter, "load_adapter", counted)
    monkeypatch.setattr(lora_slots, "load_adapter", counted)
    return seen


def test_a_runtime_load_reads_the_adapter_once(llm, adapters, reads):
    app = create_app(llm, ServerOptions("base", runtime_lora_updating=True), models=served(llm))
    with serve_on_loopback(app) as url:
        reply = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "one", "lora_path": adapters["one"]},
                           timeout=60)
        assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'one' added successfully.")
        assert reads == [adapters["one"]]
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "one"}, timeout=60).status_code == 200


def refusal(models: ServedModels, name: str, path: str) -> tuple[int, str, str | None]:
    with pytest.raises(APIError) as err:
        asyncio.run(models.load(name, path))
    return err.value.status, err.value.message, err.value.param


def check_adapters_text(llm, name: str, path: str) -> str:
    with pytest.raises(ValueError) as err:
        check_adapter(name, path, llm.config)
    return str(err.value)


def test_bad_adapters_get_the_same_answers_and_spend_no_id(llm, adapters):
    models = served(llm)
    for name in ("wide", "config_only"):  # cannot run: check_adapter's reason, a 400 naming lora_path
        assert refusal(models, name, adapters[name]) == (400, check_adapters_text(llm, name, adapters[name]),
                                                         "lora_path")
    for path in (adapters["empty"], "/no/such/adapter"):  # no adapter there: vLLM's 404
        assert refusal(models, "x", path)[:2] == (404, f"Loading lora x failed: No adapter found for {path}")
    asyncio.run(models.load("one", adapters["one"]))
    assert models.adapters["one"].lora_int_id == 1
    asyncio.run(models.unload("one", llm.remove_lora))


def held(llm, lora_int_id: int) -> bool:
    """Whether the engine holds anything of the id: its path, a host copy, an added mark."""
    slots = llm._thread.engine.target.loras
    return (slots.ids.current(lora_int_id) is not None or lora_int_id in slots.host
            or lora_int_id in slots.added)


def test_a_load_whose_wait_timed_out_leaves_nothing_in_the_engine(llm, adapters):
    models, thread = served(llm), llm._thread
    saved = vars(thread).get("chore_timeout_s")
    thread.chore_timeout_s = 0  # the add's chore cannot have run when its wait ends: it runs later
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(models.load("late", adapters["one"], remove=llm.remove_lora))
    finally:
        thread.chore_timeout_s = saved
    lora_int_id = models._last_id  # spent, never served
    assert "late" not in models.adapters
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        llm.reset_prefix_cache()  # a chore after the late add (and after the remove, once that was queued)
        if not held(llm, lora_int_id):
            break
        time.sleep(0.05)
    assert not held(llm, lora_int_id)
