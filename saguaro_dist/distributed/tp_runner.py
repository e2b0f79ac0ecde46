"""Tensor-parallel target ranks: rank 0 drives, the others replay its runner calls.

Every ModelRunner call that runs a forward or changes KV state (or a LoRA slot: rank 0 reads the adapter and
the replayed load carries its tensors, so every rank puts the same weights in the same slot) must happen on all
ranks in the same order (the layers all-reduce inside). Rank 0 broadcasts (method, args) over the group before
running the call itself; followers loop on the broadcasts. Pure reads (length) stay local.
"""
from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger(__name__)

REPLAYED = frozenset({"add", "free", "truncate", "extend", "rename", "copy_prefix", "load_lora", "evict_lora"})
STOP = "__stop__"


class BroadcastRunner:
    """Rank 0's view of a tensor-parallel runner: same API as ModelRunner."""

    def __init__(self, runner, group):
        self._runner, self._group = runner, group

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if name not in REPLAYED:
            return attr

        def replayed(*args, **kwargs):  # (add's lora_slot: every rank runs the sequence through the same slot)
            dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self._group)
            return attr(*args, **kwargs)
        return replayed

    def stop_followers(self) -> None:
        dist.broadcast_object_list([(STOP, (), {})], src=0, group=self._group)


def follow(runner, group) -> None:
    """Followers: replay rank 0's calls until it says stop."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        name, args, *rest = message[0]  # (name, args, kwargs); kwargs may be left out
        kwargs = rest[0] if rest else {}
        if name == STOP:
            return
        try:
            getattr(runner, name)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - rank 0 ran the same call on the same state and failed alike
            # A follower that stopped here would leave rank 0, which reports the failure and carries on
            # (Engine.reset frees every sequence), waiting forever in its next broadcast or collective.
            log.exception("tensor-parallel follower: replayed %s failed (as it did on rank 0)", name)
