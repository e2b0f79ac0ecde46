"""Which ingress `saguaro serve` runs, and the environment that makes Serve's replica answer on a port."""
from __future__ import annotations

import socket

import pytest

from saguaro_dist.serve.ingress import Ingress, direct_ingress_env, replica_count, resolve

pytest_plugins = ["test_serve_fixtures"]


@pytest.mark.parametrize("embedded, replicas, want", [(True, 1, Ingress.DIRECT), (False, 1, Ingress.PROXY),
                                                      (True, 2, Ingress.PROXY), (True, "auto", Ingress.PROXY)])
def test_auto_is_direct_only_for_one_replica_on_an_embedded_cluster(embedded, replicas, want):
    assert resolve(Ingress.AUTO, embedded, replicas) is want


def test_an_explicit_choice_is_kept():
    assert resolve(Ingress.PROXY, True, 1) is Ingress.PROXY
    assert resolve(Ingress.DIRECT, True, 1) is Ingress.DIRECT


@pytest.mark.parametrize("embedded, replicas, message", [(False, 1, "embedded cluster"), (True, 3, "asks for 3")])
def test_direct_where_it_cannot_work_is_a_clear_error(embedded, replicas, message):
    with pytest.raises(ValueError, match=message):
        resolve(Ingress.DIRECT, embedded, replicas)


def test_direct_env_allocates_exactly_the_port_without_a_drain():
    env = direct_ingress_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve allocates from range(min, max): exactly one port
    assert list(range(int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]),
                      int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]))) == [8123]
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) == 0


def test_a_busy_port_is_a_clear_error_before_ray_starts(capsys, serving_pair):
    from saguaro_dist.cli import main
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", serving_pair[0], "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and "Traceback" not in err


@pytest.mark.parametrize("options, want", [({}, 1), ({"num_replicas": 3}, 3),
                                           ({"autoscaling_config": {"max_replicas": 4}}, "auto")])
def test_replica_count_of_a_config(options, want):
    assert replica_count(options) == want
