"""The target's LoRA adapters in its runner's slots (vLLM's max_loras: adapters one batch runs at once).

An adapter (named by its LoRARequest's lora_int_id) is loaded at the first request that runs it, into an empty
slot or the least recently used one that no sequence holding a KV row runs; a request whose adapter has no slot
and can get none waits (Engine._admit). Reloading a slot (another adapter, or load_inplace) drops the prefix
cache's kept rows computed through what it held: the runner refuses to copy KV across loads of a slot, and the
engine never asks it to.

Up to max_cpu_loras adapters once read stay in host memory (vLLM's max_cpu_loras, an LRU; those in slots among
them): one evicted from its slot and asked for again reloads from there, without reading its files. A
load_inplace request drops its adapter's copy, so it is read again (from its lora_path, which may be a new
one: the id is bound to it, and requests already queued under the id run the weights loaded from there).

add (vLLM's add_lora: a runtime load, a served --lora-modules adapter) puts an adapter read beforehand into that LRU
(the most recent, evictable like any other): while it stays there its requests read no files, so its folder may go
once add returned. One dropped past max_cpu_loras is read again from its path at its next load, as vLLM's; if its
files are gone that request fails with AdapterDroppedError (the server's state, not the request's fault).

remove (vLLM's remove_lora, at a runtime unload) empties the adapter's slot and forgets its host copy and its id's
path, so the slot serves the next adapter; while the engine's sequences (running or queued) name it, that waits until
none does (they finish on its weights, as vLLM's running requests do), and a request naming it again cancels the wait
(one naming another path, or an add of one, binds the id to it, as a load_inplace one: vLLM loads it).
add of an id already held from the same path (no load_inplace) only marks it the most recently used, as vLLM's."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import OrderedDict

from saguaro_dist.engine.sequence import namespace_lora_id
from saguaro_dist.lora_request import AdapterIds, LoRARequest, not_loaded_note
from saguaro_dist.model.lora_adapter import load_adapter

log = logging.getLogger(__name__)


def as_reload(request: LoRARequest) -> LoRARequest:
    """request bound as a load_inplace one (an id removed while named, named again, or added again): requests
    queued under the id load its weights, as vLLM's run an id's last load."""
    return dataclasses.replace(request, load_inplace=True)


class AdapterLoadError(ValueError):
    """A request's adapter could not be loaded: that request fails alone. Its text ends with not_loaded_note when
    the id holds no slot (nothing registered under it: a later request may name it with another path)."""


class AdapterReadError(ValueError):
    """add_lora could not read an adapter's files (where the engine's target runs): nothing was bound."""


class AdapterDroppedError(AdapterLoadError):
    """An added adapter dropped from host memory past max_cpu_loras, whose files cannot be read again: the
    engine's state, not the request's fault (the server answers a 500; on Ray only the text travels: PHRASE)."""
    PHRASE = "was dropped from host memory past max_cpu_loras"


class HostAdapters:
    """Read adapters (LoRAAdapter) by lora_int_id, the least recently used dropped past `capacity`, never one a
    slot holds (the runner keeps it anyway: dropping it would only read its files again; capacity >= slots)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._adapters: OrderedDict[int, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._adapters)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def get(self, lora_int_id: int):
        adapter = self._adapters.get(lora_int_id)
        if adapter is not None:
            self._adapters.move_to_end(lora_int_id)
        return adapter

    def put(self, lora_int_id: int, adapter, held: set[int]) -> None:
        """Keep it (most recent); held: the ids in slots now and those removed but still named, never dropped."""
        self._adapters[lora_int_id] = adapter
        self._adapters.move_to_end(lora_int_id)
        for old in [i for i in self._adapters if i not in held][:max(0, len(self._adapters) - self.capacity)]:
            del self._adapters[old]

    def drop(self, lora_int_id: int) -> None:
        self._adapters.pop(lora_int_id, None)


