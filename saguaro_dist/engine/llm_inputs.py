"""LLM's input edges: prompts (strings, token ids, vLLM's prompt dicts), SamplingParams and priorities
checked before any work and made into one PromptRequest of SamplingParams.n Sequences per prompt; chat's
arguments refused or checked the same way. Split from engine/llm.py (its LLM inherits RequestInputs)."""
from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace

from saguaro_dist.config import SchedulingPolicy
from saguaro_dist.engine.engine import check_prompt_ids
from saguaro_dist.engine.sequence import Sequence, check_cache_salt, engine_request_seed
from saguaro_dist.engine.text import encode_text
from saguaro_dist.lora_request import AdapterClaim, LoRARequest, per_prompt
from saguaro_dist.sampling_params import (SEED_MIN, SamplingParams, as_token_ids, as_tuple, check_against_model,
                                          truncate_prompt, until_context_end, with_bad_word_ids)


@dataclass
class PromptRequest:
    """One prompt as submitted: its SamplingParams.n samples, each a Sequence of its own, in index order."""
    request_id: str
    text: str | None
    samples: list[Sequence]


class RequestInputs:
    """LLM's validation of what callers submit. Reads the LLM's tokenizer, config, max_model_len, vocab_size,
    eos_token_ids, _grammars, _ids, _lora_ids, _target_config and default_sampling_params(), which LLM._setup
    makes."""

    def _requests(self, prompts, prompt_token_ids, sampling_params, priority=None,
                  cache_salt: str | None = None, lora_request=None) -> list[PromptRequest]:
        """Validate everything before any work; one PromptRequest (n Sequences) per prompt. cache_salt: every
        prompt's that names none (a prompt dict's "cache_salt" key names its own). lora_request: vLLM's (one for
        every prompt, or a list of one per prompt)."""
        texts, ids, salts = self._prompt_ids(prompts, prompt_token_ids)
        salts = [s if s is not None else check_cache_salt(cache_salt) for s in salts]
        params = self._params(sampling_params, len(ids))
        priorities = self._priorities(priority, len(ids))
        loras = self._lora_requests(lora_request, len(ids))
        # each distinct bad word tokenized once a call (a batch's prompts often share their settings: 10^4 prompts
        # with the same word tokenized it 2 x 10^4 times)
        encode = functools.cache(self._encode_bad_word) if self.tokenizer is not None else None
        out = []
        for text, tokens, p, rank, salt, lora in zip(texts, ids, params, priorities, salts, loras):
            tokens = truncate_prompt(tokens, p.truncate_prompt_tokens, self.max_model_len)
            p = until_context_end(p, len(tokens), self.max_model_len)
            p = with_bad_word_ids(p, encode)
            self._check_prompt(tokens, p)
            out.append(self._prompt_request(text, tokens, p, rank, salt, lora))
        return out

    def _prompt_request(self, text: str | None, tokens: list[int], params: SamplingParams, rank: int,
                        salt: str | None = None, lora: LoRARequest | None = None) -> PromptRequest:
        """params.n Sequences of the prompt; with n > 1, sample i's engine id is "<i>_<request id>" (vLLM's)."""
        request_id = uuid.uuid4().hex
        samples = [self._sample(seq_id, tokens, p, rank, salt, lora)
                   for seq_id, p in zip(sample_ids(request_id, params.n), sample_params(params))]
        return PromptRequest(request_id, text, samples)

    def _sample(self, seq_id: str, tokens: list[int], params: SamplingParams, rank: int,
                salt: str | None = None, lora: LoRARequest | None = None) -> Sequence:
        """One sample's Sequence. Under Config.seed an unseeded sample is seeded from it and its engine id (its
        order of arrival), as vLLM's seeded global RNG: the seed travels with it to every worker."""
        sid = next(self._ids)
        if self.config.seed is not None and params.seed is None:
            params = replace(params, seed=engine_request_seed(self.config.seed, sid))
        return Sequence(sid, seq_id, list(tokens), params, priority=rank, cache_salt=salt, lora_request=lora)

    def _lora_requests(self, lora_request, n: int) -> list[LoRARequest | None]:
        """Each prompt's adapter, checked before any work: LoRA on (enable_lora), one path per lora_int_id (a
        load_inplace request rebinds it to its own; in a batch naming an id and path with and without it, the
        load_inplace one is checked), and
        the adapter itself (read once per id: its files, its rank against max_lora_rank, its shapes against the
        target's) as the target will load it."""
        loras = per_prompt(lora_request, n)
        if any(r is not None for r in loras) and not self.config.enable_lora:
            raise ValueError("lora_request given, but LoRA is off: construct the LLM with enable_lora=True "
                             "(and max_loras / max_lora_rank as the adapters need)")
        for r in distinct_adapters(loras):
            claim = self._lora_ids.claim(r)
            if claim.prior is not None and not on_event_loop():  # (stream's own check runs on its loop: no wait)
                claim.prior.result()  # an earlier rebind of the id enters the engine first
            self._read_claimed(claim)
            self._lora_ids.settle(claim, ok=True)
        return loras

    def _read_claimed(self, claim: AdapterClaim) -> None:
        """Read a claim's adapter if it bound the id; a failed read gives the id back its previous path."""
        if claim.read:
            try:
                self._check_adapter(claim.request)
            except BaseException:
                self._lora_ids.settle(claim, ok=False)
                raise

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's add_lora: read the adapter now, where the target runs it (on Ray: rank 0), into the engine's host
        memory's LRU of max_cpu_loras (the most recent): while it stays there its requests read no files (its folder
        may go once this returned); one dropped from it is read again from its path at its next use (vLLM's).
        ValueError: why it cannot run (LoRA off, its id bound to another path, unreadable files)."""
        if not self.config.enable_lora:
            raise ValueError("add_lora, but LoRA is off: construct the LLM with enable_lora=True")
        claim = self._lora_ids.claim(lora_request)
        try:
            if claim.prior is not None:
                claim.prior.result()  # an earlier rebind of the id enters the engine first
            added = self._thread.add_lora(lora_request)
        except BaseException:
            self._lora_ids.settle(claim, ok=False)
            raise
        self._lora_ids.settle(claim, ok=True)
        return added

    async def _claim_adapter(self, lora_request) -> AdapterClaim | None:
        """stream's adapter: claimed before the first await (in the callers' program order), read off the event
        loop (on Ray: by rank 0, a round trip), then after an earlier rebind of its id has entered the engine
        (RL weight sync sends a load_inplace request and plain ones for its new path at once)."""
        if not (isinstance(lora_request, LoRARequest) and self.config.enable_lora):
            return None
        claim = self._lora_ids.claim(lora_request)
        try:
            if claim.read:
                await asyncio.to_thread(self._read_claimed, claim)
            if claim.prior is not None:
                await asyncio.wrap_future(claim.prior)
        except BaseException:
            self._lora_ids.settle(claim, ok=False)
            raise
        return claim

    def _settle_when_submitted(self, claim: AdapterClaim | None, submitted: asyncio.Future | None) -> None:
        """Settle stream's claim once its samples were submitted (None: it failed before)."""
        if claim is None:
            return
        if submitted is None:
            self._lora_ids.settle(claim, ok=False)
            return
        submitted.add_done_callback(lambda f: self._lora_ids.settle(claim, not f.cancelled() and f.exception() is None))

    def _check_adapter(self, request: LoRARequest) -> None:
        """Read the adapter where the target will: here on one host, on rank 0's node on Ray (check_lora_adapter:
        this machine's disk need not hold the folder)."""
        if self.config.cluster is not None:
            self.check_lora_adapter(request.lora_path)
            return
        from saguaro_dist.model.hf_config import load_config
        from saguaro_dist.model.loader import resolve_model_dir
        from saguaro_dist.model.lora_adapter import load_adapter
        if self._target_config is None:
            self._target_config = load_config(resolve_model_dir(self.config.model, weights=False,
                                                                revision=self.config.revision))
        try:
            load_adapter(request.lora_path, self._target_config, self.config.max_lora_rank)
        except OSError as err:  # a Hub id that cannot be fetched
            raise ValueError(f"lora_request {request.lora_name!r}: {err}") from None

    def _prompt_ids(self, prompts, prompt_token_ids) -> tuple[list, list[list[int]], list[str | None]]:
        """Each prompt's text (or None), token ids and cache_salt (a prompt dict's, else None)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            what = "a list of prompts, each a list of token ids"
            ids = [as_token_ids(p) for p in as_tuple(prompt_token_ids, "prompt_token_ids", what)]
            return [None] * len(ids), ids, [None] * len(ids)
        what = "a string or a list of strings (or of vLLM's {'prompt': ...} / {'prompt_token_ids': [...]} dicts)"
        prompts = [prompts] if isinstance(prompts, (str, Mapping)) else list(as_tuple(prompts, "prompts", what))
        pairs = [self._prompt(p, i) for i, p in enumerate(prompts)]
        salts = [check_cache_salt(p.get("cache_salt"), f"prompt {i}'s 'cache_salt'") if isinstance(p, Mapping) else None
                 for i, p in enumerate(prompts)]
        return [text for text, _ in pairs], [ids for _, ids in pairs], salts

    def _prompt(self, prompt, i: int) -> tuple[str | None, list[int]]:
        """One prompt's (text, token ids): a string or vLLM's TextPrompt / TokensPrompt dict (a dict failed
        as "every prompt must be a non-empty string")."""
        if isinstance(prompt, Mapping):
            return self._dict_prompt(prompt, i)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"every prompt must be a non-empty string or a prompt dict; prompt {i} is {prompt!r}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
        return prompt, encode_text(self.tokenizer, prompt, param=f"prompt {i}")

    def _dict_prompt(self, prompt: Mapping, i: int) -> tuple[str | None, list[int]]:
        """{"prompt": text} or {"prompt_token_ids": ids}, either with vLLM's "cache_salt" (read by _prompt_ids);
        keys we cannot honour (multi_modal_data, ...) are refused."""
        if not set(prompt) - {"cache_salt"} or set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}:
            raise ValueError(f"prompt {i} must be {{'prompt': text}} or {{'prompt_token_ids': [...]}} (with an "
                             f"optional 'cache_salt'), got keys {sorted(map(str, prompt))}")
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:  # (its text, if given, names it in the output, as vLLM's)
            return text if isinstance(text, str) else None, as_token_ids(prompt["prompt_token_ids"])
        if not isinstance(text, str):
            raise ValueError(f"prompt {i}'s 'prompt' must be a non-empty string, got {text!r}")
        return self._prompt(text, i)

    def _params(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(as_tuple(sampling_params, "sampling_params", "a SamplingParams or a list of them"))
        if not all(isinstance(p, SamplingParams) for p in params):  # a dict failed deep inside with an AttributeError
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {sampling_params!r}")
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params

    def _priorities(self, priority, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        if len(priority) != n or any(type(p) is not int for p in priority):
            raise ValueError(f"priority must be one int per prompt ({n}), got {priority!r}")
        if any(priority) and self.config.scheduling_policy is not SchedulingPolicy.PRIORITY:
            raise ValueError("priority needs scheduling_policy='priority' (this engine serves first come, first served)")
        return list(priority)

    def _encode_bad_word(self, word: str) -> list[int]:
        return encode_text(self.tokenizer, word, add_special_tokens=False, param="bad_words")

    def _check_prompt(self, tokens: list[int], params: SamplingParams) -> None:
        check_prompt_ids(tokens, self.vocab_size)
        check_against_model(params, self.vocab_size, self.eos_token_ids)
        self._grammars.check(params)
        # vLLM's offline LLM: a max_tokens past the context's end is capped there (finish "length", the engine's
        # check), only a prompt with no room (or none for its min_tokens) is refused
        room, need = self.max_model_len - len(tokens), max(1, params.min_tokens)
        if room < need:
            raise ValueError(f"prompt ({len(tokens)} tokens) leaves {max(room, 0)} of the model's max length "
                             f"{self.max_model_len} to generate; it needs {need} (min_tokens {params.min_tokens})")


def distinct_adapters(loras: list[LoRARequest | None]) -> list[LoRARequest]:
    """The requests to check, one per (id, path) in first-seen order: a load_inplace one where the pair has one
    (the id rebinds to the path, then the plain ones for it run there, as vLLM's)."""
    chosen: dict[tuple[int, str], LoRARequest] = {}  # (keyed by id and path: LoRARequest's == is by name)
    for r in loras:
        key = (r.lora_int_id, r.lora_path) if r is not None else None
        if key is not None and (key not in chosen or r.load_inplace and not chosen[key].load_inplace):
            chosen[key] = r
    return list(chosen.values())


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine ids of a request's n samples: the request's own for one, else "<i>_<request id>" (vLLM's)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The n = 1 settings of each of params.n samples: sample i draws from seed + i (the HTTP server's rule:
    the samples differ, each seeded as a request of its own); only sample 0 scores the prompt (prompt_logprobs
    cost a [P, V] LM head, the same for every sample). n = 1 here: nothing downstream expands them again."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=sample_seed(params.seed, i),
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None) for i in range(params.n)]


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed of a request seeded `seed`: seed + index, wrapped into the int64 range seeds are
    checked against (a seed near 2**63 - 1 stays valid for every sample); None stays None."""
    if seed is None:
        return None
    return (seed + index - SEED_MIN) % 2 ** 64 + SEED_MIN


UNSUPPORTED = {"tokenization_kwargs": "prompts are encoded as the model's tokenizer does by default, without overrides",
               "mm_processor_kwargs": "multimodal inputs are not supported"}


def refuse_unsupported(**arguments) -> None:
    """vLLM's arguments this engine cannot honour: refused by name unless empty (None, {} or []), not dropped."""
    for name, value in arguments.items():
        if value is not None and value != {} and value != []:
            raise ValueError(f"{name}: {UNSUPPORTED[name]}; leave it unset (got {value!r})")


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's: auto finds it from the template (prompts.content_as_parts)


def check_content_format(content_format: str) -> None:
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format {content_format!r} is not supported: one of "
                         f"{', '.join(map(repr, CONTENT_FORMATS))}")


def conversations(messages) -> list:
    """chat's messages as a list of conversations, each a non-empty list of message dicts: an empty one in a
    list rendered a prompt of no messages (the server refuses one, as `messages: []` is refused here)."""
    if not messages:
        raise ValueError("messages must not be empty")
    conversations = [messages] if isinstance(messages, (list, tuple)) and isinstance(messages[0], dict) else messages
    if not isinstance(conversations, (list, tuple)) or not all(  # a str failed as ChatMessage(**"hi"): a TypeError
            isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in conversations):
        raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} dicts) "
                         "or a list of conversations")
    return conversations
