"""OpenAI response bodies and stream chunks, for completions and chat completions alike."""
from __future__ import annotations

import json
import time

from saguaro_dist.serve.protocol import REPLY_ROLE

_STAT_COUNTS = ("num_prompt_tokens", "num_generated_tokens", "rounds", "drafted_tokens", "accepted_tokens",
                "cache_hits", "cache_misses")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens the prefix cache supplied (OpenAI's prompt_tokens_details);
    reasoning_tokens: completion tokens a reasoning parser read as reasoning (completion_tokens_details), left
    out where None (a server without a reasoning parser)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def speculation(metrics_list: list, mode: str) -> dict:
    """Per-request speculation stats (summed over the request's prompts), our extra response field."""
    out = {name: sum(getattr(m, name, 0) for m in metrics_list if m) for name in _STAT_COUNTS}
    fallbacks: dict[str, int] = {}
    for m in metrics_list:
        for kind, count in ((m.fallbacks or {}) if m else {}).items():
            fallbacks[str(kind)] = fallbacks.get(str(kind), 0) + count
    lookups = out["cache_hits"] + out["cache_misses"]
    out.update(
        mode=mode,
        acceptance_rate=out["accepted_tokens"] / out["drafted_tokens"] if out["drafted_tokens"] else 0.0,
        mean_accepted_length=(out["accepted_tokens"] + out["rounds"]) / out["rounds"] if out["rounds"] else 0.0,
        cache_hit_rate=out["cache_hits"] / lookups if lookups else 0.0,
        fallbacks=fallbacks,
    )
    return out


def _ranked(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    """The top_n (id, log p) of an engine entry (the chosen token is listed first, ranked or not)."""
    return sorted(entry.items(), key=lambda item: -item[1])[:top_n]


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class Format:
    """How one endpoint shapes ids, choices and chunks; `CHAT` and `COMPLETION` below."""

    def __init__(self, object_name: str, chunk_object: str, id_prefix: str, chat: bool):
        self.object_name, self.chunk_object, self.id_prefix, self.chat = object_name, chunk_object, id_prefix, chat

    def id_of(self, request_id: str) -> str:
        """The response's id for a request id (vLLM's "cmpl-<id>" / "chatcmpl-<id>")."""
        return f"{self.id_prefix}-{request_id}"

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
               tool_calls: list | None = None, reasoning: str | None = None, stop_reason: int | str | None = None) -> dict:
        """stop_reason (vLLM's): the stop_token_id or stop string that ended the choice; None otherwise."""
        if self.chat:
            message = {"role": REPLY_ROLE, "content": text}
            if reasoning is not None:
                message["reasoning"] = reasoning  # vLLM's name (formerly reasoning_content)
            if tool_calls:
                message["tool_calls"] = [call.message() for call in tool_calls]
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}

    def delta_choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
                     stop_reason: int | str | None = None) -> dict:
        """A completions stream choice."""
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def chat_delta(self, index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None,
                   stop_reason: int | str | None = None) -> dict:
        """A chat stream choice; `delta` holds content and / or tool_calls (tools.ToolStream)."""
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def logprobs(self, tokenizer, token_ids: list[int], entries: list, top_n: int, text_offset: int = 0) -> dict:
        """The choice's `logprobs` object for `token_ids`, whose engine entries are {chosen id: log p, top ids:
        log p} (None for an echoed prompt's first token): chat's {"content": [...]}, or the legacy
        completions' parallel lists (character offsets counted from text_offset)."""
        texts = [tokenizer.decode([t]) for t in token_ids]
        chosen = [entry[t] if entry else None for t, entry in zip(token_ids, entries)]
        tops = [[(tokenizer.decode([t]), v) for t, v in _ranked(entry, top_n)] if entry else None for entry in entries]
        if self.chat:
            return {"content": [{**_chat_token(text, lp), "top_logprobs": [_chat_token(t, v) for t, v in top]}
                                for text, lp, top in zip(texts, chosen, tops)]}
        offsets = [text_offset + sum(map(len, texts[:i])) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": chosen, "top_logprobs": [None if top is None else dict(top) for top in tops],
                "text_offset": offsets}

    def body(self, request_id: str, model: str, choices: list[dict], **extra) -> dict:
        return {"id": request_id, "object": self.object_name, "created": int(time.time()), "model": model,
                "choices": choices, **extra}

    def chunk(self, request_id: str, model: str, choices: list[dict], **extra) -> dict:
        return {"id": request_id, "object": self.chunk_object, "created": int(time.time()), "model": model,
                "choices": choices, **extra}


COMPLETION = Format("text_completion", "text_completion", "cmpl", chat=False)
CHAT = Format("chat.completion", "chat.completion.chunk", "chatcmpl", chat=True)