class AdapterSlots:
    def __init__(self, runner, prefixes, max_loras: int, max_cpu_loras: int | None = None):
        """runner: the target's (ModelRunner, or rank 0's BroadcastRunner: loads replay on every rank);
        prefixes: its PrefixCache; max_cpu_loras: adapters kept read in host memory (None: max_loras)."""
        self.runner, self.prefixes = runner, prefixes
        self.host = HostAdapters(max_loras if max_cpu_loras is None else max_cpu_loras)
        self.held: list[LoRARequest | None] = [None] * max_loras  # slot -> the adapter it holds
        self.last_used = [0] * max_loras
        self.ids = AdapterIds()
        self.stale: set[int] = set()  # adapters a load_inplace request asked to load again (at their next start)
        self.removed: set[int] = set()  # adapters removed while named: freed once no sequence names them
        self.added: set[int] = set()  # adapters put here by add, until removed (see _read_again)
        self._ticks = itertools.count(1)

    def note(self, request: LoRARequest | None) -> None:
        """A request entered the engine: its id must keep its path (ValueError) unless it is a load_inplace one
        (the id is bound to its path then); load_inplace marks it stale."""
        if request is None:
            return
        rebind = self._rebinds_removed(request)
        self.ids.bind(as_reload(request) if rebind else request)
        self.removed.discard(request.lora_int_id)  # asked for again: it stays (vLLM's request re-adds it)
        if request.load_inplace or rebind:
            self.host.drop(request.lora_int_id)  # its next load reads the files again (a new path: no added one's)
            self.added.discard(request.lora_int_id)
            if self.slot_of(request.lora_int_id) is not None:
                self.stale.add(request.lora_int_id)

    def read(self, request: LoRARequest):
        """The adapter's files read and checked (ValueError: why it cannot run), in the runner's dtype. Touches no
        state: add's caller reads off the engine's thread."""
        adapter = load_adapter(request.lora_path, self.runner.config, self.runner.lora.max_lora_rank)
        return adapter.cast(self.runner.dtype)

    def add(self, request: LoRARequest, adapter) -> bool:
        """vLLM's add_lora: bind the id to request's path (ValueError if it names another without load_inplace) and
        put `adapter` (read from it) into host memory, the most recent (kept even while every slot holds another);
        a slot holding an older load of the id reloads at its next start (from this copy). True, as vLLM's.
        An id removed while its requests run takes the new read as a load_inplace one would (vLLM loads it).
        An id already holding this path's weights (touch's case) keeps them: a second read is never installed, or
        the id would switch weights silently once its slot was evicted."""
        lora_id = request.lora_int_id
        if self.touch(request):
            return True
        reload = request.load_inplace or lora_id in self.removed
        self.ids.bind(as_reload(request) if reload else request)
        self.removed.discard(lora_id)
        self.added.add(lora_id)
        self.host.put(lora_id, adapter, self._held_ids() | self.removed | {lora_id})
        if self.slot_of(lora_id) is not None and reload:
            self.stale.add(lora_id)
        return True

    def holds(self, request: LoRARequest) -> bool:
        """Whether add of request has nothing to read: its id is bound to its path, it is no load_inplace one, the
        id is not being removed, and a slot or host memory holds its weights. Only reads (any thread may ask)."""
        lora_id, current = request.lora_int_id, self.ids.current(request.lora_int_id)
        return (not request.load_inplace and lora_id not in self.removed and current is not None
                and current.lora_path == request.lora_path and lora_id not in self.stale
                and (self.slot_of(lora_id) is not None or lora_id in self.host))

    def touch(self, request: LoRARequest) -> bool:
        """vLLM's add_lora of an adapter it holds: only marked the most recently used. Whether request holds()."""
        if not self.holds(request):
            return False
        self.host.get(request.lora_int_id)
        slot = self.slot_of(request.lora_int_id)
        if slot is not None:
            self.last_used[slot] = next(self._ticks)
        return True

    def _rebinds_removed(self, request: LoRARequest) -> bool:
        """A request naming a removed id (its old requests still running) with another path: the id is bound to the
        new path, as by load_inplace (vLLM loads it; the old weights serve the running requests to their end)."""
        current = self.ids.current(request.lora_int_id)
        return (request.lora_int_id in self.removed and current is not None
                and current.lora_path != request.lora_path)

    def _held_ids(self) -> set[int]:
        return {r.lora_int_id for r in self.held if r is not None}

    def remove(self, lora_int_id: int, busy: set[int]) -> bool:
        """vLLM's remove_lora: whether the engine held anything of the adapter (a slot, a host copy, its id's path).
        busy: the adapters of the engine's sequences, queued ones too; if it is among them, its slot and host copy
        are freed by free_removed once none names it (a queued one runs what was loaded, whatever its files hold)."""
        known = (self.slot_of(lora_int_id) is not None or self.host.get(lora_int_id) is not None
                 or self.ids.current(lora_int_id) is not None)
        if lora_int_id in busy:  # its host copy stays too: a queued request may load it once a slot frees
            self.removed.add(lora_int_id)
        else:
            self._forget(lora_int_id)
        return known

    def free_removed(self, busy: set[int]) -> None:
        """Free the slots of removed adapters that no sequence names now (after a step released some)."""
        for lora_int_id in [i for i in self.removed if i not in busy]:
            self._forget(lora_int_id)

    def _forget(self, lora_int_id: int) -> None:
        """Empty its slot (its kept prefix rows go too), and free its id: a later request may bind it to any path."""
        self.removed.discard(lora_int_id)
        self.stale.discard(lora_int_id)
        self.added.discard(lora_int_id)
        self.host.drop(lora_int_id)
        slot = self.slot_of(lora_int_id)
        if slot is not None:
            self.runner.evict_lora(slot)  # no live sequence uses it (busy): the runner checks that too
            self._emptied(slot, self.held[slot])
            log.info("LoRA slot %d: adapter %d removed", slot, lora_int_id)
        current = self.ids.current(lora_int_id)
        if current is not None:
            self.ids.release(current)

    def slot_of(self, lora_int_id: int) -> int | None:
        return next((i for i, r in enumerate(self.held) if r is not None and r.lora_int_id == lora_int_id), None)

    def can_start(self, request: LoRARequest | None, busy: set[int]) -> bool:
        """Whether a sequence of `request`'s adapter can start now; busy: the adapters (lora_int_id) of the
        sequences holding rows."""
        if request is None:
            return True
        slot = self.slot_of(request.lora_int_id)
        if slot is not None:  # a reload (load_inplace) waits until nobody runs the old weights
            return request.lora_int_id not in self.stale or request.lora_int_id not in busy
        return self._free_slot(busy) is not None

    def acquire(self, request: LoRARequest | None, busy: set[int]) -> int | None:
        """The slot `request`'s sequence runs (None: the base model), loading the adapter if it has none.
        A load that fails (AdapterLoadError: the folder went, say) leaves every slot as it was."""
        if request is None:
            return None
        slot = self.slot_of(request.lora_int_id)
        if slot is None or request.lora_int_id in self.stale:
            slot = self._free_slot(busy) if slot is None else slot
            if slot is None:
                raise RuntimeError(f"no LoRA slot for adapter {request.lora_int_id} (can_start was not asked)")
            self._load(slot, self._to_load(request))
            self.stale.discard(request.lora_int_id)
        else:
            self.host.get(request.lora_int_id)  # in use: the most recent in host memory too (vLLM's LRU touch)
        self.last_used[slot] = next(self._ticks)
        return slot

    def _to_load(self, request: LoRARequest) -> LoRARequest:
        """What a load for `request` reads: the load_inplace request that rebound its id since it was queued (the
        id's weights now, as vLLM's), else itself (a path the id is no longer bound to fails at its load)."""
        current = self.ids.current(request.lora_int_id)
        return current if current is not None and current.load_inplace else request

    def _free_slot(self, busy: set[int]) -> int | None:
        """An empty slot, else the least recently used one whose adapter no sequence holding a row runs."""
        empty = [i for i, r in enumerate(self.held) if r is None]
        if empty:
            return empty[0]
        idle = [i for i, r in enumerate(self.held) if r.lora_int_id not in busy]
        return min(idle, key=self.last_used.__getitem__) if idle else None

    def _load(self, slot: int, request: LoRARequest) -> None:
        """Read the adapter here (or take it from host memory), then put it in the slot: on tensor-parallel
        ranks the runner's load_lora replays with the tensors read once (every rank runs the same weights,
        whatever each node's disk holds; a read that fails fails here, before any rank changed). Any failure to
        read it (a missing folder, a corrupt safetensors file, a config that is no object) fails its request alone."""
        old, lora_id = self.held[slot], request.lora_int_id
        try:
            self.ids.bind(request)  # again: a failed load of an earlier request for this id may have freed it
            adapter = self.host.get(lora_id)
            if adapter is None:  # (a load_inplace request dropped the copy it replaces, an add put a fresh one)
                adapter = self._read_again(request) if lora_id in self.added else self.read(request)
            self.runner.load_lora(slot, adapter)
            others = {r.lora_int_id for i, r in enumerate(self.held) if r is not None and i != slot}
            # only once it loaded: a copy that is good; removed ids queued requests still name are kept too (their
            # folder may be gone: an RL loop deletes the checkpoint it replaced)
            self.host.put(lora_id, adapter, others | self.removed | {lora_id})
        except AdapterDroppedError:  # nothing changed (its id stays bound: it is still added)
            raise
        except Exception as err:  # noqa: BLE001 - whatever the files hold, only this request fails
            self.host.drop(lora_id)
            if old is not None and self.runner.lora.adapters[slot] is None:  # the runner emptied the slot
                self._emptied(slot, old)
            never_loaded = self.slot_of(lora_id) is None
            if never_loaded:  # the id may name a good path later (the LLM's edge reads the note, and forgets it too)
                self.ids.release(request)
            raise AdapterLoadError(f"lora_request {request.lora_name!r}: {type(err).__name__}: {err}"
                                   + (not_loaded_note(lora_id) if never_loaded else "")) from None
        if old is not None:
            self._emptied(slot, old)
        self.held[slot] = request
        log.info("LoRA slot %d: adapter %d (%s) loaded%s", slot, request.lora_int_id, request.lora_name,
                 "" if old is None else f", replacing {old.lora_int_id}")

    def _read_again(self, request: LoRARequest):
        """An added adapter whose copy the LRU dropped: read from its path again (vLLM's), else AdapterDroppedError."""
        try:
            return self.read(request)
        except Exception as err:  # noqa: BLE001 - whatever the files hold now
            raise AdapterDroppedError(
                f"LoRA adapter {request.lora_name!r} (lora_int_id {request.lora_int_id}) {AdapterDroppedError.PHRASE} "
                f"({self.host.capacity}) and its files at {request.lora_path} cannot be read again "
                f"({type(err).__name__}: {err}): load it again (POST /v1/load_lora_adapter with load_inplace=true, "
                "or LLM.add_lora)") from None

    def _emptied(self, slot: int, old: LoRARequest) -> None:
        """The slot no longer holds `old`: nothing is held there, and the kept rows computed through its weights go."""
        self.held[slot] = None
        gone = old.lora_int_id
        self.prefixes.drop(lambda namespace: namespace_lora_id(namespace) == gone)
