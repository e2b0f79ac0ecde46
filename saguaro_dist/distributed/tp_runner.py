"""Tensor-parallel target ranks: rank 0 drives, the others replay its runner calls.

Every ModelRunner call that runs a forward or changes KV state (or a LoRA slot: rank 0 reads the adapter and
the replayed load carries its tensors, so every rank puts the same weights in the same slot) must happen on all
ranks in the same order (the layers all-reduce inside). Rank 0 broadcasts (method, args) over the group before
running the call itself; followers loop on the broadcasts. Pure reads (length) stay local.

A follower that cannot take rank 0's next call (its bytes do not decode there, say a LoRA load's tensors, or the
group broke) is out of lock-step for good: it ends its process (run_follower). Its thread alone ending left
rank 0 waiting in its next collective for the group's timeout (30 min on gloo); a closed peer fails rank 0's
next broadcast at once (gloo: "Connection closed by peer"), so the engine step fails (EngineError) instead. On
NCCL a dead peer is noticed at the group's timeout, by torch's NCCL watchdog.

A group with a dead member never works again. Rank 0 notes it (BroadcastRunner.lost) when a broadcast fails, or
when a replayed call fails other than by a refusal (DETERMINISTIC), and refuses every replayed call from then on;
its poll carries the note, and the driver (cluster.RemoteEngine, which also watches every follower's actor) fails
the engine, naming the rank that died.

A replayed call may fail on one rank only (a CUDA OOM on rank 0, which also holds the engine's tensors; a
MemoryError on a follower), maybe mid-forward, with the others inside its all-reduces. Only a refusal by the
runner's checks (DETERMINISTIC, raised before any collective, alike on every rank as they hold the same state)
leaves the ranks in lock-step. Anything else ends the group: a follower ends its process (rank 0's collective fails
at once: "Connection closed by peer"); rank 0 notes the group lost and sends nothing more (a ping after it once met
a follower's pending all-reduce: every request then waited out the group's timeout before failing).

A follower waits for rank 0's next call inside a collective, which fails at the group's timeout (a follower that
outwaited it ended, and the idle engine's next request failed). So rank 0 sends a PING whenever no call went out
for a quarter of the timeout (keepalive_s), from its own thread: a lock keeps the engine's calls, the pings and
the STOP one at a time on the group (two threads in collectives at once would interleave their messages). A dead
follower fails a ping at once (or at the timeout, hung), so the group is noted broken while the engine idles; a
dead rank 0 sends no pings, so its followers still end at the timeout.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

REPLAYED = frozenset({"add", "free", "truncate", "extend", "rename", "copy_prefix", "load_lora", "evict_lora"})
STOP = "__stop__"
PING = "__ping__"  # keep-alive while idle (followers skip it)
FOLLOWER_LOST_EXIT = 70  # a follower's exit status once it lost lock-step (EX_SOFTWARE)
# A replayed call's refusals that every rank raises alike before any collective: the runner's checks of its
# arguments against the sequences' state, which every rank holds the same (ModelRunner raises ValueError for them).
DETERMINISTIC = ValueError


def keepalive_s(group_timeout: timedelta) -> float:
    """How long rank 0 may send nothing: a quarter of the group's timeout, so a ping late by a slow call or a
    busy host still reaches a waiting follower well in time."""
    return group_timeout.total_seconds() / 4


class BroadcastRunner:
    """Rank 0's view of a tensor-parallel runner: same API as ModelRunner. Pings the followers while idle."""

    def __init__(self, runner, group, group_timeout: timedelta = dist.constants.default_pg_timeout):
        """group_timeout: the one the group was made with (init_process_group's; gloo's default here)."""
        self._runner, self._group = runner, group
        self.lost: str | None = None  # why the group broke (a rank died): no replayed call runs from then on
        self._lock = threading.Lock()  # one thread at a time in the group's collectives (see the module's docstring)
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()  # STOP sent (or being sent): no pings from then on
        self._pinger = threading.Thread(target=self._keep_alive, args=(keepalive_s(group_timeout),), daemon=True,
                                        name="saguaro-tp-keepalive")
        self._pinger.start()

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if name not in REPLAYED:
            return attr

        def replayed(*args, **kwargs):  # (add's lora_slot: every rank runs the sequence through the same slot)
            with self._lock:  # (the call's own collectives, the layers' all-reduces, under it too)
                try:
                    self._broadcast(name, args, kwargs)
                    try:
                        return attr(*args, **kwargs)
                    except DETERMINISTIC:
                        raise  # every rank refused it alike, before any collective: the followers wait for the next
                    except Exception as err:
                        raise self._lose(f"rank 0's {name} failed: {err!r}") from err
                finally:
                    self._last_sent = time.monotonic()  # the followers wait for the next call from here
        return replayed

    def _broadcast(self, name: str, args: tuple, kwargs: dict) -> None:
        """Under self._lock."""
        if self.lost:
            raise RankLost(self.lost)
        try:
            dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self._group)
        except RuntimeError as err:  # the backend's failures (gloo, NCCL, DistError); pickling raises others
            raise self._lose(f"rank 0's broadcast of {name} failed: {err}") from err

    def _lose(self, why: str) -> RankLost:
        """Note the group broken for good (no call, no ping from now on); the RankLost to raise."""
        self.lost = why
        log.error("tensor-parallel group broken: %s", why)
        return RankLost(why)

    def _keep_alive(self, interval_s: float) -> None:
        """The pinger's thread: a PING once nothing went out for interval_s; ends with the group or at STOP."""
        while not self._stopped.wait(max(0.0, self._last_sent + interval_s - time.monotonic())):
            with self._lock:
                if self._stopped.is_set() or self.lost:
                    return
                if time.monotonic() - self._last_sent < interval_s:
                    continue  # a call went out meanwhile
                try:
                    self._broadcast(PING, (), {})
                except RankLost:
                    return  # (noted in self.lost: the next call and the poll report it)
                finally:
                    self._last_sent = time.monotonic()

    def stop_followers(self) -> None:
        """STOP, after any call in flight on the engine's thread (its join may have timed out); no pings after."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            if not self.lost:  # (a broken group has nobody to tell)
                self._broadcast(STOP, (), {})


class RankLost(RuntimeError):
    """Rank 0's tensor-parallel group broke (a rank died, or left lock-step): no call can run on it again."""


