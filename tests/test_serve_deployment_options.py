"""The Serve deployment `build_app` makes, and the `serve build` file `saguaro serve --config` takes: options a
replica holding the engine needs (its batch, its GPUs, autoscaling's target), read from the built deployment
Serve would run. No cluster or GPU needed: building reads the config, it loads no model."""
from __future__ import annotations

import sys

import pytest
import yaml

from saguaro_dist.serve.app import APP_IMPORT_PATH, DEPLOYMENT_NAME, build_app, build_deployment
from saguaro_dist.serve.config_file import load_serve_config

pytest_plugins = ["test_serve_fixtures"]


def built(args: dict, **options):
    """(deployment config, ray_actor_options) of the app as Serve would deploy it."""
    deployment = build_deployment(args, **options)._bound_deployment
    return deployment._deployment_config, deployment.ray_actor_options


def test_num_replicas_auto_targets_a_full_batch_per_replica(serving_pair):
    """`num_replicas: auto` alone is Serve's default autoscaling config, whose target of 2 requests a replica the
    override never replaced (it looked only at an autoscaling_config dict)."""
    config, _ = built({"model": serving_pair[0], "mode": "ar", "max_batch_size": 16}, num_replicas="auto")
    assert config.autoscaling_config.target_ongoing_requests == 16
    assert config.autoscaling_config.max_replicas == 100  # the rest as Serve's "auto" gives it
    config, _ = built({"model": serving_pair[0], "mode": "ar", "max_batch_size": 16}, num_replicas="auto",
                      autoscaling_config={"max_replicas": 3, "target_ongoing_requests": 5})
    assert (config.autoscaling_config.target_ongoing_requests, config.autoscaling_config.max_replicas) == (5, 3)


def test_a_replica_may_hold_a_whole_batch(serving_pair):
    """max_ongoing_requests stayed 256 with max_batch_size 512: a replica never filled its batch, and the
    autoscaling target (a full batch) was more than a replica could hold. A value the caller sets is kept."""
    args = {"model": serving_pair[0], "mode": "ar", "max_batch_size": 512}
    config, _ = built(args, autoscaling_config={"max_replicas": 2})
    assert config.max_ongoing_requests == 512 and config.autoscaling_config.target_ongoing_requests == 512
    assert built({**args, "max_batch_size": 8})[0].max_ongoing_requests == 256
    assert built(args, max_ongoing_requests=600)[0].max_ongoing_requests == 600


@pytest.mark.parametrize("devices, gpus", [({"device": "cuda"}, 1), ({"device": "cuda:0"}, 1),
                                           ({"device": "cuda", "mode": "sd", "draft": True, "draft_device": "cuda:1"}, 2),
                                           ({"device": "cpu"}, None), ({"device": "cuda", "cluster": "auto"}, None)])
def test_a_replica_running_its_engine_on_cuda_reserves_the_gpus(serving_pair, devices, gpus):
    """An in-process CUDA engine's replica asked Ray for no GPU: Ray counted the GPU free and put every replica on
    cuda:0. On a cluster the engine's own actors reserve theirs, so the replica takes none."""
    args = {"model": serving_pair[0], "mode": "ar", **devices}
    if args.pop("draft", False):
        args["draft"] = serving_pair[1]
    _, actor = built(args, num_replicas=2)
    assert actor.get("num_gpus") == gpus and actor["num_cpus"] == 1


def test_a_replicas_gpus_the_caller_set_are_kept(serving_pair):
    args = {"model": serving_pair[0], "mode": "ar", "device": "cuda"}
    _, actor = built(args, ray_actor_options={"num_gpus": 0.5, "runtime_env": {"env_vars": {"A": "1"}}})
    assert actor["num_gpus"] == 0.5
    _, actor = built(args, ray_actor_options={"runtime_env": {"env_vars": {"A": "1"}}})  # a config file's env_vars
    assert actor["num_gpus"] == 1 and actor["runtime_env"] == {"env_vars": {"A": "1"}}


