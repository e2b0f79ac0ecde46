"""The served model names and LoRA adapters (vLLM's OpenAIServingModels, vllm/entrypoints/openai/models/serving.py):
which name runs which adapter, /v1/models' cards, and runtime loading behind VLLM_ALLOW_RUNTIME_LORA_UPDATING.

Each adapter runs under a lora_int_id (>= 1) the server hands out once: --lora-modules take 1..N in order, each
runtime load that reaches the engine the next (spent even if it fails there, as vLLM's). An id is never handed out
again (not after an unload, nor for a load_inplace reload): the engine binds an id to one path, keeps its prefix
cache per id, and loads a new id's weights afresh. A load puts the adapter it read into the engine's host memory (vLLM's add_lora: its LRU of max_cpu_loras, the most
recent): while it stays there its requests read no files, so its folder may go once the load answered; one dropped
past max_cpu_loras is read again from its path, and if that fails its requests get a 500 saying to load it again
(the server's state, not the client's fault). An unload, or a load_inplace reload of the
name, removes the old id from the engine (vLLM's remove_lora) once its running and queued requests end, so its slot and
host memory serve the adapters loaded after it."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from saguaro_dist.engine.lora_slots import AdapterReadError
from saguaro_dist.lora_request import LoRARequest
from saguaro_dist.model.lora_adapter import CONFIG_FILE, local_adapter_dir, names_no_adapter, resolve_adapter_dir
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.lora_modules import LoRAModule, adapter_refusal, check_adapter, check_lora_modules

log = logging.getLogger(__name__)


class ServedModels:
    """Base names (requests may give any, replies name the first) and adapters by name."""

    def __init__(self, base_names: tuple[str, ...], config, modules: tuple[LoRAModule, ...] = (),
                 replicas: Callable[[], int] | None = None):
        """replicas: how many replicas may serve these names now (Serve's deployment, read at each runtime load
        or unload: a config file may have changed it after the app was built); None: this server alone."""
        check_lora_modules(modules, base_names, bool(getattr(config, "enable_lora", False)))
        self.base_names, self.config, self._replicas = base_names, config, replicas
        self._last_id = 0  # the last lora_int_id handed out
        self.adapters: dict[str, LoRARequest] = {}
        self._lock = asyncio.Lock()  # a load's check and its entry, one at a time (vLLM locks per name)
        self._read_on_target: Callable[[str], None] | None = None  # check_on_target's `read`
        self._add_to_engine: Callable[[LoRARequest], object] | None = None  # check_on_target's `add`
        for m in modules:  # start-up: an adapter that cannot load fails the replica, with the reason
            check_adapter(m.name, m.path, config)
            self.adapters[m.name] = self._request(m.name, m.path, m.base_model_name)

    def check_on_target(self, read: Callable[[str], None],
                        add: Callable[[LoRARequest], object] | None = None) -> None:
        """Each --lora-modules adapter read by `read` (LLM.check_lora_adapter: where the engine's target loads it,
        on Ray rank 0's node), as vLLM's workers load static adapters at start-up: one missing there fails
        start-up, with the reason, instead of every request naming it. add (LLM.add_lora, which reads there too):
        each is put into the engine's host memory instead, as vLLM's static adapters (its LRU of max_cpu_loras)."""
        self._read_on_target, self._add_to_engine = read, add
        for request in self.adapters.values():
            try:
                add(request) if add is not None else read(request.lora_path)
            except ValueError as err:
                raise ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) on the engine's target: "
                                 f"{err}") from None

    def _request(self, name: str, path: str, base: str | None = None) -> LoRARequest:
        self._last_id += 1
        return LoRARequest(name, self._last_id, path, base_model_name=base)

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """(the name replies give, the adapter to run): a missing model is the base, as vLLM's."""
        if requested in self.adapters:
            return requested, self.adapters[requested]
        if requested in (None, "", *self.base_names):
            return self.base_names[0], None
        raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")

    def cards(self, max_model_len: int) -> list[dict]:
        """/v1/models: the base names, then the adapters (parent: their base model's name, root: their path)."""
        base = [_card(name, self.config.model, None, max_model_len) for name in self.base_names]
        return base + [_card(r.lora_name, r.lora_path, r.base_model_name or self.base_names[0], None)
                       for r in self.adapters.values()]

    async def load(self, name: str, path: str, load_inplace: bool = False,
                   remove: Callable[[int], object] | None = None) -> str:
        """vLLM's load: the adapter read and checked, then put into the engine's host memory (check_on_target's add)
        before the answer. remove (LLM.remove_lora): a load_inplace reload frees the id it replaces (else each
        reload of an RL loop kept one more adapter in the engine)."""
        self._check_one_replica("load")
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if not getattr(self.config, "enable_lora", False):
            raise APIError(400, "LoRA is off on this server: start it with --enable-lora")
        if name in self.base_names:
            raise APIError(400, f"{name!r} is a served model name; an adapter needs a name of its own", param="lora_name")
        async with self._lock:
            old = self.adapters.get(name)
            if old is not None and not load_inplace:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                    "adapter in place, set 'load_inplace' to True.")
            request = LoRARequest(name, self._last_id + 1, path)  # a fresh id
            # off the event loop: reads files, and on Ray waits for rank 0's reply
            await asyncio.to_thread(_check_runtime_adapter, request, self.config, not self._engine_reads_here())
            await self._add_on_target(request, remove)
            self.adapters[name] = request
            if old is not None and remove is not None:  # its running requests end on its weights first
                await asyncio.to_thread(remove, old.lora_int_id)
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str, remove: Callable[[int], object] | None = None) -> str:
        """vLLM's unload: remove (LLM.remove_lora) frees the adapter's engine slot and host copy, once the requests
        running it finished (on its weights); new requests naming it get a 404. An unknown name changes nothing."""
        self._check_one_replica("unload")
        if not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            if name not in self.adapters:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.")
            if remove is not None:  # off the event loop: waits for the engine's loop thread (or False: never run)
                await asyncio.to_thread(remove, self.adapters[name].lora_int_id)
            del self.adapters[name]
        log.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _add_on_target(self, request: LoRARequest, remove: Callable[[int], object] | None) -> None:
        """The engine's add (or check) of a fresh id. The id is spent from here, whatever the engine answers (vLLM's
        lora_id_counter.inc before add_lora): an add whose answer timed out still binds the id later, and a later load
        handed it again would be refused for good. Only a read refused in this process bound nothing for sure."""
        self._last_id = request.lora_int_id
        try:
            await asyncio.to_thread(_read_on_target, request, self._on_target(request))
        except AdapterReadError as err:  # (in this process: on Ray only its text comes back, a ValueError)
            self._last_id -= 1
            raise APIError(400, str(adapter_refusal(request.lora_name, request.lora_path, err)),
                           param="lora_path") from None
        except TimeoutError:
            _drop_late(request, remove)
            raise

    def _engine_reads_here(self) -> bool:
        """Whether the engine's add reads the adapter in this process (no Ray cluster): then it is the load's only
        read of the tensors (the server's own check only looks for the adapter), else its node's disk may differ."""
        return self._add_to_engine is not None and getattr(self.config, "cluster", None) is None

    def _on_target(self, request: LoRARequest) -> Callable[[str], None] | None:
        """The read where the engine's target runs the adapter: its add (the copy stays there), else its check."""
        if self._add_to_engine is not None:
            return lambda _path: self._add_to_engine(request)
        return self._read_on_target

    def _check_one_replica(self, action: str) -> None:
        """A runtime load or unload reaches the one replica that takes the request: with others (or an autoscaler
        that may add some) replicas would serve different adapters under one name."""
        replicas = self._replicas() if self._replicas else 1
        if replicas > 1:
            raise APIError(400, f"Cannot {action} a LoRA adapter at runtime: this deployment may run {replicas} "
                                "replicas (num_replicas, or autoscaling's max_replicas) and the request reaches one "
                                "only. Runtime LoRA updates need one replica; serve adapters to every replica with "
                                "--lora-modules (lora_modules) instead.")


