"""The cluster engine's Ray side: this process's Ray connection (shared by its engines, closed by the last one),
the Deployment that frees what an engine took, and the start-up steps (actors placed, by the start-up deadline).
RemoteEngine and build_cluster_engine (cluster.py) run on them."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from saguaro_dist.config import Config
from saguaro_dist.distributed.actors import DraftActor, TargetRank
from saguaro_dist.distributed import ray_calls
from saguaro_dist.distributed.placement import draft_options, engine_needs, rank_strategy, shortfall, target_bundle
from saguaro_dist.engine.serial_thread import SerialThread

log = logging.getLogger(__name__)

# The embedded cluster (cluster="local") runs our actors and nothing else, on cores the model needs.
# Ray's defaults suit a shared cluster: idle workers prestarted for tasks (each wakes ~100 times a
# second), metrics and task events reported every few seconds, resources every 100 ms. Measured on a
# 2-core box, an idle embedded Ray slowed a one-host engine beside it by ~7% with its defaults, ~4% with
# these (its own actors ran no faster or slower).
LOCAL_RAY_SYSTEM_CONFIG = {
    "enable_worker_prestart": False, "prestart_worker_first_driver": False,
    "enable_metrics_collection": False, "event_stats": False,
    "raylet_report_resources_period_milliseconds": 1000, "task_events_report_interval_ms": 5000,
    "metrics_report_interval_ms": 60000,
}


# The Ray connection the engines of this process opened (ray.init: a Ray of their own for cluster="local", a join of
# "auto" / "ray://..."): every engine on it holds it (an engine that finds it open joins it, as it joins a Ray the
# user initialised), and the last one to stop closes it: ray.shutdown() stops a Ray of our own, and disconnects
# this process from a cluster it joined (the cluster runs on). Closing it with the first engine's stop took every
# other engine of the process down with it; never closing a join left the process a driver of that cluster.
_ray_lock = threading.Lock()
_ray_opened: tuple | None = None  # _ray_identity() of that connection; None: the engines opened none
_ray_holders = 0


def _ray_identity() -> tuple:
    """This process's connection to Ray: the cluster, and the job ray.init gave this driver (each ray.init a
    new one, so a Ray the user shut down and joined again is not taken for ours). Ray Client answers too."""
    return ray_calls.current_ray()


def connect(cluster: str, num_cpus_needed: int) -> bool:
    """Join or start Ray; returns whether this engine holds a connection this process's engines opened
    (release_ray() then lets it go: the last holder closes it). A Ray the user initialised is theirs to close."""
    global _ray_opened, _ray_holders
    with _ray_lock:
        if ray.is_initialized():
            if _ray_opened is not None and _ray_opened == _ray_identity():
                _ray_holders += 1
                return True
            _ray_opened = None  # (stopped and started again by someone else since: not ours)
            if cluster not in ("local", "auto"):
                log.warning("Ray is already initialized in this process: the engine runs on that Ray, not on "
                            "cluster=%r (as ray.init ignores a second call's settings)", cluster)
            return False
        _open_ray(cluster, num_cpus_needed)
        _ray_opened, _ray_holders = _ray_identity(), 1
        return True


def _open_ray(cluster: str, num_cpus_needed: int) -> None:
    if cluster == "local":
        # address="local": a new Ray of our own even where RAY_ADDRESS is set or `ray start` ran on this host;
        # without it ray.init joined that cluster, and refused the num_cpus and system config (a ValueError).
        _RAY_PARENT.run(lambda: ray.init(
            address="local", num_cpus=max(os.cpu_count() or 1, num_cpus_needed), include_dashboard=False,
            log_to_driver=False, configure_logging=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG))
    else:
        ray.init(address=cluster, log_to_driver=False)  # "auto" or "ray://host:port": the cluster sizes itself


class _LastingThread:
    """Runs calls on the main thread where they come from it, else on one daemon thread that lives as long as
    the process. Why: ray.init's daemons (GCS, raylet) die with the *thread* that started them (Linux's
    PR_SET_PDEATHSIG follows the creating thread, prctl(2)). An embedded Ray started on a thread that then
    ended (a pool's worker, a web framework's start-up hook) lost them at once: the engine's actors still
    answered, but ray.kill, new actors and health checks waited on the gone GCS, and after a minute Ray ended
    the whole process."""

    def __init__(self):
        self._thread = SerialThread("saguaro-ray-parent")  # never shut down: it parents Ray's daemons

    def run(self, call: Callable[[], object]) -> object:
        if threading.current_thread() is threading.main_thread():
            return call()
        return self._thread.submit(call).result()


_RAY_PARENT = _LastingThread()  # the parent thread of the Ray daemons this process starts off its main thread


def release_ray() -> None:
    """One holder of the connection this process's engines opened lets it go; the last one closes it."""
    global _ray_opened, _ray_holders
    with _ray_lock:
        if _ray_opened is None:
            return
        if not ray.is_initialized() or _ray_identity() != _ray_opened:  # someone closed it already
            _ray_opened, _ray_holders = None, 0
            return
        _ray_holders -= 1
        if _ray_holders <= 0:
            _ray_opened, _ray_holders = None, 0
            ray.shutdown()


