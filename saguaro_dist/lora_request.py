"""vLLM's LoRARequest (vllm/lora/request.py) and its LoRAConfig's limits (vllm/config/lora.py): which PEFT adapter a
request runs, checked at the edge. Light (no torch): Config and the client side import it."""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks


@dataclass
class LoRARequest:
    """One adapter a request runs through (vLLM's fields). lora_int_id (>= 1) names the adapter in the engine:
    it is loaded once per id, and an id keeps naming one lora_path unless a load_inplace request names another.
    lora_path: a PEFT folder (adapter_config.json + adapter_model.safetensors or .bin) or a Hugging Face id.
    load_inplace: load it again from lora_path even if the engine holds it, lora_path a new one or not (vLLM's: RL
    weight sync loads each step's folder under one id; here at the adapter's next slot, once no running request
    uses the old weights; the id's prefix-cache rows go). tensorizer_config_dict: vLLM's tensorizer loading, refused. Equal and hashed by
    lora_name, as vLLM's."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __post_init__(self):
        if isinstance(self.lora_path, os.PathLike):
            self.lora_path = os.fspath(self.lora_path)
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path.strip():
            raise ValueError(f"LoRARequest.lora_path cannot be empty: a PEFT adapter folder or a Hugging Face id, "
                             f"got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"LoRARequest.base_model_name must be a string or None, got {self.base_model_name!r}")
        if self.tensorizer_config_dict is not None:
            raise ValueError("LoRARequest.tensorizer_config_dict: tensorizer loading is not supported (a PEFT folder "
                             "or Hugging Face id in lora_path)")
        if type(self.load_inplace) is not bool:
            raise ValueError(f"LoRARequest.load_inplace must be True or False, got {self.load_inplace!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


def check_lora_config(enable_lora, max_loras, max_lora_rank, max_cpu_loras=None) -> None:
    """Config's LoRA fields, as vLLM's LoRAConfig takes them (max_loras >= 1, max_lora_rank one of MaxLoRARanks,
    max_cpu_loras None (max_loras) or >= max_loras)."""
    if not isinstance(enable_lora, bool):
        raise ValueError(f"enable_lora must be true or false, got {enable_lora!r}")
    if type(max_loras) is not int or max_loras < 1:
        raise ValueError(f"max_loras must be an integer >= 1 (adapters in one batch), got {max_loras!r}")
    if type(max_lora_rank) is not int or max_lora_rank not in MAX_LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, got {max_lora_rank!r}")
    if max_cpu_loras is not None and (type(max_cpu_loras) is not int or max_cpu_loras < max_loras):
        raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({max_loras}): adapters kept read in host "
                         f"memory, those in slots included; got {max_cpu_loras!r}")


def per_prompt(lora_request, n: int) -> list[LoRARequest | None]:
    """vLLM's lora_request argument (None, one LoRARequest for every prompt, or a list of one per prompt) as n."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)) or not all(r is None or isinstance(r, LoRARequest)
                                                              for r in lora_request):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, "
                         f"got {lora_request!r}")
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_request for {n} prompts")
    return list(lora_request)


ONE_ID_ONE_ADAPTER = "one id, one adapter"  # the end of a refusal of an id bound to another path


def not_loaded_note(lora_int_id: int) -> str:
    """The end of the engine's error for a request whose adapter never loaded (its id is free again): the words
    the LLM's edge goes by, since on Ray only an error's text reaches the driver."""
    return f" (not loaded: lora_int_id {lora_int_id} may name a corrected lora_path)"


@dataclass
class AdapterClaim:
    """AdapterIds.claim's answer. read: request bound its id (a new id, or a load_inplace naming a new path), its
    adapter is to be read; previous: the id's request before; prior: the submission of an earlier claim of the id
    still in flight (a request goes to the engine after it, in the order the calls were made); done: this claim's."""
    request: LoRARequest
    read: bool
    previous: LoRARequest | None
    prior: Future | None
    done: Future | None


