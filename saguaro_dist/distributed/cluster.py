"""The engine on a Ray cluster: target ranks in a placement group, a pool of draft actors, and the
driver-side RemoteEngine that LLM talks to (same surface as the one-host EngineThread). The Ray connection, the
Deployment and the start-up steps: deployment.py."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import ray

from saguaro_dist.config import Config
from saguaro_dist.distributed.deployment import (  # noqa: F401 - re-exported: their old home
    DRAFT_MAX_RESTARTS, LOCAL_RAY_SYSTEM_CONFIG, Deployment, connect, release_ray, start_drafts, start_ranks, started,
    wait_dead, warn_if_short,
)
from saguaro_dist.distributed import ray_calls
from saguaro_dist.distributed.placement import draft_options, local_cpus_needed, target_placement
from saguaro_dist.distributed.remote import RemoteRequest, RemoteUpdate
from saguaro_dist.engine.engine import Update
from saguaro_dist.engine.loop_thread import EngineError, deliver
from saguaro_dist.engine.metrics import EngineLoad
from saguaro_dist.engine.sequence import FinishReason, SeqStatus

log = logging.getLogger(__name__)
POLL_S = 0.2
POLL_WAIT_S = 1.0  # how often a poll that has not come back looks whether Ray is still there
SUBMIT_CHUNK = 1024  # requests per submit call: a large offline batch starts before all of it has crossed
SUBMIT_SETTLE_S = 10.0  # an interrupted submit waits this long for its call to land before its aborts go
RANK_NAMING_WAIT_S = 5.0  # rank 0 found its group broken: how long Ray may take to tell which rank died


def build_cluster_engine(config: Config):
    """Start the actors and the engine on rank 0; returns (RemoteEngine, tokenizer)."""
    from saguaro_dist.engine.build import fit_draft, target_tokenizer
    check_tensor_parallel(config)
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


def check_tensor_parallel(config: Config) -> None:
    """Each target rank takes 1/tensor_parallel_size of the heads (fewer KV heads than ranks: one, replicated)
    and of the MLP widths: a size that cannot split them fails here, from config.json, before Ray starts
    anything (the ranks found it only as they built the model)."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    from saguaro_dist.model.hf_config import load_config
    from saguaro_dist.model.loader import resolve_model_dir
    from saguaro_dist.model.tp import KV_REPLICAS_NOTE, split_sizes, unsplittable
    sizes = split_sizes(load_config(resolve_model_dir(config.model, weights=False, revision=config.revision)))
    heads = {k: v for k, v in sizes.items() if k.endswith("heads")}
    widths = {k: v for k, v in sizes.items() if k not in heads}
    for what, part in (("attention heads", heads), ("MLP widths", widths)):
        bad = [item.replace("=", " = ") for item in unsplittable(part, size)]
        if bad:
            note = KV_REPLICAS_NOTE if any(b.startswith("num_key_value_heads") for b in bad) else ""
            raise ValueError(f"tensor_parallel_size = {size} must divide the model's {what} "
                             f"({', '.join(bad)} in {config.model}'s config.json){note}")


