"""Autoscaling set in a Serve config's own `deployments:` section (`serve deploy`, `serve run config.yaml`,
KubeRay's serveConfigV2): Serve applies it after build_app, its autoscaling_config replacing the app's whole, so
Serve's default target of 2 requests per replica applies unless the file names one, and no app code can raise it.
Each replica then says so in its log, naming the setting that keeps its batch from filling."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from saguaro_dist.serve.app import DEPLOYMENT_NAME, build_deployment, unfillable_batch

pytest_plugins = ["test_serve_fixtures"]

# Run in a fresh Python with its own Ray: a config deploy (Serve's declarative API) would replace the session's
# imperatively deployed apps. The same call `serve run config.yaml` makes (client.deploy_apps).
DEPLOY_SCRIPT = r"""
import glob, json, sys, time
import ray
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

config, port = json.loads(sys.argv[1]), int(sys.argv[2])
ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": port})
client = _get_global_client()
client.deploy_apps(ServeDeploySchema(**config), _blocking=True)
names = [app["name"] for app in config["applications"]]
details = client.get_serve_details()["applications"]
logs = ray._private.worker._global_node.get_logs_dir_path() + "/serve"
out = {}
for name in names:
    deployment = details[name]["deployments"][sys.argv[3]]
    text = "".join(open(p).read() for p in glob.glob(f"{logs}/replica_{name}_*.log"))
    out[name] = {"status": details[name]["status"], "config": deployment["deployment_config"],
                 "warned": [line for line in text.splitlines() if "below the engine's max_batch_size" in line]}
print("RESULT " + json.dumps(out))
serve.shutdown()
ray.shutdown()
"""


def app_config(name: str, args: dict, deployment: dict) -> dict:
    return {"name": name, "route_prefix": f"/{name}", "import_path": "saguaro_dist.serve.app:build_app",
            "args": args, "deployments": [{"name": DEPLOYMENT_NAME, **deployment}]}


@pytest.fixture(scope="module")
def deployed(serving_pair):
    """The effective deployment config and replica warnings of apps deployed from one Serve config."""
    from saguaro_dist.serve.ingress import free_port

    args = {"model": serving_pair[0], "mode": "ar", "max_batch_size": 16, "max_model_len": 128}
    config = {"applications": [
        app_config("scaled", args, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}),
        app_config("targeted", args, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                                             "target_ongoing_requests": 16}}),
        app_config("fixed", args, {"num_replicas": 1})]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", DEPLOY_SCRIPT, json.dumps(config), str(free_port()),
                           DEPLOYMENT_NAME], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_a_config_autoscaling_without_a_target_is_named_in_the_replica_log(deployed):
    scaled = deployed["scaled"]
    assert scaled["status"] == "RUNNING"
    assert scaled["config"]["autoscaling_config"]["target_ongoing_requests"] == 2  # Serve's default, as Serve runs it
    assert scaled["config"]["max_ongoing_requests"] == 256  # the app's, which the config left unset
    assert len(scaled["warned"]) == 1, scaled["warned"]
    assert "target_ongoing_requests 2" in scaled["warned"][0] and "target_ongoing_requests: 16" in scaled["warned"][0]


@pytest.mark.slow
def test_a_full_batch_target_or_fixed_replicas_say_nothing(deployed):
    assert deployed["targeted"]["config"]["autoscaling_config"]["target_ongoing_requests"] == 16
    fixed = deployed["fixed"]["config"]
    assert fixed["num_replicas"] == 1 and fixed["max_ongoing_requests"] == 256
    assert deployed["targeted"]["warned"] == [] and deployed["fixed"]["warned"] == []


def test_settings_below_a_full_batch_are_found(serving_pair):
    args = {"model": serving_pair[0], "mode": "ar", "max_batch_size": 16}

    def found(**options):
        return unfillable_batch(build_deployment(args, **options)._bound_deployment._deployment_config, 16)
    assert found() == [] and found(autoscaling_config={"max_replicas": 2}) == []  # ours: a full batch
    assert found(autoscaling_config={"max_replicas": 2, "target_ongoing_requests": 4}) == [
        "autoscaling_config.target_ongoing_requests 4"]
    assert found(max_ongoing_requests=8) == ["max_ongoing_requests 8"]