@dataclass
class Deployment:
    """Everything the cluster engine holds, so shutdown can free all of it."""
    ranks: list = field(default_factory=list)
    drafts: list = field(default_factory=list)
    placement_group: object = None
    started_ray: bool = False  # it holds the engines' own Ray connection (connect): released once freed
    serving: bool = False      # the drafts answered their endpoints: their gRPC servers run
    killed: bool = False
    ray: tuple | None = field(default_factory=ray_calls.current_ray)  # the Ray it lives in (connected before it)

    def kill(self) -> None:
        """Free everything, once (a second call does nothing). Every Ray call here is guarded: after
        ray.shutdown() any of them would start a fresh Ray of Ray's defaults (its auto-init), only to fail."""
        if self.killed:
            return
        self.killed = True
        try:
            # Else the actors and the placement group went with the Ray they lived in. A Ray started again since
            # is another: calls to its handles there waited a minute on the gone Ray's GCS, then ended the process.
            if ray_calls.current_ray() == self.ray:
                self._free()
        finally:
            if self.started_ray:
                release_ray()

    def _free(self) -> None:
        if self.serving and self.drafts:  # close the gRPC servers first, so their ports are free when we return
            # ray.wait, not ray.get: one dead draft's error must not skip the other drafts' stops. A draft never
            # placed (start-up failed) has no server, and its stop would only wait out the timeout.
            try:
                ray_calls.wait([ray_calls.call(d.stop) for d in self.drafts], num_returns=len(self.drafts), timeout=10)
            except Exception as err:  # noqa: BLE001 - handles of a Ray session that has gone
                log.debug("draft stop: %r", err)
        for actor in self.ranks + self.drafts:
            try:
                ray_calls.kill(actor, no_restart=True)
            except Exception as err:  # noqa: BLE001 - a handle of a Ray session that has gone: nothing to free
                log.debug("ray.kill: %r", err)
        wait_dead(self.ranks + self.drafts)
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception as err:  # noqa: BLE001
                log.debug("remove_placement_group: %r", err)


DRAFT_MAX_RESTARTS = 8  # Ray restarts a draft actor that died (its process, its node) this often; the pool
                        # takes it back at its new address (TargetRank._revive_draft). Past that it stays dead.


def wait_dead(actors: list, timeout_s: float = 10.0) -> None:
    """ray.kill is asynchronous: a call made right after it could still reach the actor (a test saw
    one answer). Shutdown returns once every actor refuses calls, or after timeout_s with a warning."""
    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while time.monotonic() < deadline:
            try:
                ray_calls.get(ray_calls.call(actor.__ray_ready__), timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError):  # gone, or Ray is (with them)
                break
            except ray.exceptions.GetTimeoutError:  # hung, not yet gone: the deadline decides
                continue
            time.sleep(0.02)
        else:
            log.warning("an actor still answered %.0f s after ray.kill", timeout_s)
            return


def start_drafts(config: Config, resources: dict, fit) -> list:
    if not config.uses_draft:
        return []
    actor = ray.remote(DraftActor).options(**draft_options(config, resources), max_restarts=DRAFT_MAX_RESTARTS)
    return [actor.remote(config, fit) for _ in range(config.num_draft_workers)]


def start_ranks(config: Config, resources: dict, pg) -> list:
    bundle = target_bundle(config, resources)
    opts = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}, "max_concurrency": 8}
    cls = ray.remote(TargetRank)
    return [cls.options(**opts, scheduling_strategy=rank_strategy(pg, r)).remote(config, r)
            for r in range(config.tensor_parallel_size)]


FREED_RESOURCES_WAIT_S = 3.0  # how long a shortfall may take to go before it is warned of


def warn_if_short(config: Config, resources: dict) -> None:
    """Say at once when the free resources cannot host the engine's actors (another engine holds them, a
    label no node has): start-up would otherwise wait startup_timeout_s in silence before failing."""
    need = engine_needs(config, resources)
    short = shortfall(need, ray.available_resources())
    # Actors just killed (LLM.rebuild, an engine stopped a moment ago) give their resources back a moment later
    # (the raylet reports them at most every second): only a shortfall that outlasts that is worth a warning.
    # One the cluster's totals cannot cover (no GPU, a label no node has) never goes: it is told at once.
    deadline = time.monotonic() + (0.0 if shortfall(need, resources) else FREED_RESOURCES_WAIT_S)
    while short and time.monotonic() < deadline:
        time.sleep(0.1)
        short = shortfall(need, ray.available_resources())
    if short:
        log.warning("the cluster lacks %s free for this engine's actors; start-up waits up to "
                    "startup_timeout_s (%.0f s) for them", short, config.startup_timeout_s)


def started(refs, deadline: float, what: str):
    """ray.get for a start-up step, by the start-up deadline: an actor that no node can host waits for
    resources forever (Ray only logs it), and the caller deserves an error, not a hang."""
    try:
        return ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"{what}: not started within startup_timeout_s. Can the cluster host them? "
                           f"Free now: {ray.available_resources()}") from None
    except ray.exceptions.RayActorError as err:  # its constructor raised (say weights that cannot load), or it was killed
        raise RuntimeError(f"{what}: an actor died while starting: {err}") from err
