"""How HTTP reaches the replica: through Serve's proxy, or straight to the replica (Serve's direct ingress).

Why direct: the proxy is a second Python process on every request's path. It forwards each request
to the replica, and the replica calls back for the body. Each SSE chunk then goes replica -> proxy
-> client. On a box whose cores the engine already fills, that costs the engine its time (measured
in docs/serving.md). With direct ingress, Serve starts an HTTP server inside the ingress replica,
and clients talk to it.

Serve reads these settings from the environment of its controller and replicas. So they must be
set before Ray starts: an embedded cluster inherits them, and a joined cluster keeps its own.
"""
from __future__ import annotations

import enum
import errno
import os
import socket


class Ingress(str, enum.Enum):
    AUTO = "auto"      # direct for an embedded cluster with one replica, else the proxy
    DIRECT = "direct"  # the replica's own HTTP server answers on the port
    PROXY = "proxy"    # Serve's proxy answers on the port and forwards to the replica


def resolve(ingress: Ingress, embedded: bool, num_replicas: int | str) -> Ingress:
    """The ingress to run. Direct needs the environment of a cluster we start ourselves, and a
    single replica: one port, one server, and no load balancer in front."""
    if ingress is Ingress.AUTO:
        return Ingress.DIRECT if embedded and num_replicas == 1 else Ingress.PROXY
    if ingress is Ingress.DIRECT and not embedded:
        raise ValueError("--ingress direct needs the embedded cluster (no --address): Serve reads it from "
                         "the environment Ray starts with")
    if ingress is Ingress.DIRECT and num_replicas != 1:
        raise ValueError(f"--ingress direct serves one replica on one port; the config asks for {num_replicas!r} replicas "
                         "(use --ingress proxy, or a load balancer in front of the replicas' ports)")
    return ingress


def replica_count(deployment_options: dict) -> int | str:
    """Replicas the deployment asks for; "auto" when an autoscaling config may add more."""
    if "autoscaling_config" in deployment_options:
        return "auto"
    return deployment_options.get("num_replicas", 1)


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment under which Serve's one ingress replica serves HTTP on `port` itself.
    No drain period: nothing stands in front of a local server that needs time to deregister it."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # a half-open range: exactly `port`
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def enable_direct_ingress(port: int) -> None:
    """Call before ray.init starts the cluster (its processes inherit this environment)."""
    os.environ.update(direct_ingress_env(port))


def _family(host: str) -> socket.AddressFamily:
    """The socket family Serve binds `host` with (an IPv6 literal such as "::" or "::1", else IPv4)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port_free(host: str, port: int) -> None:
    """A clear error now, rather than a replica or proxy that fails to bind after Ray has started."""
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as err:  # in use: another port; not an address of this machine (or not one at all): the host
            hint = "choose another --port" if err.errno == errno.EADDRINUSE else "check --host"
            raise ValueError(f"cannot serve on {host_port(host, port)}: {err.strerror or err} ({hint})") from None


def host_port(host: str, port: int) -> str:
    """host:port as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if _family(host) is socket.AF_INET6 else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for the proxy when the replica takes the public one."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
