"""Session 85's deploy review: `saguaro --log-level` reaches the replicas and the engine's actors; an api_key_env
naming an unset variable refuses to start (the VM launcher's key never reached the containers); `saguaro serve
--host/--port` on a cluster whose Serve already runs elsewhere is refused, not ignored."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

import saguaro_dist.cli.serve as serve_cli
from saguaro_dist.cli import main
from saguaro_dist.serve.args import api_key_from_args
from saguaro_dist.serve.ingress import free_port
from saguaro_dist.serve.replica_observability import LOG_LEVEL_ENV, job_logging, replica_log_level, with_log_level

pytest_plugins = ["test_serve_fixtures"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def options_served(monkeypatch):
    """The deployment options each `saguaro serve` would have handed to Ray."""
    calls = []
    monkeypatch.setattr(serve_cli, "_serve", lambda args, host, port, ns, options, *rest: calls.append(options) or 0)
    return calls


# -- 1. --log-level --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top, flags, serve_level, ours", [
    (["--log-level", "error"], [], "ERROR", "ERROR"),
    (["--log-level", "DEBUG"], ["--uvicorn-log-level", "warning"], "WARNING", "DEBUG"),  # Serve's lines: uvicorn's
    ([], ["--uvicorn-log-level", "warning"], "WARNING", None),
    ([], [], None, None),  # not given: the replicas keep Serve's INFO (the CLI's own WARNING is no choice made)
])
def test_log_level_reaches_the_deployments_options(top, flags, serve_level, ours, tiny_checkpoint, options_served):
    assert main([*top, "serve", str(tiny_checkpoint("llama")), "--port", str(free_port()), *flags]) == 0
    (options,) = options_served
    assert (options.get("logging_config") or {}).get("log_level") == serve_level
    env = options.get("ray_actor_options", {}).get("runtime_env", {}).get("env_vars", {})
    assert env.get(LOG_LEVEL_ENV) == ours


def test_a_config_files_actor_options_keep_theirs():
    given = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 2, "runtime_env": {"env_vars": {"A": "1"}}}}
    options = with_log_level(given, "DEBUG", uvicorn_level_given=False)
    assert options["ray_actor_options"] == {"num_cpus": 2, "runtime_env": {"env_vars": {"A": "1", LOG_LEVEL_ENV: "DEBUG"}}}
    assert options["num_replicas"] == 1 and given["ray_actor_options"]["runtime_env"]["env_vars"] == {"A": "1"}


def test_the_job_carries_the_level_to_its_workers():
    """ray.init's job config: every worker of the job (the embedded cluster's replicas, the engine's actors)."""
    assert job_logging(None) is None
    assert job_logging("DEBUG").py_logging_config.log_level == "DEBUG"


def test_replica_level_from_the_environment(monkeypatch):
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    assert replica_log_level(logging.WARNING) == logging.WARNING and replica_log_level(0) == logging.INFO
    monkeypatch.setenv(LOG_LEVEL_ENV, "debug")
    assert replica_log_level(logging.INFO) == logging.DEBUG
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")  # no level: Serve's, with a warning
    assert replica_log_level(logging.INFO) == logging.INFO


def test_a_replica_and_its_actors_get_the_level(server):
    """A real replica deployed with the options `saguaro --log-level DEBUG serve` builds: saguaro's loggers at
    DEBUG though Serve's own are at WARNING, and an actor it starts (as the engine's) sees the level too."""
    import os

    import ray
    from ray import serve

    @ray.remote(num_cpus=0)
    class Child:
        def level(self):
            return os.environ.get(LOG_LEVEL_ENV)

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Probe:
        def __init__(self):
            from saguaro_dist.serve.replica_observability import adopt_serve_logging
            adopt_serve_logging()
            self.child = Child.remote()

        async def __call__(self):
            ours, theirs = logging.getLogger("saguaro_dist"), logging.getLogger("ray.serve")
            return ours.level, theirs.level, await self.child.level.remote()

    options = with_log_level({"logging_config": {"log_level": "WARNING"}}, "DEBUG", uvicorn_level_given=True)
    try:
        handle = serve.run(Probe.options(**options).bind(), name="s85_log_level", route_prefix=None)
        assert handle.remote().result(timeout_s=60) == (logging.DEBUG, logging.WARNING, "DEBUG")
    finally:
        serve.delete("s85_log_level")


