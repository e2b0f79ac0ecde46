"""Ray actors: the draft workers (each a gRPC DraftService) and the target's tensor-parallel ranks."""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import ray
import torch
import torch.distributed as dist

from saguaro_dist.config import Config
from saguaro_dist.distributed.draft_server import default_bind_host, format_address, local_address
from saguaro_dist.distributed.draft_service import serve_draft
from saguaro_dist.distributed.placement import actor_threads
from saguaro_dist.distributed.remote import RemotePoll, RemoteRequest, RemoteUpdate
from saguaro_dist.distributed.tp_runner import BroadcastRunner, RankLost, run_follower
from saguaro_dist.engine.heap import freeze_startup_heap
from saguaro_dist.engine.lora_slots import AdapterReadError
from saguaro_dist.log_level import follow_env_log_level

log = logging.getLogger(__name__)
STORE_TIMEOUT = dist.constants.default_pg_timeout  # the store's waits, as init_method="tcp://..." gave them


@dataclass(frozen=True)
class DraftEndpoint:
    """Where a draft worker serves its DraftService."""
    node_id: str        # the Ray node it runs on
    address: str        # host:port on the node's cluster address, for clients anywhere
    local: str | None   # unix-abstract:..., for clients on the same node (None: not served)

    def for_client_on(self, node_id: str) -> str:
        """The address a client on `node_id` dials: the local socket on the same node (no TCP stack on
        the tree's way), the cluster address otherwise."""
        return self.local if self.local is not None and node_id == self.node_id else self.address


class DraftActor:
    """One draft worker: the draft model behind a DraftService on this node's cluster address, and on
    a local socket for a target on the same node."""

    def __init__(self, config: Config, fit=None):
        """fit: the DraftFit to build the draft to (engine/build.py: fit_draft, on the driver)."""
        from saguaro_dist.engine.build import build_draft_worker
        torch.set_num_threads(actor_threads(config.draft_threads))  # the CPUs it asked Ray for (placement.py)
        follow_env_log_level()  # `saguaro --log-level`, inherited from the replica that started this actor
        self.worker = build_draft_worker(config, fit)
        local = local_address()
        self.server, port = serve_draft(self.worker, local=local)
        self._endpoint = DraftEndpoint(self.node_id(), format_address(default_bind_host(), port), local)
        freeze_startup_heap()

    def address(self) -> str:
        return self._endpoint.address

    def endpoint(self) -> DraftEndpoint:
        return self._endpoint

    def vocab_size(self) -> int:
        return self.worker.vocab_size

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """The process serving the DraftService (for a profiler, or a test that stalls it)."""
        return os.getpid()

    def stop(self) -> None:
        self.server.stop(grace=0.5).wait()