class FollowerLost(RuntimeError):
    """A follower could not take rank 0's next call: it cannot stay in lock-step."""


def run_follower(runner, group) -> None:
    """A follower rank's thread: follow rank 0; once it cannot, log why and end the process (see the module's
    docstring: a follower that carried on would hang rank 0, or diverge from it)."""
    try:
        follow(runner, group)
    except FollowerLost:
        log.critical("tensor-parallel follower lost lock-step with rank 0; ending this rank's process so that "
                     "rank 0's next collective fails instead of waiting (LLM.rebuild() starts fresh ranks)",
                     exc_info=True)
        sys.stderr.flush()
        os._exit(FOLLOWER_LOST_EXIT)


def follow(runner, group) -> None:
    """Followers: replay rank 0's calls until it says stop; FollowerLost when the next call cannot be taken."""
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=group)
        except Exception as err:  # noqa: BLE001 - undecodable bytes or a broken group: lock-step is lost either way
            raise FollowerLost(f"cannot take rank 0's next call: {err!r}") from err
        name, args, *rest = message[0]  # (name, args, kwargs); kwargs may be left out
        kwargs = rest[0] if rest else {}
        if name == STOP:
            return
        if name == PING:
            continue
        try:
            getattr(runner, name)(*args, **kwargs)
        except DETERMINISTIC:  # rank 0 ran the same checks on the same state and refused alike: it carries on
            # (Engine.reset frees every sequence), so must this rank, or rank 0 waited in its next broadcast.
            log.exception("tensor-parallel follower: replayed %s refused (as it was on rank 0)", name)
        except Exception as err:  # noqa: BLE001 - this rank alone, maybe mid-forward: rank 0 waits in a collective
            raise FollowerLost(f"replayed {name} failed on this rank: {err!r}") from err
