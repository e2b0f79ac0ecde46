"""ServerLinks: the per-server side of GrpcDraftBackend (grpc_backend.py): which server holds each sequence,
which servers are alive, the reader thread per server that fills the inbox, and the revival of a dead one.

A server that fails at the transport level (UNAVAILABLE, its stream torn down), or pushes a reply this side
fails to take in (a bug or a mismatched peer), is marked dead: its
sequences get DraftUnavailable from jit_draft (the engine falls back to the fast backup), their
trees are no longer waited for, and new prefills skip it. A thread then waits for it to serve again (gRPC
redials with its backoff, capped at MAX_RECONNECT_BACKOFF_MS): a restarted server, or one found
unreachable at start, takes new prefills again once it has released what it held (the same process may
still hold it); the sequences it had are out of sync until prefilled again. A protocol error on a stream (NOT_FOUND,
FAILED_PRECONDITION, ...) ends it and the stream is reopened; what was queued on the old one is lost,
so every sequence of that server is out of sync until prefilled again: DraftOutOfSync from jit_draft
(the engine re-prefills them), no tree waited for, their outcomes dropped. Releases are not lost with a
stream: those no answer showed read go out again first on the new one (a dead server's: its reviver's).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.errors import DraftOutOfSync, DraftUnavailable
from saguaro_dist.distributed.grpc_link import TRANSPORT_FAILURES, Link
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.draft_backend import Lives, TreeKey
from saguaro_dist.engine.messages import Release, SpeculationTree, TreePlan

log = logging.getLogger(__name__)

UNREADABLE = grpc.StatusCode.DATA_LOSS  # a reply the reader failed to take in (_drain_stream)
REVIVE_POLL_S = 1.0  # a dead server that connects but refuses the reviver's Release is asked again after this


class ServerLinks:
    """The links to DraftService servers at `addresses` and the state their threads share with the backend's
    calls, under one condition. GrpcDraftBackend sets deadline_s (it bounds the reviver's Release too)."""

    deadline_s: float

    def __init__(self, addresses: list[str], options: list):
        self._links = [Link(a, options) for a in addresses]
        self._cond = threading.Condition()  # guards the inbox, the owners and liveness
        self._trees: dict[TreeKey, SpeculationTree] = {}
        # announced trees (a plan that lacks the outcome is a miss) and coupled ones (their bonus is drawn against it)
        self._plans: dict[TreeKey, TreePlan] = {}
        self._owner: dict[int, Link] = {}
        self._lives = Lives()  # a tree or plan of a sequence's earlier life is dropped as it arrives
        self._out_of_sync: set[int] = set()  # sequences whose outcomes died with a stream; prefill clears
        self._owed: dict[Link, list[Release]] = {}  # a dead server's releases lost with its stream: its reviver's
        self._next = itertools.cycle(self._links)
        self._closed = False
        self._closing = threading.Event()  # set with _closed: a reviver's pause between tries ends at once
        self._revivers: list[threading.Thread] = []  # the running ones (guarded by _cond): close() joins them

    # ---- pool state, liveness, revival ------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [link.address for link in self._links]

    @property
    def dead_addresses(self) -> list[str]:
        return [link.address for link in self._links if not link.alive]

    def owner_of(self, seq_id: int) -> str | None:
        link = self._owner.get(seq_id)
        return link.address if link is not None else None

    def _connect(self, timeout_s: float) -> None:
        ready = [(link, grpc.channel_ready_future(link.channel)) for link in self._links]
        deadline = time.monotonic() + timeout_s
        for link, fut in ready:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                fut.cancel()
                self._mark_dead(link, f"not reachable within {timeout_s} s")
                continue
            self._start_reader(link)

    def _start_reader(self, link: Link) -> None:
        link.open_stream()
        link.reader = threading.Thread(target=self._read_trees, args=(link,), daemon=True,
                                       name=f"saguaro-trees-{link.address}")
        link.reader.start()

    def _mark_dead(self, link: Link, why: str) -> None:
        with self._cond:
            if not link.alive:
                return
            link.alive = False
            held = [Release(s, self._lives.of(s)) for s, owner in self._owner.items() if owner is link]
            self._cond.notify_all()  # waiters stop waiting for its trees
            # Released here already, perhaps never read: the reviver releases them too. Moved from the link to _owed
            # under the lock unconfirmed_releases reads both under: in neither between, they were lost to it.
            self._owed[link] = self._owed.get(link, []) + link.end_stream()
            if not self._closed:  # started under the lock: close() joins every reviver, none it could miss
                self._start_reviver(link, held + self._owed[link])
        log.warning("draft server %s marked dead: %s", link.address, why)

    def _start_reviver(self, link: Link, held: list[Release]) -> None:
        """The thread that takes link back; finished ones are dropped (a server that dies again and again would
        otherwise pile them up). Call under _cond."""
        reviver = threading.Thread(target=self._revive, args=(link, held), daemon=True,
                                   name=f"saguaro-revive-{link.address}")
        self._revivers = [t for t in self._revivers if t.is_alive()] + [reviver]
        reviver.start()

    def _revive(self, link: Link, held: list[Release]) -> None:
        """Reviver thread: once the dead server serves again and has released what it held when it died, it
        takes prefills again; the sequences still placed there are out of sync (prefilled again)."""
        if link.reader is not None and link.reader is not threading.current_thread():
            link.reader.join()  # the old stream's reader, which ends with it: it must not see the link alive again
        while not self._closed:
            if self._released_there(link, held):
                break
        with self._cond:
            if self._closed:
                return
            self._owed.pop(link, None)  # released there (_released_there)
            self._out_of_sync.update(seq_id for seq_id, owner in self._owner.items() if owner is link)
            link.alive = True
        try:
            self._start_reader(link)
        except ValueError:  # "Channel closed": close() ran meanwhile
            return
        log.warning("draft server %s serves again; it takes new and re-prefilled sequences", link.address)

    def _released_there(self, link: Link, held: list[Release]) -> bool:
        """Release what the server held when it died, each of the life it had then (a life begun there since
        is kept): a server that never died, only its connection, still holds them. The call is also the proof
        that it serves: it waits (up to deadline_s) for the channel to connect, gRPC redialling with its backoff."""
        try:
            link.stub.Release(codec.release_batch_to_proto(held), timeout=self.deadline_s, wait_for_ready=True)
            return True
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED and not self._closed:  # answered, not well
                log.info("draft server %s is back but did not release its old sequences: %s: %s",
                         link.address, err.code().name, err.details())
                self._closing.wait(REVIVE_POLL_S)  # not a sleep: close() (a pool taking a new backend) waits for it
            return False
        except ValueError:  # "Channel closed": close() ran meanwhile
            return False

    def _assign(self, seq_id: int) -> Link:
        """The sequence's server: its current one while alive, else the next live one round-robin."""
        with self._cond:
            link = self._owner.get(seq_id)
            if link is not None and link.alive:
                return link
            for _ in range(len(self._links)):
                link = next(self._next)
                if link.alive:
                    self._owner[seq_id] = link
                    return link
        raise DraftUnavailable("no live draft server", [seq_id])

    def _live_owner(self, seq_id: int) -> Link | None:
        link = self._owner.get(seq_id)
        return link if link is not None and link.alive else None

    def _synced_owner(self, seq_id: int) -> Link | None:
        """The live server that can still serve the sequence (None: dead, or out of sync)."""
        return None if seq_id in self._out_of_sync else self._live_owner(seq_id)

    # ---- reader threads: the inbox -----------------------------------------------------------------
    def _read_trees(self, link: Link) -> None:
        """Reader thread: pushed tree batches into the inbox; reopen the stream after protocol errors."""
        while True:
            code, details = self._drain_stream(link)
            if self._closed or not link.alive:
                return
            if code in TRANSPORT_FAILURES or code is UNREADABLE:
                self._mark_dead(link, f"Speculate stream: {code.name}: {details}")
                return
            log.warning("Speculate stream to %s ended (%s: %s); reopening it, its sequences to be prefilled again",
                        link.address, code.name if code else "OK", details)
            self._lose_sync(link)  # before the new stream opens: nothing of theirs may go out on it
            time.sleep(0.01)  # never spin on a server that ends every stream at once
            try:
                link.open_stream()
            except ValueError:  # "Channel closed": close() ran meanwhile, on another thread
                return

    def _lose_sync(self, link: Link) -> None:
        """What was queued on the failed stream is gone: the server is behind for all its sequences."""
        with self._cond:  # the releases re-queued under it too: unconfirmed_releases must not see them in neither queue
            self._out_of_sync.update(seq_id for seq_id, owner in self._owner.items() if owner is link)
            self._cond.notify_all()  # waiters stop waiting for their trees
            unconfirmed = link.restart_queue(lambda seq_ids: DraftOutOfSync(f"draft server {link.address}: stream lost",
                                                                            seq_ids))
            if unconfirmed:  # first on the new stream: each of the life it ended (a later life of one is kept there)
                link.send_releases(unconfirmed)

    def _drain_stream(self, link: Link):
        """Read one stream to its end; returns its final (code, details), UNREADABLE for a reply this side failed
        to take in (a bug or a mismatched peer): the server's failure. It once ended the reader and left the link
        alive without one, so every later draft there waited out its deadline."""
        try:
            for msg in link.call:
                self._store(link, msg)
        except grpc.RpcError as err:
            return err.code(), err.details()
        except Exception as exc:
            log.error("draft server %s sent a reply this side cannot take in", link.address, exc_info=exc)
            return UNREADABLE, f"{type(exc).__name__}: {exc}"
        return None, ""

    def _store(self, link: Link, msg: pb.SpeculateReply) -> None:
        link.graph_captures = msg.graph_captures  # before what the reply carries is seen: see graph_captures
        kind = msg.WhichOneof("kind")
        if kind == "jit_draft":
            link.answer(msg.jit_draft)
            return
        if kind == "plans":
            self._store_plans(link, msg.plans)
            return
        try:
            trees = codec.tree_batch_from_proto(msg.trees)
        except codec.CodecError as exc:  # one bad batch is a few misses, not a dead stream
            log.error("draft server %s pushed a malformed tree batch: %s", link.address, exc)
            return
        with self._cond:
            for tree in trees:  # a late tree of a released sequence would never leave; one of an earlier life is stale
                if tree.seq_id in self._owner and not self._lives.stale(tree):
                    self._trees[(tree.seq_id, tree.round)] = tree
            self._cond.notify_all()

    def _store_plans(self, link: Link, msg: pb.TreePlanBatch) -> None:
        try:
            plans = codec.plan_batch_from_proto(msg)
        except codec.CodecError as exc:  # a bad plan only costs the early misses it would have told
            log.error("draft server %s pushed a malformed plan batch: %s", link.address, exc)
            return
        with self._cond:
            for plan in plans:
                if plan.seq_id in self._owner and not self._lives.stale(plan):
                    self._plans[(plan.seq_id, plan.round)] = plan
            self._cond.notify_all()