def remote_request(seq) -> RemoteRequest:
    return RemoteRequest(seq.seq_id, seq.request_id, seq.prompt_token_ids, seq.params, seq.output_kind,
                         seq.stream_interval_s, seq.priority, seq.cache_salt, seq.lora_request)


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
        self._ray = ray_calls.current_ray()  # the Ray this engine's actors live in (_ray_here)
        self._stop_lock = threading.Lock()
        self._last_metrics = None  # rank 0's, fetched as the engine stops: readable after it, as on one host
        self.load = EngineLoad()  # rank 0's, as of its last poll (at most POLL_S old while it runs)
        # Each follower rank's pending `followed` call: it fails when the rank dies (a group with a dead member
        # never works again), which the poll loop checks at most every POLL_S (a check costs ~0.1 ms).
        self._followers = {rank.followed.remote(): r for r, rank in enumerate(deployment.ranks[1:], start=1)}
        self._next_rank_check = 0.0
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name="saguaro-remote-poll")
        self._poller.start()

    def _ray_here(self) -> bool:
        """Whether the Ray this engine started in is still up: after a ray.shutdown() any Ray call (a poll made
        as it ran) may auto-start a fresh, empty Ray, where this engine's actors and objects do not exist."""
        return ray_calls.current_ray() == self._ray

    def _ask(self, method, *args):
        """ray.get(method.remote(*args)) of rank 0, its death an EngineError (the RayActorError its cause)."""
        if self._stopped.is_set() or not self._ray_here():  # a Ray call now would start a fresh Ray (auto-init)
            raise EngineError("the engine is shut down")
        if self._dead:
            raise self._gone()
        try:
            return ray_calls.get(ray_calls.call(method, *args))
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
        return ray_calls.get([ray_calls.call(d.node_id) for d in self.deployment.drafts])

    def target_node_ids(self) -> list[str]:
        return ray_calls.get([ray_calls.call(r.node_id) for r in self.deployment.ranks])

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
                ray_calls.wait([call], timeout=SUBMIT_SETTLE_S)
                raise

    @staticmethod
    def _wait_submitted(call) -> None:
        ray_calls.get(call)

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
        if self._stopped.is_set() or not self._ray_here():
            raise EngineError("the engine is shut down")
        with self._lock:  # (_dead checked under it: _fail_all sets it before failing what is registered)
            if self._dead:
                raise self._gone()
            self._requests.update((seq.request_id, (seq, listener)) for seq, listener in requests)
        try:
            yield ray_calls.call(self.rank0.submit, [remote_request(seq) for seq, _ in requests])
        except Exception as err:  # noqa: BLE001 - nothing stays registered; what it means is told below
            with self._lock:
                for seq, _ in requests:
                    self._requests.pop(seq.request_id, None)
            # Shut down under the call: the engine's own error, not a death. A ray.shutdown() just before the
            # call fails it (RaySystemError: ray_calls.call starts no fresh Ray where rank 0 is not).
            if self._stopped.is_set() or not self._ray_here():
                raise EngineError("the engine is shut down") from err
            if not isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.RaySystemError)):
                raise
            self._died(f"target actor died: {err.__class__.__name__}", err)
            raise EngineError(f"{self._dead}; the request can be retried after LLM.rebuild()") from err

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        """Fire and forget; nothing to abort once the target is gone or the engine stopped (their requests
        were failed), and no Ray call after ray.shutdown() (it would start a fresh Ray)."""
        if not self._dead and not self._stopped.is_set() and request_ids and self._ray_here():
            ray_calls.call(self.rank0.abort, request_ids)

    def reset_prefix_cache(self) -> None:
        self.check_health()
        self._ask(self.rank0.reset_prefix_cache)

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's remove_lora, on rank 0's engine (where the adapter's slot and host copy are)."""
        return self._ask(self.rank0.remove_lora, lora_int_id)

    def add_lora(self, request) -> bool:
        """vLLM's add_lora, on rank 0's engine (read from its node's disk): a ValueError with why it cannot run."""
        added, error = self._ask(self.rank0.add_lora, request)
        if error:
            raise ValueError(error)
        return added

    def check_lora_adapter(self, lora_path: str) -> None:
        """Read a LoRA adapter on rank 0, where the engine loads it (its node's disk, not this process's): a
        ValueError with the reason it cannot run there."""
        error = self._ask(self.rank0.check_lora_adapter, lora_path)
        if error:
            raise ValueError(error)

    def stop(self) -> None:
        """Free everything (actors, gRPC servers, the placement group, the poll thread, a Ray this process
        started once no engine holds it); requests still running fail with EngineError, as on one host.
        Calling it again does nothing."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
        try:
            if not self._dead and self._ray_here():
                try:
                    self._last_metrics = ray_calls.get(ray_calls.call(self.rank0.metrics), timeout=5)
                except Exception as err:  # noqa: BLE001 - only the metrics after shutdown go without them
                    log.debug("rank 0's last metrics: %r", err)
                try:
                    ray_calls.get(ray_calls.call(self.rank0.shutdown), timeout=30)
                except Exception as err:  # noqa: BLE001 - we are tearing down either way
                    log.warning("rank 0 did not shut down cleanly: %r", err)
            if threading.current_thread() is not self._poller:  # (an LLM's finalizer run by a listener on it)
                self._poller.join(timeout=5)
        finally:
            # Their updates stopped with the poll thread: without this, a generate() or stream() in flight on
            # another thread waited forever.
            self._fail_requests(EngineError, "the engine was shut down")
            self.deployment.kill()

    def _poll_loop(self) -> None:
        """Poll until stopped. However the loop ends, what is in flight is failed unless the engine was stopped
        on purpose (stop() fails it then): with this thread gone no request would ever finish."""
        try:
            self._poll_until_stopped()
        except BaseException as err:  # noqa: BLE001 - a ray.shutdown() on another thread ends ray.get with SystemExit
            if self._stopped.is_set():
                return
            if isinstance(err, SystemExit) or not self._ray_here():
                self._fail_all("Ray was shut down under the engine", err)
            else:
                log.exception("polling the target's rank 0 failed")
                self._fail_all(f"polling the target failed: {err!r}", err)

    def _poll_until_stopped(self) -> None:
        while not self._stopped.is_set():
            if not self._ray_here():  # someone shut Ray down: a Ray call would start a fresh one (auto-init)
                self._fail_all("Ray was shut down under the engine")
                return
            try:
                polled = self._poll_once()
                lost = self._rank_lost(polled.lost)
            except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as err:
                if self._stopped.is_set():
                    return
                if not self._ray_here():  # the actors died with the Ray shut down under us
                    raise
                self._fail_all(f"target actor died: {err.__class__.__name__}", err)
                return
            self.load = polled.load
            for u in polled.updates:
                if not (lost and u.error and not u.invalid):  # the loss's own errors: all are failed below, naming it
                    self._dispatch(u)
            if lost:
                self._fail_all(*lost)
                return

    def _poll_once(self):
        """One poll of rank 0. Waited for in steps: a ray.shutdown() on another thread can leave a call made
        meanwhile unanswered for good, so between steps the loop looks whether Ray is still there."""
        ref = ray_calls.call(self.rank0.poll, POLL_S)
        while not ray_calls.wait([ref], timeout=POLL_WAIT_S)[0]:
            if self._stopped.is_set() or not self._ray_here():
                raise ray.exceptions.RaySystemError("Ray was shut down under the engine")
        return ray_calls.get(ref)

    def _rank_lost(self, broken: str | None) -> tuple[str, BaseException | None] | None:
        """(why, cause) once a follower rank is gone: its `followed` call ended (the actor died, or it stopped
        following), or rank 0 says its group broke (`broken`: then Ray gets RANK_NAMING_WAIT_S to say which
        rank died). None while every rank is there, or once the engine is stopping (followers stop then)."""
        if not self._followers or (broken is None and time.monotonic() < self._next_rank_check):
            return None
        self._next_rank_check = time.monotonic() + POLL_S
        ready, _ = ray_calls.wait(list(self._followers), num_returns=1, timeout=RANK_NAMING_WAIT_S if broken else 0)
        if self._stopped.is_set():
            return None
        if ready:
            return self._follower_gone(ready[0])
        if broken:
            return f"a tensor-parallel rank of the target was lost ({broken})", None
        return None

    def _follower_gone(self, ref) -> tuple[str, BaseException | None]:
        rank = self._followers[ref]
        try:
            ray_calls.get(ref)
        except Exception as err:  # noqa: BLE001 - its death (RayActorError), or whatever ended its call
            return f"tensor-parallel rank {rank} of the target died: {err.__class__.__name__}", err
        return f"tensor-parallel rank {rank} of the target stopped following rank 0", None

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
