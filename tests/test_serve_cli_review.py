"""`saguaro serve` and the Serve app's arguments at their edges: stopping while the replica is not up yet, IPv6
hosts, and manifest values that could only fail every request. Real subprocesses, a real embedded Ray
cluster, real HTTP. (A server answering on an IPv6 host: tests/test_cli_serve.py's direct-ingress run.)"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from saguaro_dist.serve.app import APP_IMPORT_PATH, DEPLOYMENT_NAME, build_app, build_deployment
from saguaro_dist.serve.ingress import check_port_free, free_port
from test_serve_fixtures import ipv6_loopback

pytest_plugins = ["test_serve_fixtures"]


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")


def saguaro_serve(*flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "import sys; from saguaro_dist.cli import main; sys.exit(main())", "serve", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float = 180) -> list[str]:
    """The output lines up to one containing `text` (the process must not end first)."""
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError("saguaro serve exited early:\n" + "".join(lines[-60:]))
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no {text!r} in time:\n" + "".join(lines[-60:]))


@needs_ipv6
def test_an_ipv6_host_is_checked_as_ipv6():
    """Serve binds "::" / "::1" over IPv6; the port check tried them as IPv4 and refused every IPv6 host."""
    port = free_port("::1")
    check_port_free("::1", port)
    check_port_free("::", port)
    with socket.socket(socket.AF_INET6) as busy:
        busy.bind(("::1", port))
        busy.listen()
        with pytest.raises(ValueError, match=rf"cannot serve on \[::1\]:{port}: .*choose another --port"):
            check_port_free("::1", port)


@pytest.mark.parametrize("value", [-1, 0, "-5", "lots", 2.5])
def test_a_request_size_limit_below_one_byte_is_refused_at_deploy(serving_pair, value):
    """A manifest's max_request_bytes of 0 or less deployed, and the app then answered every request with a
    body 413; the CLI's --max-request-bytes already refused it."""
    with pytest.raises(ValueError, match="max_request_bytes must be an integer >= 1"):
        build_app({"model": serving_pair[0], "mode": "ar", "max_request_bytes": value})


@pytest.mark.slow
def test_a_stop_while_the_replica_cannot_start_ends_the_server(serving_pair, tmp_path):
    """serve.run waits for the replica (a model loading, or here one Ray cannot place): Kubernetes' SIGTERM,
    or Ctrl-C, set a flag nobody read until the replica was up, so the server never stopped. (The stop no longer
    waits Serve's 20 s graceful stop of a replica that never started: cli/serve.py _shutdown; no timing asserted.)
    SIGTERM only: SIGINT takes the same handler (cli/serve.py _stop_on_signals), and a flag-setting handler would
    be installed for both; the serving tests stop with SIGINT. (A second server start cost ~30 s.)"""
    config = tmp_path / "unplaceable.yaml"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "saguaro", "route_prefix": "/", "import_path": APP_IMPORT_PATH,
        "args": {"model": serving_pair[0], "mode": "ar", "max_model_len": 256},
        "deployments": [{"name": DEPLOYMENT_NAME, "ray_actor_options": {"resources": {"no_such_node": 1}}}]}]}))
    proc = saguaro_serve("--config", str(config), "--port", str(free_port()), "--num-cpus", "2")
    try:
        # build_deployment's warning of the unplaceable replica: serve.run's wait for it follows at once
        wait_for_line(proc, "which no node of this Ray cluster advertises")
        time.sleep(1)  # into that wait
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-3000:]  # a stop asked for, as one while serving
    assert "shutting down" in output and "Traceback" not in output, output[-3000:]
    assert "serving '" not in output  # it never served


@pytest.mark.parametrize("given, want", [({"min_replicas": 1, "max_replicas": 3}, 6.0),
                                         ({"max_replicas": 3, "target_ongoing_requests": 20}, 20.0)])
def test_autoscaling_targets_a_full_batch_per_replica(serving_pair, given, want):
    """Serve's default target (2 ongoing requests a replica) started another replica, a whole engine, at the
    third concurrent request, while a replica batches max_batch_size; a target the config sets is kept."""
    app = build_deployment({"model": serving_pair[0], "mode": "ar", "max_batch_size": 6}, autoscaling_config=given)
    config = app._bound_deployment._deployment_config.autoscaling_config  # what Serve deploys
    assert config.target_ongoing_requests == want and config.max_replicas == 3
