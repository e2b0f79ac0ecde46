"""The engine on a Ray cluster: target ranks in a placement group, a pool of draft actors, and the
driver-side RemoteEngine that LLM talks to (same surface as the one-host EngineThread)."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import ray

from saguaro_dist.config import Config
from saguaro_dist.distributed.actors import DraftActor, TargetRank
from saguaro_dist.distributed.placement import (draft_options, engine_needs, local_cpus_needed, rank_strategy,
                                                 shortfall, target_bundle, target_placement)
from saguaro_dist.distributed.remote import RemoteRequest, RemoteUpdate
from saguaro_dist.engine.engine import Update
from saguaro_dist.engine.loop_thread import EngineError, deliver
from saguaro_dist.engine.metrics import EngineLoad
from saguaro_dist.engine.sequence import FinishReason, SeqStatus

log = logging.getLogger(__name__)
POLL_S = 0.2
SUBMIT_CHUNK = 1024  # requests per submit call: a large offline batch starts before all of it has crossed
SUBMIT_SETTLE_S = 10.0  # an interrupted submit waits this long for its call to land before its aborts go
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
    context = ray.get_runtime_context()
    return context.gcs_address, context.get_job_id()


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
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_cpus_needed), include_dashboard=False,
                 log_to_driver=False, configure_logging=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    else:
        ray.init(address=cluster, log_to_driver=False)  # "auto" or "ray://host:port": the cluster sizes itself


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

    def kill(self) -> None:
        """Free everything, once (a second call does nothing). Every Ray call here is guarded: after
        ray.shutdown() any of them would start a fresh Ray of Ray's defaults (its auto-init), only to fail."""
        if self.killed:
            return
        self.killed = True
        try:
            if ray.is_initialized():  # else the actors and the placement group went with the driver's Ray
                self._free()
        finally:
            if self.started_ray:
                release_ray()

    def _free(self) -> None:
        if self.serving and self.drafts:  # close the gRPC servers first, so their ports are free when we return
            # ray.wait, not ray.get: one dead draft's error must not skip the other drafts' stops. A draft never
            # placed (start-up failed) has no server, and its stop would only wait out the timeout.
            try:
                ray.wait([d.stop.remote() for d in self.drafts], num_returns=len(self.drafts), timeout=10)
            except Exception as err:  # noqa: BLE001 - handles of a Ray session that has gone
                log.debug("draft stop: %r", err)
        for actor in self.ranks + self.drafts:
            try:
                ray.kill(actor, no_restart=True)
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
                ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
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


def build_cluster_engine(config: Config):
    """Start the actors and the engine on rank 0; returns (RemoteEngine, tokenizer)."""
    from saguaro_dist.engine.build import fit_draft, target_tokenizer
    tokenizer = target_tokenizer(config)
    fit = fit_draft(config, tokenizer) if config.uses_draft else None  # a bad pair fails before Ray starts
    deployment = Deployment(started_ray=connect(config.cluster, local_cpus_needed(config)))
    deadline = time.monotonic() + config.startup_timeout_s
    try:
        resources = ray.cluster_resources()
        warn_if_short(config, resources)
        deployment.drafts = start_drafts(config, resources, fit)
        deployment.placement_group = target_placement(config, resources, max(0.0, deadline - time.monotonic()))
        deployment.ranks = start_ranks(config, resources, deployment.placement_group)
        endpoints = started([d.endpoint.remote() for d in deployment.drafts], deadline,
                            f"{config.num_draft_workers} draft worker(s) asking {draft_options(config, resources)} each")
        deployment.serving = True
        master = started(deployment.ranks[0].rendezvous.remote(), deadline, "target rank 0")
        info = started([r.setup.remote(master, endpoints, fit, deployment.drafts) for r in deployment.ranks], deadline,
                       f"{config.tensor_parallel_size} target rank(s) loading {config.model}")[0]
    except BaseException:
        deployment.kill()
        raise
    return RemoteEngine(deployment, info), tokenizer


def warn_if_short(config: Config, resources: dict) -> None:
    """Say at once when the free resources cannot host the engine's actors (another engine holds them, a
    label no node has): start-up would otherwise wait startup_timeout_s in silence before failing."""
    short = shortfall(engine_needs(config, resources), ray.available_resources())
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


def remote_request(seq) -> RemoteRequest:
    return RemoteRequest(seq.seq_id, seq.request_id, seq.prompt_token_ids, seq.params, seq.output_kind,
                         seq.stream_interval_s, seq.priority)


