"""OpenAI response bodies and stream chunks, for completions and chat completions alike."""
from __future__ import annotations

import json
import time

from saguaro_dist.engine.logprob_objects import entry_ranks
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


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """vLLM's continuous_usage_stats figures on a streamed chunk: its choice's prompt and tokens so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


MIN_LOGPROB = -9999.0  # what vLLM sends for a log-probability of -inf (not JSON)


def prompt_logprobs(tokenizer, entries: list | None, top_n: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) its engine entry, asked for with
    prompt_logprobs=top_n, as {"<id>": {"logprob", "rank", "decoded_token"}} in the entry's order (the prompt
    token first). Token ids stay ids here whatever return_tokens_as_token_ids says, as in vLLM."""
    if entries is None:
        return None
    return [None if entry is None else _prompt_entry(tokenizer, entry, top_n) for entry in entries]


def _prompt_entry(tokenizer, entry: dict[int, float], top_n: int) -> dict[str, dict]:
    ranks = _ranks(entry, top_n)
    return {str(t): {"logprob": max(lp, MIN_LOGPROB), "rank": ranks.get(t), "decoded_token": tokenizer.decode([t])}
            for t, lp in entry.items()}


def _ranks(entry: dict[int, float], top_n: int) -> dict[int, int | None]:
    """Rank 1 for the likeliest, as the offline API ranks (engine/logprob_objects.entry_ranks): the prompt or
    chosen token has the engine's rank (vLLM's count of tokens at least as likely: last among exact ties),
    the top ones 1, 2, ... in topk order around it; null from an engine that sent none (outside the top)."""
    return entry_ranks(entry, top_n)


def _ranked(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    """The top_n (id, log p) of an engine entry by rank, so an exact tie goes the topk's way (the chosen token,
    listed first, ranks last among its equals and is left out when the topk left it out)."""
    ranks = _ranks(entry, top_n)
    by_rank = sorted(entry.items(), key=lambda item: (ranks[item[0]] is None, ranks[item[0]] or 0))
    return by_rank[:top_n]


def _with_chosen(entry: dict[int, float], token_id: int, top_n: int) -> list[tuple[int, float]]:
    """The legacy completions' top_logprobs of a token: the chosen one first, then the top_n (the chosen one
    once), so up to top_n + 1 (OpenAI's "always returns the logprob of the sampled token"; vLLM's)."""
    ranked = [(t, v) for t, v in _ranked(entry, top_n) if t != token_id]
    return [(token_id, entry[token_id]), *ranked[:top_n]]


def _clamped(logprob: float | None) -> float | None:
    """vLLM's: -inf (not JSON) as MIN_LOGPROB."""
    return None if logprob is None else max(logprob, MIN_LOGPROB)


def _chat_token(text: str, logprob: float, shown: str | None = None) -> dict:
    """shown: the token's name in place of its text (return_tokens_as_token_ids); bytes stay the text's."""
    return {"token": text if shown is None else shown, "logprob": _clamped(logprob), "bytes": list(text.encode())}


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text: the legacy completions logprobs' tokens, whose lengths its text_offset adds up
    (a stream's chunks too, so that their offsets are the whole reply's)."""
    return [tokenizer.decode([t]) for t in token_ids]


def token_id_name(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids name of a token: one a client can map back when its text is not
    valid UTF-8 on its own (a byte-fallback piece)."""
    return f"token_id:{token_id}"


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
               tool_calls: list | None = None, reasoning: str | None = None, stop_reason: int | str | None = None,
               prompt_logprobs: list | None = None, role: str = REPLY_ROLE) -> dict:
        """stop_reason (vLLM's): the stop_token_id or stop string that ended the choice; None otherwise.
        prompt_logprobs (vLLM's): a completion choice's (chat's are the response's, one prompt for all).
        role: a chat message's (the request's reply_role: vLLM's --response-role or the last message's)."""
        if self.chat:
            message = {"role": role, "content": text}
            if reasoning is not None:
                message["reasoning"] = reasoning  # vLLM's name (formerly reasoning_content)
            if tool_calls:
                message["tool_calls"] = [call.message() for call in tool_calls]
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason,
                "prompt_logprobs": prompt_logprobs}

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

    def logprobs(self, tokenizer, token_ids: list[int], entries: list, top_n: int, text_offset: int = 0,
                 as_ids: bool = False) -> dict:
        """The choice's `logprobs` object for `token_ids`, whose engine entries are {chosen id: log p, top ids:
        log p} (None for an echoed prompt's first token): chat's {"content": [...]} (top_logprobs: the top_n), or
        the legacy completions' parallel lists (top_logprobs: the chosen token and the top_n; character offsets
        counted from text_offset, in the text). Values of -inf are MIN_LOGPROB (vLLM's). as_ids (vLLM's
        return_tokens_as_token_ids): tokens are named "token_id:<id>", not by their text."""
        name = token_id_name if as_ids else (lambda t: tokenizer.decode([t]))
        texts = token_texts(tokenizer, token_ids)
        chosen = [entry[t] if entry else None for t, entry in zip(token_ids, entries)]
        if self.chat:  # vLLM's bytes: the chosen token's text's, a top token's name's
            tops = [[(name(t), v) for t, v in _ranked(entry, top_n)] if entry else None for entry in entries]
            return {"content": [{**_chat_token(text, lp, name(t) if as_ids else None),
                                 "top_logprobs": [_chat_token(n, v) for n, v in top]}
                                for t, text, lp, top in zip(token_ids, texts, chosen, tops)]}
        tops = [{name(t): _clamped(v) for t, v in _with_chosen(entry, token, top_n)} if entry else None
                for token, entry in zip(token_ids, entries)]
        offsets = [text_offset + sum(map(len, texts[:i])) for i in range(len(texts))]
        return {"tokens": [name(t) for t in token_ids] if as_ids else texts,
                "token_logprobs": list(map(_clamped, chosen)), "top_logprobs": tops, "text_offset": offsets}

    def body(self, request_id: str, model: str, choices: list[dict], created: int | None = None, **extra) -> dict:
        """created: the request's arrival (arrival_time), so a reply's time is when it was asked for."""
        return {"id": request_id, "object": self.object_name, "created": arrival_time() if created is None else created,
                "model": model, "choices": choices, **extra}

    def chunk(self, request_id: str, model: str, choices: list[dict], created: int | None = None, **extra) -> dict:
        """created: the request's arrival: every chunk of one stream carries the same (OpenAI's, vLLM's)."""
        return {"id": request_id, "object": self.chunk_object, "created": arrival_time() if created is None else created,
                "model": model, "choices": choices, **extra}


def arrival_time() -> int:
    """OpenAI's `created`: Unix seconds, taken once per request."""
    return int(time.time())


COMPLETION = Format("text_completion", "text_completion", "cmpl", chat=False)
CHAT = Format("chat.completion", "chat.completion.chunk", "chatcmpl", chat=True)