def _card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "saguaro-dist", "root": root, "parent": parent,
            "max_model_len": max_model_len}


def _not_found(request: LoRARequest) -> APIError:
    return APIError(404, f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}")


def _check_runtime_adapter(request: LoRARequest, config, read: bool = True) -> None:
    """vLLM's answers: no adapter at the path (no such folder, one without adapter_config.json, a Hub id the Hub
    cannot provide, a path no folder can have) is a 404 with LoRAAdapterNotFoundError's message; one that cannot
    run on this base model a 400 with the reason. Here, before _read_on_target reads it where the engine runs it.
    read=False: only the 404's checks (the engine's add, in this process, reads it once and answers the 400's)."""
    name, path = request.lora_name, request.lora_path
    missing = _not_found(request)
    local = local_adapter_dir(path)
    if local is not None:
        if not (local / CONFIG_FILE).is_file():
            raise missing
    else:
        try:
            resolve_adapter_dir(path)  # a Hub id (fetched now, read again from the cache below); else a ValueError
        except (ValueError, OSError):
            raise missing from None
    if not read:
        return
    try:
        check_adapter(name, path, config)
    except ValueError as err:
        raise APIError(400, str(err), param="lora_path") from None


def _read_on_target(request: LoRARequest, read_on_target: Callable[[str], None] | None) -> None:
    """The engine's read (its add): a ValueError is the client's 404 / 400; anything else (a timed-out wait for
    the engine's thread, an engine error) goes up as the server's error."""
    try:
        if read_on_target is not None:
            read_on_target(request.lora_path)
    except AdapterReadError:  # read in this process: the caller answers check_adapter's 400
        raise
    except ValueError as err:
        where = f"LoRA adapter {request.lora_name!r} ({request.lora_path}) on the engine's target: {err}"
        if names_no_adapter(str(err)):
            raise APIError(404, f"{_not_found(request).message} ({where})") from None
        raise APIError(400, where, param="lora_path") from None


def _drop_late(request: LoRARequest, remove: Callable[[int], object] | None) -> None:
    """An add whose wait for the engine timed out still binds its id once its chore runs, and no name serves that:
    a remove queued after it (the engine runs chores in order) drops the copy. Not waited for: the engine is slow
    now, and the load's answer is a 500 already."""
    if remove is not None:
        threading.Thread(target=_remove_quietly, args=(remove, request), name="saguaro-lora-drop", daemon=True).start()


def _remove_quietly(remove: Callable[[int], object], request: LoRARequest) -> None:
    try:
        remove(request.lora_int_id)
    except Exception as err:  # noqa: BLE001 - a timed-out wait: the remove still runs after the add
        log.info("LoRA adapter %r (id %d) whose load timed out: its removal not confirmed (%s: %s)",
                 request.lora_name, request.lora_int_id, type(err).__name__, err)