class RemoteEngine:
    """Driver side: submits to rank 0 and routes its updates to each request's listener."""

    def __init__(self, deployment: Deployment, info: dict):
        self.deployment, self.rank0 = deployment, deployment.ranks[0]
        self.vocab_size, self.max_model_len = info["vocab_size"], info["max_model_len"]
        self.eos_token_ids = frozenset(info["eos_token_ids"])
        self.draft_addresses: list[str] = info["draft_addresses"]  # as rank 0 dials them
        self._requests: dict[str, tuple] = {}   # request_id -> (Sequence, listener)
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._dead_cause: BaseException | None = None  # what told us (the RayActorError): every later error's cause
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._last_metrics = None  # rank 0's, fetched as the engine stops: readable after it, as on one host
        self.load = EngineLoad()  # rank 0's, as of its last poll (at most POLL_S old while it runs)
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name="saguaro-remote-poll")
        self._poller.start()

    def _ask(self, method, *args):
        """ray.get(method.remote(*args)) of rank 0, its death an EngineError (the RayActorError its cause)."""
        if self._stopped.is_set() or not ray.is_initialized():  # a Ray call now would start a fresh Ray (auto-init)
            raise EngineError("the engine is shut down")
        if self._dead:
            raise self._gone()
        try:
            return ray.get(method.remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as err:
            self._died(f"target actor died: {err.__class__.__name__}", err)
            raise self._gone() from err

    def _died(self, why: str, cause: BaseException | None) -> None:
        if not self._dead:
            self._dead, self._dead_cause = why, cause

    def _gone(self) -> EngineError:
        err = EngineError(f"the target is gone ({self._dead}); call LLM.rebuild()")
        err.__cause__ = self._dead_cause
        return err

    @property
    def metrics(self):
        if self._stopped.is_set() and self._last_metrics is not None:
            return self._last_metrics
        return self._ask(self.rank0.metrics)

    def draft_node_ids(self) -> list[str]:
        return ray.get([d.node_id.remote() for d in self.deployment.drafts])

    def target_node_ids(self) -> list[str]:
        return ray.get([r.node_id.remote() for r in self.deployment.ranks])

    def check_health(self) -> None:
        """Raise EngineError once the target is gone (its actors died: LLM.rebuild(), or a fresh replica) or the
        engine was shut down. A draft worker's death is not fatal: the pool goes on without it."""
        if self._stopped.is_set():
            raise EngineError("the engine is shut down")
        if self._dead:
            raise self._gone()
        if not self._poller.is_alive():
            raise EngineError("the engine is shut down")

    def submit(self, seq, listener) -> None:
        self.submit_many([(seq, listener)])

    def submit_many(self, requests: list[tuple]) -> None:
        """(Sequence, listener) pairs, SUBMIT_CHUNK to an actor call; blocking, so an abort sent after it
        (another call to a threaded actor) cannot overtake it."""
        for start in range(0, len(requests), SUBMIT_CHUNK):
            self._submit_chunk(requests[start:start + SUBMIT_CHUNK])

    def _submit_chunk(self, requests: list[tuple]) -> None:
        with self._submitting(requests) as call:
            try:
                self._wait_submitted(call)
            except KeyboardInterrupt:  # Ctrl-C mid-call: the chunk is on its way; the caller's aborts must not overtake it
                ray.wait([call], timeout=SUBMIT_SETTLE_S)
                raise

    @staticmethod
    def _wait_submitted(call) -> None:
        ray.get(call)

    async def submit_async(self, seq, listener) -> None:
        """submit, for an event loop (LLM.stream on a Serve replica): the actor call is awaited, so the
        loop goes on streaming other requests' deltas meanwhile (a blocking ray.get held it ~2-3 ms)."""
        with self._submitting([(seq, listener)]) as call:
            await call

    @contextlib.contextmanager
    def _submitting(self, requests: list[tuple]):
        """Register the requests' listeners, then yield rank 0's submit call to wait on; a dead target
        (known before, or found by the call) raises the retriable EngineError with nothing registered, its
        cause the RayActorError. A stopped engine refuses as the one-host engine does (no Ray call: after
        ray.shutdown() one would start a fresh Ray)."""
        if self._stopped.is_set() or not ray.is_initialized():
            raise EngineError("the engine is shut down")
        if self._dead:
            raise self._gone()
        with self._lock:
            self._requests.update((seq.request_id, (seq, listener)) for seq, listener in requests)
        try:
            yield self.rank0.submit.remote([remote_request(seq) for seq, _ in requests])
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as err:
            with self._lock:
                for seq, _ in requests:
                    self._requests.pop(seq.request_id, None)
            if self._stopped.is_set():  # shut down under the call: the engine's own error, not a death
                raise EngineError("the engine is shut down") from err
            self._died(f"target actor died: {err.__class__.__name__}", err)
            raise EngineError(f"{self._dead}; the request can be retried after LLM.rebuild()") from err

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        """Fire and forget; nothing to abort once the target is gone or the engine stopped (their requests
        were failed), and no Ray call after ray.shutdown() (it would start a fresh Ray)."""
        if not self._dead and not self._stopped.is_set() and request_ids and ray.is_initialized():
            self.rank0.abort.remote(request_ids)

    def reset_prefix_cache(self) -> None:
        self.check_health()
        self._ask(self.rank0.reset_prefix_cache)

    def stop(self) -> None:
        """Free everything (actors, gRPC servers, the placement group, the poll thread, a Ray this process
        started once no engine holds it); requests still running fail with EngineError, as on one host.
        Calling it again does nothing."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
        try:
            if not self._dead and ray.is_initialized():
                try:
                    self._last_metrics = ray.get(self.rank0.metrics.remote(), timeout=5)
                except Exception as err:  # noqa: BLE001 - only the metrics after shutdown go without them
                    log.debug("rank 0's last metrics: %r", err)
                try:
                    ray.get(self.rank0.shutdown.remote(), timeout=30)
                except Exception as err:  # noqa: BLE001 - we are tearing down either way
                    log.warning("rank 0 did not shut down cleanly: %r", err)
            self._poller.join(timeout=5)
        finally:
            # Their updates stopped with the poll thread: without this, a generate() or stream() in flight on
            # another thread waited forever.
            self._fail_requests(EngineError, "the engine was shut down")
            self.deployment.kill()

    def _poll_loop(self) -> None:
        while not self._stopped.is_set():
            if not ray.is_initialized():  # someone shut Ray down: a Ray call would start a fresh one (auto-init)
                self._fail_all("Ray was shut down under the engine")
                return
            try:
                polled = ray.get(self.rank0.poll.remote(POLL_S))
            except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as err:
                if not self._stopped.is_set():
                    self._fail_all(f"target actor died: {err.__class__.__name__}", err)
                return
            except Exception as err:  # noqa: BLE001 - with this thread gone no request would ever finish
                log.exception("polling the target's rank 0 failed")
                self._fail_all(f"polling the target failed: {err!r}", err)
                return
            self.load = polled.load
            for u in polled.updates:
                self._dispatch(u)

    def _dispatch(self, u: RemoteUpdate) -> None:
        with self._lock:
            entry = self._requests.pop(u.request_id, None) if u.finished else self._requests.get(u.request_id)
        if entry is None:
            return
        seq, listener = entry
        if u.error:
            deliver(listener, ValueError(u.error) if u.invalid else EngineError(u.error))
            return
        seq.output_token_ids += u.token_delta
        seq.output_logprobs += u.logprobs_delta or []
        seq.prompt_logprobs = u.prompt_logprobs or seq.prompt_logprobs
        seq.text += u.text_delta
        if u.finished:
            seq.status, seq.finish_reason, seq.metrics = SeqStatus.FINISHED, FinishReason(u.finish_reason), u.metrics
            seq.stop_reason = u.stop_reason
        update = Update(seq, u.text_delta, u.token_delta, u.finished, u.logprobs_delta, u.prompt_logprobs)
        if not deliver(listener, update) and not u.finished:  # nobody is listening: free the slot
            with self._lock:
                self._requests.pop(u.request_id, None)
            self.abort(u.request_id)

    def _fail_all(self, why: str, cause: BaseException | None = None) -> None:
        self._died(why, cause)
        self._fail_requests(EngineError, f"{why}; the request can be retried after LLM.rebuild()", cause)

    def _fail_requests(self, error: type, message: str, cause: BaseException | None = None) -> None:
        """Every registered request learns `error(message)` (each its own instance, chained to `cause`)."""
        with self._lock:
            entries, self._requests = list(self._requests.values()), {}
        for _, listener in entries:
            err = error(message)
            err.__cause__ = cause
            deliver(listener, err)
