"""GrpcDraftBackend: the target side's DraftBackend over a pool of DraftService servers.

Sequences are assigned to servers round-robin on prefill and stay there; every batch call is split
per server and the parts run concurrently. Everything but prefill goes on one long-lived Speculate
stream per server: outcomes, just-in-time drafts and releases, so the server sees them in the order
the engine issued them (as separate calls a JIT or a release could overtake the outcomes before it).
Releases are queued and return at once; outcomes return once gRPC has sent them (the engine verifies
next, see await_sent); a JIT waits for its answer on the stream. A reader thread per server puts the
pushed trees and their plans into an inbox keyed by (seq_id, round), where wait_trees (and wait_plans)
finds them (those of a sequence's earlier life, by their generation, dropped), and hands each JIT answer
to its caller. What goes out is stamped with the sequence's life, so the server drops what a re-prefill (a unary
call, beside the stream) overtook.

Dead servers, their revival and lost streams: grpc_servers.py (ServerLinks, this class's base).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import grpc

from saguaro_dist.distributed import codec
from saguaro_dist.distributed.message_limits import GRPC_MAX_MESSAGE_BYTES
from saguaro_dist.distributed.errors import DraftOutOfSync, DraftRpcError, DraftUnavailable, OutOfOrder, UnknownSequence
from saguaro_dist.distributed.grpc_link import (
    DEFAULT_KEEPALIVE, TRANSPORT_FAILURES, Keepalive, Link, await_sent, channel_options, error_from_rpc,
)
from saguaro_dist.distributed.grpc_servers import REVIVE_POLL_S, ServerLinks  # noqa: F401 - REVIVE_POLL_S: its old home
from saguaro_dist.distributed.proto import saguaro_pb2 as pb
from saguaro_dist.engine.draft_backend import DraftLater, FailedDrafts, Outcomes, TreeKey, plan_misses
from saguaro_dist.engine.messages import (
    JitDraftRequest, Outcome, PrefillRequest, Proposal, Release, ResetPrefixCache, SpeculationTree, TreePlan,
)

log = logging.getLogger(__name__)

__all__ = ["GrpcDraftBackend"]

_STALE = object()  # jit_draft's group of out-of-sync sequences (no call is made for them)
TREE_SPIN_S = 0.005  # how long wait_trees polls (yielding the GIL) before it sleeps on the condition
STREAM_END_WAIT_S = 2.0  # how long close() waits (at most deadline_s) for servers to read their streams to the end


class GrpcDraftBackend(ServerLinks):
    """DraftBackend (engine/draft_backend.py) over DraftService servers at `addresses` ("host:port").

    deadline_s bounds jit_draft and release; prefill_deadline_s bounds prefill (it runs the draft over
    whole prompts). Servers not reachable within connect_timeout_s start out dead (and are taken in once
    they serve). keepalive: the pings that find a server gone without a reset. max_message_bytes: by default
    gRPC's ceiling: each server's own limit, sized from its config (message_limits.py), bounds its replies.
    """

    drafts_beside = True  # a just-in-time draft goes out on the stream; its answer is read when taken

    def __init__(self, addresses: list[str], deadline_s: float = 10.0, *, prefill_deadline_s: float = 60.0,
                 connect_timeout_s: float = 10.0, max_message_bytes: int = GRPC_MAX_MESSAGE_BYTES,
                 keepalive: Keepalive = DEFAULT_KEEPALIVE):
        if not addresses:
            raise ValueError("GrpcDraftBackend needs at least one DraftService address")
        self.deadline_s, self.prefill_deadline_s = deadline_s, prefill_deadline_s
        super().__init__(addresses, channel_options(max_message_bytes, keepalive))
        self._connect(connect_timeout_s)

    # ---- DraftBackend ------------------------------------------------------------------------------
    def prefill(self, reqs: list[PrefillRequest]) -> None:
        """Assign and prefill; a server found dead on the way costs a retry on another one."""
        self.start_prefill(reqs).result()

    def start_prefill(self, reqs: list[PrefillRequest]) -> DraftLater | FailedDrafts:
        """The calls go out now (the target prefills meanwhile); result() waits, retrying what a server
        found dead on the way had, on the others."""
        try:
            groups = self._group(reqs, lambda r: self._assign(r.seq_id))
        except DraftUnavailable as exc:
            return FailedDrafts(exc)
        self._begin(reqs)
        calls = {link: link.stub.Prefill.future(codec.prefill_batch_to_proto(part), timeout=self.prefill_deadline_s)
                 for link, part in groups.items()}
        return DraftLater(partial(self._prefilled, calls=calls, groups=groups), reqs)

    def _prefilled(self, reqs: list[PrefillRequest], calls: dict, groups: dict) -> None:
        retry = self._collect_prefill(calls, groups)
        if retry:
            self.prefill(retry)
        with self._cond:
            self._out_of_sync.difference_update(r.seq_id for r in reqs)

    def _begin(self, reqs: list[PrefillRequest]) -> None:
        """New lives, before their prefills go out: a tree (or plan) of an earlier life still here (one that came
        after its round's wait, or before its stream failed) is dropped, and one still on its way (pushed before
        the server's prefill, read after) is dropped as it arrives (Lives)."""
        with self._cond:
            self._lives.begin(reqs)
            self._drop_rounds_up_to({r.seq_id: float("inf") for r in reqs})

    def _collect_prefill(self, calls, groups) -> list[PrefillRequest]:
        retry, error = [], None
        for link, fut in calls.items():
            try:
                fut.result()
            except grpc.RpcError as err:
                if err.code() in TRANSPORT_FAILURES:
                    self._mark_dead(link, f"prefill: {err.code().name}: {err.details()}")
                    retry += groups[link]
                else:  # refused: the server holds none of them (kept, their outcomes ended its stream: NOT_FOUND)
                    self._not_held(link, groups[link])
                    error = error or error_from_rpc(err, link.address, [r.seq_id for r in groups[link]])
        if error is not None:
            raise error
        return retry

    def _not_held(self, link: Link, reqs: list[PrefillRequest]) -> None:
        """Sequences whose prefill the server refused: lost (prefill them again), placed nowhere, no life here."""
        with self._cond:
            for r in reqs:
                if self._owner.get(r.seq_id) is link:
                    del self._owner[r.seq_id]
                self._out_of_sync.discard(r.seq_id)
            self._lives.end(r.seq_id for r in reqs)
            self._drop_rounds_up_to({r.seq_id: float("inf") for r in reqs})

    def jit_draft(self, reqs: list[JitDraftRequest]) -> list[Proposal]:
        """Proposals in request order; DraftUnavailable (with the others in .partial) if a server failed."""
        return self.start_jit_draft(reqs).result()

    def start_jit_draft(self, reqs: list[JitDraftRequest]) -> DraftLater | FailedDrafts:
        """Queue the draft on each server's stream and return once gRPC has sent it (as send_outcomes
        does: the caller verifies next); result() reads the answers, by one deadline taken now: a pool
        that reads its workers' answers in turn waits deadline_s once, not once per stalled worker."""
        deadline = time.monotonic() + self.deadline_s
        reqs = self._stamp(reqs)
        try:
            groups = self._group(reqs, self._owner_for_jit)
        except UnknownSequence as exc:
            return FailedDrafts(exc)
        calls = {link: link.call_jit(part) for link, part in groups.items() if link not in (None, _STALE)}
        await_sent([(link.outbox, link.outbox.queued) for link in calls])  # each stream's last request: this one
        return DraftLater(partial(self._answers, groups=groups, calls=calls, deadline=deadline), reqs)

    def _answers(self, reqs: list[JitDraftRequest], groups: dict, calls: dict, deadline: float) -> list[Proposal]:
        found, failed, stale, error = self._collect_jit(calls, groups, deadline)
        failed += [r.seq_id for r in groups.get(None, [])]
        stale += [r.seq_id for r in groups.get(_STALE, [])]
        if error is not None:
            raise error
        if failed:
            raise DraftUnavailable(f"draft server unavailable for sequences {failed}", failed, found)
        if stale:
            raise DraftOutOfSync(f"sequences {stale} out of step with their draft server (a failed stream, a malformed "
                                 "answer): to be prefilled again", stale, found)
        return [found[r.seq_id] for r in reqs]

    def _owner_for_jit(self, req: JitDraftRequest) -> Link | None:
        if req.seq_id not in self._owner:
            raise UnknownSequence(f"unknown sequence {req.seq_id} (never prefilled through this backend)")
        link = self._live_owner(req.seq_id)
        return _STALE if link is not None and req.seq_id in self._out_of_sync else link

    def _collect_jit(self, calls: dict, groups: dict, deadline: float):
        """Wait for every server's answer (by one deadline, time.monotonic(), for all); sort them into
        found / failed / stale."""
        found, failed, stale, error = {}, [], [], None
        for link, (call_id, answer) in calls.items():
            seq_ids = [r.seq_id for r in groups[link]]
            try:
                found.update(zip(seq_ids, answer.result(timeout=max(0.0, deadline - time.monotonic()))))
            except TimeoutError:
                link.forget(call_id)
                failed += seq_ids
            except DraftOutOfSync:  # a failed stream, or an answer not of what was asked (it drafted them anyway)
                with self._cond:  # not a life begun since (re-prefilled while this answer was awaited): in sync
                    self._out_of_sync.update(r.seq_id for r in groups[link] if self._lives.of(r.seq_id) == r.generation)
                stale += seq_ids
            except DraftUnavailable:
                failed += seq_ids
            except (UnknownSequence, OutOfOrder, DraftRpcError) as exc:
                error = error or exc
        return found, failed, stale, error

    def send_outcomes(self, outcomes: list[Outcome]) -> None:
        """Queue each server's part on its stream; returns once gRPC has sent them (or after HANDOFF_S).
        Outcomes for dead servers are dropped."""
        groups = self._group(self._stamp(outcomes), lambda o: self._synced_owner(o.seq_id))
        if None in groups:
            log.debug("outcomes for %d sequences without a live, in-sync draft server dropped", len(groups.pop(None)))
        await_sent([link.send(pb.SpeculateRequest(outcomes=codec.outcome_batch_to_proto(part)))
                     for link, part in groups.items()])  # every server at once

    def catch_up(self, rounds: list[list[Outcome]]) -> None:
        """Rounds of outcomes that want no tree, in order, one message per server (a target that drafts
        just in time itself holds them back: engine/split_draft.py); returns once they are queued: the
        next outcomes or draft on the same stream wait for the send. Those of dead servers are dropped."""
        parts = defaultdict(list)
        for outcomes in rounds:
            for link, part in self._group(self._stamp(outcomes), lambda o: self._synced_owner(o.seq_id)).items():
                if link is not None:
                    parts[link].append(part)
        for link, part in parts.items():
            link.send(pb.SpeculateRequest(catch_up=codec.outcome_rounds_to_proto(part)))

    def lost(self, seq_ids: list[int]) -> list[int]:
        """Those of seq_ids no live, in-sync server holds (never prefilled, released, its server dead or
        its stream lost): prefill them again."""
        return [sid for sid in seq_ids if self._synced_owner(sid) is None]

    def wait_plans(self, keys: list[TreeKey], timeout_s: float) -> dict[int, TreePlan]:
        """The plans among `keys` that arrived by the deadline, kept (wait_trees settles the round): the target
        draws a sampled row's bonus against its plan's candidates (coupled bonus draws). A key whose tree came
        without a plan settles too; those of dead or out-of-sync servers are not waited for."""
        deadline = time.monotonic() + timeout_s
        self._poll(keys, min(timeout_s, TREE_SPIN_S), self._unplanned)
        with self._cond:
            while not self._closed and (missing := [k for k in keys if self._unplanned(k) and self._synced_owner(k[0])]):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.debug("%d tree plans late: %s", len(missing), missing[:8])
                    break
                self._cond.wait(left)
            return {k[0]: self._plans[k] for k in keys if k in self._plans}

    def wait_trees(self, keys: list[TreeKey], timeout_s: float, outcomes: Outcomes | None = None
                   ) -> dict[int, SpeculationTree]:
        """The trees among `keys` that arrived by the deadline (those of dead servers are not waited for,
        nor those whose plan lacks the outcome looked up)."""
        deadline = time.monotonic() + timeout_s
        self._poll(keys, min(timeout_s, TREE_SPIN_S), lambda k: self._awaited(k, outcomes))
        with self._cond:
            while not self._closed and (missing := [k for k in keys if self._awaited(k, outcomes)
                                                    and self._synced_owner(k[0])]):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.debug("%d speculation trees late: %s", len(missing), missing[:8])
                    break
                self._cond.wait(left)
            found = {k[0]: self._trees.pop(k) for k in keys if k in self._trees}
            self._drop_rounds_up_to(dict(keys))
        return found

    def release(self, reqs: list[Release]) -> None:
        """Fire and forget, like the in-process backend: failures are logged, never raised."""
        reqs = self._stamp(reqs)
        groups = self._group(reqs, lambda r: self._live_owner(r.seq_id))
        with self._cond:
            for r in reqs:
                self._owner.pop(r.seq_id, None)
                self._out_of_sync.discard(r.seq_id)
            self._lives.end(r.seq_id for r in reqs)
            self._drop_rounds_up_to({r.seq_id: float("inf") for r in reqs})
        for link, part in groups.items():
            if link is not None:  # behind the sequence's last outcome on the same stream
                link.send_releases(part)

    def unconfirmed_releases(self) -> list[Release]:
        """Releases sent that the servers may not have read: those of failed streams not yet sent again, and
        those no answer has shown read yet (DraftPool releases them too when it replaces this backend)."""
        with self._cond:  # one lock: a dead or lost stream moves its releases from the link to _owed under it
            owed = [r for releases in self._owed.values() for r in releases]
            return owed + [r for link in self._links for r in link.unconfirmed_releases()]

    def release_held_before(self, held: list[Release]) -> None:
        """Release, on every server, sequences an earlier backend placed there (a draft worker that missed a
        deadline, taken back after its sequences moved on), each of the life it had there then (as _revive does):
        a later life of one (a prefill that reached the server since, on whatever channel) is kept, not lost to a
        re-prefill. A release naming no life (generation 0) ends any. Unary: raises (DraftUnavailable, ...) unless
        every server confirms it."""
        request = codec.release_batch_to_proto(held)
        for link in self._links:
            try:
                link.stub.Release(request, timeout=self.deadline_s)
            except grpc.RpcError as err:
                raise error_from_rpc(err, link.address, [r.seq_id for r in held]) from err

    def reset_prefix_cache(self, msg: ResetPrefixCache) -> None:
        """On every live server's stream, behind what was sent before it; fire and forget."""
        request = pb.SpeculateRequest(reset_prefix_cache=codec.reset_prefix_cache_to_proto(msg))
        for link in self._links:
            if link.alive:
                link.send(request)


    def workers(self) -> tuple[int, int]:
        return sum(link.alive for link in self._links), len(self._links)

    def graph_captures(self) -> int:
        return sum(link.graph_captures for link in self._links)

    def close(self) -> None:
        """End every stream once its server has read what was queued on it (releases: else a server that outlives
        this client keeps those sequences), up to STREAM_END_WAIT_S for all; close every channel, join the reader
        threads."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            self._cond.notify_all()
            revivers = list(self._revivers)
        # one wait for all (each server reads its stream meanwhile), short: a pool closes its backends one by one
        deadline = time.monotonic() + min(self.deadline_s, STREAM_END_WAIT_S)
        for link in self._links:
            link.end_requests()
        for link in self._links:
            link.finish_stream(deadline)
            link.channel.close()
        for thread in [link.reader for link in self._links] + revivers:
            if thread is not None:
                thread.join(timeout=5.0)

    # ---- helpers -----------------------------------------------------------------------------------
    def _stamp(self, msgs: list) -> list:
        """Outcomes, drafts or releases going out, stamped with their sequences' lives (Lives.stamp): the server
        drops one that a re-prefill (a unary call, beside the stream) overtook."""
        with self._cond:
            return self._lives.stamp(msgs)

    @staticmethod
    def _group(items, key) -> dict:
        groups = defaultdict(list)
        for item in items:
            groups[key(item)].append(item)
        return groups

    def _drop_rounds_up_to(self, latest: dict) -> None:
        """Trees (and plans) of rounds already asked for, or of released sequences, will never be asked for again."""
        for store in (self._trees, self._plans):
            for k in [k for k in store if k[0] in latest and k[1] <= latest[k[0]]]:
                del store[k]

    def _awaited(self, key: TreeKey, outcomes: Outcomes | None) -> bool:
        """Neither its tree nor a plan that misses the outcome looked up is in (unlocked reads are fine:
        a dict's get is atomic, and a key seen awaited is re-checked under the lock)."""
        return key not in self._trees and not plan_misses(self._plans.get(key), outcomes, key[0])

    def _unplanned(self, key: TreeKey) -> bool:
        """Neither its plan nor its tree is in (unlocked reads are fine, as in _awaited)."""
        return key not in self._plans and key not in self._trees

    def _poll(self, keys: list[TreeKey], spin_s: float, awaited: Callable[[TreeKey], bool]) -> None:
        """Yield the GIL until no key is awaited (its tree, or its plan, is in) or spin_s: a thread asleep on
        the condition lets its CPU halt, and waking it cost ~0.1 ms at the median on the 2-vCPU development VM
        and far more at the tail. The target waits here with nothing else to run; the reader thread decodes
        meanwhile. Unlocked reads of the inbox: a key seen missing is only re-checked under the lock after."""
        end = time.perf_counter() + spin_s
        while any(awaited(k) for k in keys) and time.perf_counter() < end:
            time.sleep(0)