def needs_read(known: LoRARequest | None, request: LoRARequest) -> bool:
    """Whether an id bound to `known` must be bound to request's path (its adapter read); ValueError if request
    names another path without load_inplace."""
    known_path = None if known is None else known.lora_path
    if known_path not in (None, request.lora_path) and not request.load_inplace:
        raise ValueError(f"lora_int_id {request.lora_int_id} names adapter {known_path!r}; lora_request "
                         f"{request.lora_name!r} names it with lora_path {request.lora_path!r} (without "
                         f"load_inplace): {ONE_ID_ONE_ADAPTER}")
    return known_path != request.lora_path


class AdapterIds:
    """lora_int_id -> the request that bound it (its lora_path): a later request naming the id with another path
    is refused, unless it sets load_inplace, which binds the id to its path (vLLM's load_inplace reloads an id from
    whatever path it names; vLLM runs a plain request under an id's last weights whatever its path, here such a
    request is refused: it would run another adapter's weights than it names). An id whose adapter failed to
    load is forgotten (vLLM's: a failed load registers nothing)."""

    def __init__(self):
        self._bound: dict[int, LoRARequest] = {}
        self._pending: dict[int, Future] = {}  # id -> the last claim still to enter the engine (its adapter read)
        self._lock = threading.Lock()  # the LLM checks from callers' threads

    def check(self, request: LoRARequest) -> bool:
        """Raise ValueError if the id names another path and request is no load_inplace; True when the id is not
        bound to request's path yet (a new id, or a load_inplace naming a new path): its adapter is to be read."""
        with self._lock:
            return needs_read(self._bound.get(request.lora_int_id), request)

    def claim(self, request: LoRARequest) -> AdapterClaim:
        """check, and bind the id to request's path at once when it is not yet (the caller's program order, not the
        order its adapter reads finish: a plain request for a load_inplace request's new path, sent just after it,
        is not refused while that one is still read). settle the claim once its request was submitted or failed."""
        with self._lock:
            known = self._bound.get(request.lora_int_id)
            read, prior = needs_read(known, request), self._pending.get(request.lora_int_id)
            if not read:
                return AdapterClaim(request, False, known, prior, None)
            self._bound[request.lora_int_id] = request
            done = self._pending[request.lora_int_id] = Future()
        return AdapterClaim(request, True, known, prior, done)

    def settle(self, claim: AdapterClaim, ok: bool) -> None:
        """A claiming request was submitted (ok) or failed before: a failed one's id goes back to the path it had,
        unless another request rebound it meanwhile. Requests waiting for it to enter the engine go on."""
        if claim.done is None:
            return
        with self._lock:
            key = claim.request.lora_int_id
            if not ok and self._bound.get(key) is claim.request:
                if claim.previous is None:
                    del self._bound[key]
                else:
                    self._bound[key] = claim.previous
            if self._pending.get(key) is claim.done:
                del self._pending[key]
        if not claim.done.done():
            claim.done.set_result(ok)

    def bind(self, request: LoRARequest) -> None:
        """Bind a new id to request's path, or a bound one to a load_inplace request's new path (else check)."""
        with self._lock:
            known = self._bound.get(request.lora_int_id)
            if known is None or (request.load_inplace and known.lora_path != request.lora_path):
                self._bound[request.lora_int_id] = request
        self.check(request)

    def current(self, lora_int_id: int) -> LoRARequest | None:
        """The request whose path the id names now (the last load_inplace one, else the first)."""
        with self._lock:
            return self._bound.get(lora_int_id)

    def release(self, request: LoRARequest) -> None:
        """Forget the id's path if it is this request's (its adapter never loaded)."""
        with self._lock:
            known = self._bound.get(request.lora_int_id)
            if known is not None and known.lora_path == request.lora_path:
                del self._bound[request.lora_int_id]

    def release_if_not_loaded(self, request: LoRARequest, err: BaseException) -> None:
        """Forget the id's path if err (the request's failure) is the engine's report that its adapter never
        loaded (the engine forgot the id too; a load that failed while the id held a slot keeps it bound), or its
        refusal of an id it holds under another path: the engine is the authority (a failed load of one request
        may free the id here just after another request of it loaded there)."""
        ends = (not_loaded_note(request.lora_int_id), ONE_ID_ONE_ADAPTER)
        if isinstance(err, ValueError) and str(err).endswith(ends):
            self.release(request)