def ask_actor(method, timeout_s: float):
    """ray.get(method.remote()), asked again while Ray restarts the actor (ActorUnavailableError);
    raises once it is dead for good (ActorDiedError) or timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(method.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


class TargetRank:
    """One tensor-parallel rank of the target. Rank 0 also runs the engine (round loop + batching)."""

    def __init__(self, config: Config, rank: int, group_timeout: timedelta | None = None):
        """group_timeout: the tensor-parallel group's, every rank's the same (None: torch's default for the
        backend, 10 min on NCCL, 30 on gloo; a test's is seconds). A collective waiting longer fails (a hung
        rank); rank 0 pings an idle group well within it (tp_runner.keepalive_s), so an idle engine keeps it."""
        torch.set_num_threads(actor_threads(config.target_threads))  # the CPUs it asked Ray for (placement.py)
        follow_env_log_level()  # `saguaro --log-level`, inherited from the replica that started this actor
        self.config, self.rank = config, rank
        nccl = config.device.startswith("cuda")
        self.group_timeout = group_timeout or (dist.constants.default_pg_nccl_timeout if nccl
                                               else dist.constants.default_pg_timeout)
        self.updates: queue.Queue = queue.Queue()
        self.thread = None
        self._broadcast: BroadcastRunner | None = None  # rank 0 of a group: its runner, which notes a broken group
        self._follower: threading.Thread | None = None  # the others: the thread replaying rank 0's calls
        self._store = None  # rank 0's torch.distributed store: it holds the group's port from rendezvous on

    def rendezvous(self) -> tuple[str, int] | None:
        """Rank 0: where the other ranks find the tensor-parallel group's store, this node's address and the
        port of the store it now serves (None: one rank, no group). The store binds port 0 and keeps it: a free
        port found by bind-and-close could be taken by another process before the group bound it again."""
        if self.config.tensor_parallel_size == 1:
            return None
        host = ray.util.get_node_ip_address()  # the store listens on every address of the node
        self._store = dist.TCPStore(host, 0, self.config.tensor_parallel_size, is_master=True, timeout=STORE_TIMEOUT,
                                    wait_for_workers=False)
        return host, self._store.port

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def setup(self, master: tuple[str, int] | None, drafts: list[DraftEndpoint], fit,
              draft_actors: list | None = None) -> dict:
        """Collective: every rank at once. Loads the shard; rank 0 builds the engine, others follow.
        fit: the DraftFit the driver gave the drafts (None: no draft); draft_actors: their handles, for
        rank 0 to find a restarted one at its new address."""
        from saguaro_dist.engine.build import make_runner, position_slack
        group = self._join_group(master)
        runner = make_runner(self.config.model, self.config, tp_group=group, revision=self.config.revision, lora=True,
                             slack=position_slack(self.config))
        if self.rank > 0:
            freeze_startup_heap()
            self._follower = threading.Thread(target=run_follower, args=(runner, group), daemon=True,
                                              name="saguaro-tp-follow")
            self._follower.start()
            return {}
        addresses = [d.for_client_on(self.node_id()) for d in drafts]
        revive = partial(self._revive_draft, draft_actors) if draft_actors else None
        self._broadcast = None if group is None else BroadcastRunner(runner, group, self.group_timeout)
        try:
            return self._start_engine(self._broadcast or runner, addresses, fit, revive)
        except BaseException:
            if self._broadcast is not None:  # (its pings would keep the followers following a rank 0 with no engine)
                with contextlib.suppress(RankLost):
                    self._broadcast.stop_followers()
            raise

    def followed(self) -> None:
        """A follower: returns once it stopped following rank 0 (told to stop). The driver keeps this call
        pending: it fails as soon as Ray learns this rank died (its process killed, its node lost), so the
        driver can fail the engine naming the rank (cluster.RemoteEngine)."""
        if self._follower is not None:
            self._follower.join()

    def _join_group(self, master: tuple[str, int] | None):
        world = self.config.tensor_parallel_size
        if world == 1:
            return None
        backend = "nccl" if self.config.device.startswith("cuda") else "gloo"  # (group_timeout's default follows it)
        store = self._store if self.rank == 0 else dist.TCPStore(*master, world, is_master=False, timeout=STORE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=world, timeout=self.group_timeout)
        return dist.group.WORLD

    def _start_engine(self, runner, draft_addresses: list[str], fit, revive=None) -> dict:
        from saguaro_dist.engine.build import eos_ids, target_tokenizer
        from saguaro_dist.engine.engine import Engine
        from saguaro_dist.engine.loop_thread import EngineThread
        tokenizer = target_tokenizer(self.config)
        backend = self._draft_side(draft_addresses, fit, revive) if self.config.uses_draft else None
        engine = Engine(self.config, runner, backend, tokenizer, eos_ids(runner, tokenizer, self.config))
        freeze_startup_heap()
        self.thread = EngineThread(engine)
        return {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                "eos_token_ids": sorted(engine.eos_token_ids), "draft_addresses": draft_addresses}

    def _draft_side(self, draft_addresses: list[str], fit, revive=None):
        """The pool of draft actors; split: with a draft copy here for the just-in-time drafts."""
        from saguaro_dist.config import DraftExecutor
        from saguaro_dist.distributed.draft_pool import DraftPool
        from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
        from saguaro_dist.engine.build import build_draft_worker, ray_draft_executor
        from saguaro_dist.engine.draft_backend import LocalDraftBackend
        from saguaro_dist.engine.split_draft import SplitDraftBackend
        backends = [GrpcDraftBackend([a], self.config.draft_deadline_s) for a in draft_addresses]
        pool = DraftPool(backends, self.config.max_batch_size, fit.max_model_len, revive)
        if ray_draft_executor(self.config) is not DraftExecutor.SPLIT:
            return pool
        try:  # the copy on this rank's device, on the target's torch threads (the drafts take turns with its verify)
            return SplitDraftBackend(LocalDraftBackend(build_draft_worker(self.config, fit, device=self.config.device)), pool)
        except BaseException:
            pool.close()
            raise

    def _revive_draft(self, actors: list, i: int):
        """Draft worker i once its actor answers again: a backend at its address, new if Ray restarted the
        actor (cluster.DRAFT_MAX_RESTARTS), the old one if it never died (it missed a deadline; the pool
        releases there what it held). Raises if it is dead for good."""
        from saguaro_dist.distributed.grpc_backend import GrpcDraftBackend
        address = ask_actor(actors[i].endpoint, self.config.startup_timeout_s).for_client_on(self.node_id())
        return GrpcDraftBackend([address], self.config.draft_deadline_s)

    # ---- rank 0: the engine's front door ------------------------------------------------------------
    def submit(self, requests: list[RemoteRequest]) -> None:
        """One call per batch of requests (not per request): an actor call costs ~1.5 ms, and requests
        arriving one at a time would also enter the engine in small batches."""
        from saguaro_dist.engine.sequence import Sequence
        seqs = [Sequence(r.seq_id, r.request_id, r.prompt_token_ids, r.params, r.output_kind, r.stream_interval_s,
                         r.priority, r.cache_salt, lora_request=r.lora_request) for r in requests]
        self.thread.submit_many([(seq, self._listener(seq.request_id)) for seq in seqs])

    def abort(self, request_ids: list[str]) -> None:
        """One call for many (a Ctrl-C'd generate() aborts its whole batch)."""
        self.thread.abort_many(request_ids)

    def poll(self, timeout_s: float) -> RemotePoll:
        """Updates since the last poll (waiting up to timeout_s for the first one), and the engine's load."""
        try:
            items = [self.updates.get(timeout=timeout_s)]
        except queue.Empty:
            items = []
        while not self.updates.empty():
            items.append(self.updates.get_nowait())
        # (lost read after the updates: a failure's updates are sent after the runner noted it)
        return RemotePoll(items, self.thread.load, self._broadcast.lost if self._broadcast else None)

    def metrics(self):
        return self.thread.metrics

    def reset_prefix_cache(self) -> None:
        self.thread.reset_prefix_cache()

    def remove_lora(self, lora_int_id: int) -> bool:
        """The engine's remove_lora here, on rank 0: its slot's eviction replays on every tensor-parallel rank."""
        return self.thread.remove_lora(lora_int_id)

    def add_lora(self, request) -> tuple[bool, str | None]:
        """The engine's add_lora here, on rank 0 (its slots' loads replay on every rank): (added, why it failed).
        A timed-out wait for the engine's thread or an engine error is raised: the driver's call raises it (Ray's
        RayTaskError, an instance of it), a server error there, not the client's."""
        try:
            return self.thread.add_lora(request), None
        except AdapterReadError as err:  # only its files' read happened on this node
            return False, f"{err} (read on the node of the target's rank 0)"
        except ValueError as err:  # (LoRA off, an id bound to another path: nothing read)
            return False, str(err)

    def check_lora_adapter(self, lora_path: str) -> str | None:
        """Read a LoRA adapter here, on rank 0's node, as the engine's slots will at its first request (their
        read is lazy): why it cannot run (the text), or None. The server asks for each static adapter at start-up."""
        from saguaro_dist.model.hf_config import load_config
        from saguaro_dist.model.loader import resolve_model_dir
        from saguaro_dist.model.lora_adapter import load_adapter
        try:
            base = load_config(resolve_model_dir(self.config.model, weights=False, revision=self.config.revision))
            load_adapter(lora_path, base, self.config.max_lora_rank)
        except (ValueError, OSError) as err:
            return f"{err} (read on the node of the target's rank 0)"
        return None

    def shutdown(self) -> None:
        """(The STOP waits for a call the engine's thread may still run past stop()'s join: BroadcastRunner's lock.)"""
        if self.thread is not None:
            runner = self.thread.engine.target.runner
            self.thread.stop()
            if isinstance(runner, BroadcastRunner):
                runner.stop_followers()

    def _listener(self, request_id: str):
        def on_update(item):
            if isinstance(item, BaseException):
                self.updates.put(RemoteUpdate(request_id, "", [], True, "abort", None, error=str(item),
                                              invalid=isinstance(item, ValueError)))
                return
            s = item.seq
            reason = s.finish_reason.value if item.finished and s.finish_reason else None
            self.updates.put(RemoteUpdate(request_id, item.text_delta, item.token_delta, item.finished, reason,
                                          s.metrics if item.finished else None, logprobs_delta=item.logprobs_delta,
                                          prompt_logprobs=item.prompt_logprobs,
                                          stop_reason=s.stop_reason if item.finished else None))
        return on_update