# -- 3. the API key's variable ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, "", "  "])
def test_an_api_key_env_naming_an_unset_or_empty_variable_is_refused(value, monkeypatch):
    """The manifests name SAGUARO_API_KEY: unset in the container (the VM launcher's `--env` never had it), the
    app served every request unauthenticated."""
    if value is None:
        monkeypatch.delenv("SAGUARO_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SAGUARO_API_KEY", value)
    with pytest.raises(ValueError, match=r"api_key_env names \$SAGUARO_API_KEY, which is unset or empty"):
        api_key_from_args({"api_key_env": "SAGUARO_API_KEY"})
    if value is None:
        assert api_key_from_args({}) is None  # none named: no key, as vLLM without VLLM_API_KEY
    monkeypatch.setenv("SAGUARO_API_KEY", "k")
    assert api_key_from_args({"api_key_env": "SAGUARO_API_KEY"}) == ("k",)


def test_the_generated_serve_config_still_validates_offline(monkeypatch):
    """The manifests are checked here, without the pods' Secret: api_key_env is not read then."""
    from saguaro_dist.deploy import k8s, validation
    monkeypatch.delenv("SAGUARO_API_KEY", raising=False)
    (args,) = validation.validate_serve_config(k8s.to_yaml([k8s.serve_config(k8s.K8sSettings())]))
    assert args["api_key_env"] == "SAGUARO_API_KEY"


def test_the_launcher_passes_the_key_as_a_file_docker_reads_on_the_vm():
    """Ray runs `docker run` on the VM over ssh: `--env SAGUARO_API_KEY` took the VM shell's (unset) variable.
    The key file is a file mount, which Ray copies to its host folder before the container starts."""
    from ray.autoscaler._private.docker import docker_start_cmds
    from ray.autoscaler.sdk import get_docker_host_mount_location

    launcher = yaml.safe_load((ROOT / "deploy" / "cluster-launcher.yaml").read_text())
    options = launcher["docker"]["run_options"]
    assert not any(o.split() == ["--env", "SAGUARO_API_KEY"] for o in options)
    (env_file,) = [o.split()[1] for o in options if o.startswith("--env-file")]
    host_copies = {f"{get_docker_host_mount_location(launcher['cluster_name'])}/{remote.lstrip('/')}"
                   for remote in launcher["file_mounts"]}
    assert env_file in host_copies
    command = docker_start_cmds("ubuntu", launcher["docker"]["image"], launcher["file_mounts"], "saguaro", options,
                                launcher["cluster_name"], "/home/ray", "docker")
    assert f"--env-file {env_file}" in command


# -- 4. --host / --port on a cluster whose Serve already runs --------------------------------------------------
def test_a_port_serve_already_runs_elsewhere_is_refused(server):
    """The session's Serve listens on server.url's port: asking another is refused, not logged as served."""
    from ray import serve
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(ValueError, match=f"Serve already runs on this cluster at 127.0.0.1:{port}"):
        serve_cli._start_serve(serve, {"host": "127.0.0.1", "port": free_port()}, None)
    with pytest.raises(ValueError, match="--host 0.0.0.0"):
        serve_cli._start_serve(serve, {"host": "0.0.0.0", "port": port}, None)
    serve_cli._start_serve(serve, {"host": "127.0.0.1", "port": port}, None)  # the same: joined as it is
    serve_cli._start_serve(serve, {"host": "127.0.0.1", "port": free_port()}, None, proxy_is_public=False)  # direct


def test_address_check_on_rays_own_http_options():
    from ray.serve.config import HTTPOptions
    serve_cli.check_address_applied(HTTPOptions(host="0.0.0.0", port=8000), "0.0.0.0", 8000)
    with pytest.raises(ValueError, match="give --host 0.0.0.0 --port 8000"):
        serve_cli.check_address_applied(HTTPOptions(host="0.0.0.0", port=8000), "0.0.0.0", 8001)


def test_an_engine_actor_follows_the_inherited_level(monkeypatch):
    """A target rank or draft actor a replica started (on a cluster whose Serve already ran, the job's level is
    not ours): its saguaro_dist loggers follow $SAGUARO_LOGGING_LEVEL. Old: nothing in the actors read it."""
    import logging

    from saguaro_dist.log_level import follow_env_log_level
    ours = logging.getLogger("saguaro_dist")
    monkeypatch.setattr(ours, "level", ours.level)  # restored after
    monkeypatch.setenv(LOG_LEVEL_ENV, "error")
    follow_env_log_level()
    assert ours.level == logging.ERROR
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")  # no level: left as it was
    follow_env_log_level()
    assert ours.level == logging.ERROR
