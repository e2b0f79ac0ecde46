"""Where serving's LoRA checks run: a runtime load or unload asks the deployment's replica count at the time (a Serve
config file's override applies after the app builder ran), `saguaro serve` hands the replicas its reading of
VLLM_ALLOW_RUNTIME_LORA_UPDATING, a runtime load of nothing is vLLM's 404, and a --lora-modules adapter is read
where the engine's target reads it (on Ray: rank 0, whose disk may lack a folder the replica holds). Real tiny
checkpoints and PEFT adapters, real Ray Serve replicas, real HTTP."""
from __future__ import annotations

import asyncio

import httpx
import huggingface_hub
import pytest

from saguaro_dist import LLM
from saguaro_dist.cli import main
from saguaro_dist.cli import serve as serve_cli
from saguaro_dist.config import Config
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.app import server_options
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.lora_models import ServedModels
from saguaro_dist.serve.lora_modules import LoRAModule

pytest_plugins = ["test_serve_fixtures"]
peft = pytest.importorskip("peft")
from test_lora_engine import make_adapter  # noqa: E402 (needs peft)

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@pytest.fixture(scope="module")
def adapter(serving_pair, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("guard_loras") / "one"
    make_adapter(serving_pair[0], path, 1, ["q_proj"])
    return str(path)


def models(serving_pair, replicas=None) -> ServedModels:
    config = Config(model=serving_pair[0], mode="ar", enable_lora=True, max_lora_rank=8)
    return ServedModels(("base",), config, **({"replicas": replicas} if replicas else {}))


def status_and_message(call) -> tuple[int, str]:
    with pytest.raises(APIError) as err:
        asyncio.run(call)
    return err.value.status, err.value.message


def test_loading_what_is_not_there_is_vllms_404(serving_pair, tmp_path, monkeypatch):
    for name, value in (("HF_HUB_CACHE", str(tmp_path / "hub")), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(huggingface_hub.constants, name, value)  # a Hub id the (empty) cache cannot provide
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    served = models(serving_pair)
    for path in ("no_such_adapter", "nobody-org/absent-adapter", "empty", str(tmp_path / "empty")):
        assert status_and_message(served.load("x", path)) == (404, f"Loading lora x failed: No adapter found for {path}")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 1}')
    status, message = status_and_message(served.load("x", "config_only"))  # an adapter that cannot load: 400
    assert status == 400 and "no adapter_model.safetensors" in message


def test_runtime_updates_are_refused_while_more_than_one_replica_may_serve(serving_pair, adapter):
    replicas = [2]
    served = models(serving_pair, lambda: replicas[0])
    for call in (served.load("one", adapter), served.unload("one")):
        status, message = status_and_message(call)
        assert status == 400 and "may run 2 replicas" in message and "--lora-modules" in message
    replicas[0] = 1  # scaled back to one: updates go through
    assert asyncio.run(served.load("one", adapter)) == "Success: LoRA adapter 'one' added successfully."
    assert asyncio.run(served.unload("one")) == "Success: LoRA adapter 'one' removed successfully."


def test_the_app_arg_decides_over_the_replicas_environment(monkeypatch):
    monkeypatch.setenv(RUNTIME_ENV, "true")
    read = lambda **args: server_options(args, "/t").runtime_lora_updating  # noqa: E731
    assert read() is True  # no app arg (serve run, a KubeRay manifest): the variable where the replica runs
    assert read(allow_runtime_lora_updating=False) is False
    assert read(allow_runtime_lora_updating="false") is False  # `serve run app:build_app k=v` passes text
    monkeypatch.delenv(RUNTIME_ENV)
    assert read(allow_runtime_lora_updating="true") is True
    with pytest.raises(ValueError, match="allow_runtime_lora_updating must be true or false"):
        read(allow_runtime_lora_updating="maybe")


@pytest.mark.parametrize("env, passed", [("1", True), (None, False)])
def test_saguaro_serve_hands_its_reading_of_the_variable_to_the_replicas(serving_pair, monkeypatch, env, passed):
    if env is None:
        monkeypatch.delenv(RUNTIME_ENV, raising=False)
    else:
        monkeypatch.setenv(RUNTIME_ENV, env)
    given = {}
    monkeypatch.setattr(serve_cli, "_serve", lambda args, *rest: given.update(args) or 0)  # stop before Ray starts
    assert main(["serve", serving_pair[0], "--enable-lora"]) == 0
    assert given["allow_runtime_lora_updating"] is passed


def test_a_config_files_app_arg_with_replicas_is_refused(serving_pair, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    config = tmp_path / "serve.yaml"
    config.write_text(f"""applications:
- name: saguaro
  import_path: saguaro_dist.serve.app:build_app
  args: {{model: {serving_pair[0]}, enable_lora: true, allow_runtime_lora_updating: true}}
  deployments: [{{name: SaguaroServer, num_replicas: 2}}]
""")
    assert main(["serve", "--config", str(config)]) == 2
    assert "needs one replica" in capsys.readouterr().err


@pytest.mark.slow
def test_a_static_adapter_missing_where_rank_0_reads_fails_start_up(serving_pair, adapter, ray_cluster, tmp_path,
                                                                    monkeypatch):
    import shutil
    shutil.copytree(adapter, tmp_path / "here_only")
    # Ray's workers keep the directory Ray started in: a relative path found here is missing where rank 0 runs,
    # as a folder on the replica's node but not on the target's
    monkeypatch.chdir(tmp_path)
    with LLM(model=serving_pair[0], mode="ar", cluster="auto", enable_lora=True, max_lora_rank=8) as llm:
        llm.check_lora_adapter(adapter)  # (an absolute path: the same folder for both)
        options = ServerOptions("base", lora_modules=(LoRAModule("one", "here_only"),))
        with pytest.raises(ValueError, match=r"'one' \(here_only\) on the engine's target: .*node of the target's rank 0"):
            create_app(llm, options)
        create_app(llm, ServerOptions("base", lora_modules=(LoRAModule("one", adapter),)))


@pytest.mark.slow
def test_a_deployment_overridden_to_autoscale_refuses_runtime_loads(server, serving_pair, adapter):
    """What Serve runs after a config file's `deployments: [{name: SaguaroServer, autoscaling_config: ...}]`
    override of the app build_app returned: one replica running, the variable in its environment."""
    from ray import serve

    from saguaro_dist.serve.app import DEPLOYMENT_NAME, SaguaroServer
    args = {"model": serving_pair[0], "mode": "ar", "max_model_len": 128, "api_key": server.api_key,
            "served_model_name": "base", "enable_lora": True, "max_lora_rank": 8}
    deployment = serve.deployment(serve.ingress()(SaguaroServer), name=DEPLOYMENT_NAME,
                                  autoscaling_config={"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2},
                                  ray_actor_options={"runtime_env": {"env_vars": {RUNTIME_ENV: "true"}}},
                                  graceful_shutdown_wait_loop_s=0.1)  # (serve.delete: no 2 s drain check)
    serve.run(deployment.bind(args), name="lora_guard", route_prefix="/lora_guard")
    try:
        url = f"{server.url}/lora_guard/v1"
        load = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "one", "lora_path": adapter},
                          headers=server.headers, timeout=60)
        models = httpx.get(f"{url}/models", headers=server.headers, timeout=30).json()["data"]
    finally:
        serve.delete("lora_guard")
    assert load.status_code == 400 and "may run 2 replicas" in load.json()["error"]["message"], load.text
    assert [m["id"] for m in models] == ["base"]


@pytest.mark.slow
def test_a_replica_reads_the_replica_count_serve_configured(server):  # (server: Serve started as the tests start it)
    from ray import serve

    from saguaro_dist.serve.app import deployment_replicas

    # (a drain check every 0.1 s, not Serve's 2 s: each serve.delete waited one out, with nothing to drain)
    @serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=0.1)
    class Probe:
        def __call__(self) -> int:
            return deployment_replicas()

    for options, want in (({"num_replicas": 2}, 2), ({"num_replicas": 1}, 1)):
        handle = serve.run(Probe.options(**options).bind(), name="replica_probe", route_prefix=None)
        try:
            assert handle.remote().result(timeout_s=60) == want
        finally:
            serve.delete("replica_probe")