def serve_build(tmp_path, module_text: str) -> dict:
    """What Ray's own `serve build module:app` writes (its CLI, run here: a subprocess would import Ray again)."""
    from click.testing import CliRunner
    from ray.serve.scripts import cli

    (tmp_path / "saguaro_built_app.py").write_text(module_text)
    out, saved_path = tmp_path / "built.yaml", list(sys.path)
    try:
        result = CliRunner().invoke(cli, ["build", "saguaro_built_app:app", "--app-dir", str(tmp_path),
                                          "-o", str(out)])
    finally:
        sys.path[:] = saved_path  # serve build puts --app-dir on sys.path
        sys.modules.pop("saguaro_built_app", None)
    assert result.exit_code == 0, result.output
    return yaml.safe_load(out.read_text())


def test_a_serve_build_file_loads(serving_pair, tmp_path):
    """`serve build` always writes grpc_options (no servicer functions: no gRPC server) and Ray's default
    logging_config; `saguaro serve --config` refused both, so no built file loaded."""
    args = {"model": serving_pair[0], "mode": "ar", "max_batch_size": 300}
    written = serve_build(tmp_path, f"from saguaro_dist.serve.app import build_app\napp = build_app({args!r})\n")
    assert written["grpc_options"]["grpc_servicer_functions"] == [] and "logging_config" in written
    app = written["applications"][0]
    app.update(import_path=APP_IMPORT_PATH, args=args)  # the user's edit: Serve's builder and its args
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(written))
    loaded = load_serve_config(str(path))
    assert loaded.args == args and (loaded.host, loaded.port, loaded.route_prefix) == ("0.0.0.0", 8000, "/")
    assert app["deployments"] == [{"name": DEPLOYMENT_NAME, "max_ongoing_requests": 300}]
    assert loaded.deployment_options == {"max_ongoing_requests": 300}


@pytest.mark.parametrize("setting, named", [
    ({"grpc_options": {"grpc_servicer_functions": ["my.module:add_servicer"]}}, "grpc_options"),
    ({"logging_config": {"log_level": "DEBUG"}}, "--uvicorn-log-level"),
])
def test_a_serve_build_files_other_grpc_or_logging_settings_are_refused(tmp_path, setting, named):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({**setting, "applications": [
        {"name": "app1", "import_path": APP_IMPORT_PATH, "args": {"model": "m"}}]}))
    with pytest.raises(ValueError, match="does not apply") as err:
        load_serve_config(str(path))
    assert named in str(err.value)


def test_a_null_logging_config_reads_as_unset(tmp_path):
    """`logging_config: null` loaded as unset; the serve-build check made it a TypeError traceback."""
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"logging_config": None, "applications": [
        {"name": "app1", "import_path": APP_IMPORT_PATH, "args": {"model": "m"}}]}))
    assert load_serve_config(str(path)).deployment_options == {}


def test_resources_no_node_advertises_are_named():
    """A serve config generated for KubeRay / the cluster launcher asks the replica for the target node's
    saguaro_front; on a cluster without it Serve waited without a word: `saguaro serve --config` now warns, naming them."""
    from saguaro_dist.serve.app import unadvertised_resources
    options = {"ray_actor_options": {"num_cpus": 1, "resources": {"saguaro_front": 1, "saguaro_target": 1}}}
    assert unadvertised_resources(options, {"CPU": 4.0, "saguaro_target": 1.0}) == ["saguaro_front"]
    assert unadvertised_resources(options, {"saguaro_front": 1.0, "saguaro_target": 1.0}) == []
    assert unadvertised_resources({"ray_actor_options": {"num_cpus": 1}}, {}) == []
    assert unadvertised_resources({}, {}) == []


def test_serve_takes_build_app_as_an_application_builder(serving_pair):
    """Serve calls a config's import_path builder with the args dict alone and refuses any function of another
    signature: build_app(args, **deployment_options) made every serve config (KubeRay's serveConfigV2, `serve deploy`,
    `serve run saguaro_dist.serve.app:build_app model=...`) fail to deploy."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    app = call_user_app_builder_with_args_if_necessary(build_app, {"model": serving_pair[0], "mode": "ar"})
    assert app._bound_deployment.name == DEPLOYMENT_NAME
