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
from saguaro_dist.distributed.placement import (draft_options, engine_needs, rank_strategy, shortfall, target_bundle,
                                                 target_placement)
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


def connect(cluster: str, num_cpus_needed: int) -> bool:
    """Join or start Ray; returns whether this process started it (and so must stop it)."""
    if ray.is_initialized():
        return False
    if cluster == "local":
        ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus_needed), include_dashboard=False,
                 log_to_driver=False, configure_logging=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
        return True
    ray.init(address=cluster, log_to_driver=False)  # "auto" or "ray://host:port"
    return False


@dataclass
class Deployment:
    """Everything the cluster engine holds, so shutdown can free all of it."""
    ranks: list = field(default_factory=list)
    drafts: list = field(default_factory=list)
    placement_group: object = None
    started_ray: bool = False

    def kill(self) -> None:
        try:  # close the gRPC servers first, so their ports are free when we return
            ray.get([d.stop.remote() for d in self.drafts], timeout=10)
        except Exception as err:  # noqa: BLE001 - dead actors have nothing left to close
            log.debug("draft stop: %r", err)
        for actor in self.ranks + self.drafts:
            ray.kill(actor, no_restart=True)
        wait_dead(self.ranks + self.drafts)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        if self.started_ray:
            ray.shutdown()


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
    needed = config.tensor_parallel_size + config.num_draft_workers + 1
    deployment = Deployment(started_ray=connect(config.cluster, needed))
    deadline = time.monotonic() + config.startup_timeout_s
    try:
        resources = ray.cluster_resources()
        warn_if_short(config, resources)
        deployment.drafts = start_drafts(config, resources, fit)
        deployment.placement_group = target_placement(config, resources, config.startup_timeout_s)
        deployment.ranks = start_ranks(config, resources, deployment.placement_group)
        endpoints = started([d.endpoint.remote() for d in deployment.drafts], deadline,
                            f"{config.num_draft_workers} draft worker(s) asking {draft_options(config, resources)} each")
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
        self._stopped = threading.Event()
        self.load = EngineLoad()  # rank 0's, as of its last poll (at most POLL_S old while it runs)
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name="saguaro-remote-poll")
        self._poller.start()

    @property
    def metrics(self):
        return ray.get(self.rank0.metrics.remote())

    def draft_node_ids(self) -> list[str]:
        return ray.get([d.node_id.remote() for d in self.deployment.drafts])

    def target_node_ids(self) -> list[str]:
        return ray.get([r.node_id.remote() for r in self.deployment.ranks])

    def check_health(self) -> None:
        """Raise EngineError once the target is gone (its actors died: LLM.rebuild(), or a fresh replica) or the
        engine was shut down. A draft worker's death is not fatal: the pool goes on without it."""
        if self._dead:
            raise EngineError(f"the target is gone ({self._dead}); call LLM.rebuild()")
        if self._stopped.is_set() or not self._poller.is_alive():
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
        (known before, or found by the call) raises the retriable EngineError with nothing registered."""
        if self._dead:
            raise EngineError(f"the target is gone ({self._dead}); call LLM.rebuild()")
        with self._lock:
            self._requests.update((seq.request_id, (seq, listener)) for seq, listener in requests)
        try:
            yield self.rank0.submit.remote([remote_request(seq) for seq, _ in requests])
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as err:
            with self._lock:
                for seq, _ in requests:
                    self._requests.pop(seq.request_id, None)
            self._dead = f"target actor died: {err.__class__.__name__}"
            raise EngineError(f"{self._dead}; the request can be retried after LLM.rebuild()") from None

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        if not self._dead and request_ids:
            self.rank0.abort.remote(request_ids)

    def reset_prefix_cache(self) -> None:
        self.check_health()
        ray.get(self.rank0.reset_prefix_cache.remote())

    def stop(self) -> None:
        self._stopped.set()
        if not self._dead:
            try:
                ray.get(self.rank0.shutdown.remote(), timeout=30)
            except Exception as err:  # noqa: BLE001 - we are tearing down either way
                log.warning("rank 0 did not shut down cleanly: %r", err)
        self._poller.join(timeout=5)
        self.deployment.kill()

    def _poll_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                polled = ray.get(self.rank0.poll.remote(POLL_S))
            except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as err:
                self._fail_all(f"target actor died: {err.__class__.__name__}")
                return
            except Exception as err:  # noqa: BLE001 - with this thread gone no request would ever finish
                log.exception("polling the target's rank 0 failed")
                self._fail_all(f"polling the target failed: {err!r}")
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

    def _fail_all(self, why: str) -> None:
        self._dead = why
        with self._lock:
            entries, self._requests = list(self._requests.values()), {}
        for _, listener in entries:
            deliver(listener, EngineError(f"{why}; the request can be retried after LLM.rebuild()"))
