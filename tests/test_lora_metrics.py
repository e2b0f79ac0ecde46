"""vLLM's lora_requests_info gauge (saguaro_lora_requests_info): tags naming the adapters of running and of waiting
requests (comma-joined lora_names) and max_lora, its value the time it was set. The engine's load snapshot carries
them (EngineLoad, as LLM.load reads it); the Serve app exports them through Ray's metrics, scraped here from the
session Ray node's real Prometheus endpoint. Real tiny checkpoints and PEFT adapters (test_lora_engine's)."""
from __future__ import annotations

import time

from engine_helpers import PROMPTS
from test_lora_engine import GREEDY, pair  # noqa: F401 - pair: the module's fixture (base, adapters, PEFT)
from test_serving_metrics_review import wait_for

from saguaro_dist import LLM
from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_local_engine
from saguaro_dist.engine.metrics import EngineLoad
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.serve.metrics import ServeMetrics

pytest_plugins = ["test_serve_fixtures"]


def test_the_load_names_running_and_waiting_adapters(pair):  # noqa: F811
    """max_loras 1: adapter one's requests run, two's waits behind them (named once however many ask for it)."""
    one, two = pair["requests"]
    config = Config(model=pair["target"], mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine, _ = build_local_engine(config)
    loras = [one, two, one, None, two]
    seqs = [Sequence(i, f"r{i}", list(PROMPTS[i % 4]), GREEDY, lora_request=lora) for i, lora in enumerate(loras)]
    try:
        for s in seqs:
            engine.add(s)
        engine.step()
        load = engine.load()
        assert (load.running_lora_adapters, load.waiting_lora_adapters, load.max_lora) == (("one",), ("two",), 1)
        assert load.num_running == 3 and load.num_waiting == 2  # the base request is not held up
        while engine.has_work():
            engine.step()
        assert (engine.load().running_lora_adapters, engine.load().waiting_lora_adapters) == ((), ())
    finally:
        engine.close()


def test_the_llms_load_says_max_lora(pair):  # noqa: F811
    """The offline LLM's snapshot (the engine thread's): max_lora with enable_lora, 0 without."""
    one, _ = pair["requests"]
    with LLM(model=pair["target"], mode="ar", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, use_tqdm=False, lora_request=one)
        assert (llm.load.max_lora, llm.load.running_lora_adapters, llm.load.waiting_lora_adapters) == (2, (), ())
    with LLM(model=pair["target"], mode="ar") as llm:
        assert llm.load.max_lora == 0


def test_lora_requests_info_is_exported_with_vllms_tags(metrics_url, pair):  # noqa: F811
    """The engine's snapshot while one adapter runs and another waits, reported as the Serve app reports it; a
    later snapshot (nothing waiting, an empty tag) is the newest series."""
    one, two = pair["requests"]
    model = "lora-requests-info"
    config = Config(model=pair["target"], mode="ar", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine, _ = build_local_engine(config)
    try:
        for i, lora in enumerate([one, two]):
            engine.add(Sequence(i, f"r{i}", list(PROMPTS[i]), GREEDY, lora_request=lora))
        engine.step()
        load = engine.load()
    finally:
        engine.close()
    metrics = ServeMetrics(model)
    before = time.time()
    metrics.load(load)
    found = wait_for(metrics_url, "saguaro_lora_requests_info", model, bool)
    assert [(s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"], s.labels["max_lora"])
            for s in found] == [("one", "two", "1")]
    assert found[0].value >= before - 1  # the time it was set (vLLM's set_to_current_time)
    metrics.load(EngineLoad(num_running=2, running_lora_adapters=("two", "one"), max_lora=1))
    found = wait_for(metrics_url, "saguaro_lora_requests_info", model, lambda f: len(f) == 2)
    newest = max(found, key=lambda s: s.value)
    assert (newest.labels["running_lora_adapters"], newest.labels["waiting_lora_adapters"]) == ("two,one", "")
    off = ServeMetrics("lora-off")
    off.load(EngineLoad(num_running=1))  # LoRA off (max_lora 0): the other gauges, but no lora_requests_info
    assert wait_for(metrics_url, "saguaro_num_requests_running", "lora-off", bool)
    assert not wait_for(metrics_url, "saguaro_lora_requests_info", "lora-off", bool, timeout_s=0)
