"""What the sync and async clients share: URLs, payloads, retry policy, SSE parsing, results."""
from __future__ import annotations

import email.utils
import json
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx

from saguaro_dist.client._choices import missing_choices
from saguaro_dist.client.errors import (APIConnectionError, APIResponseValidationError, APIStatusError,
                                        APITimeoutError, status_error)
from saguaro_dist.error_types import status_of_type

# The openai client's pool: httpx's default of 100 connections queued the 101st concurrent request in the client
# (an async caller's, a serving bench's), its wait counted as the server's latency.
LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
DONE = object()  # the `data: [DONE]` sentinel
BODY_START_CHARS = 200  # of a reply that is not the API's, what its error quotes
FOREIGN_CHARS = 65536  # of a "stream" that is no event stream, what is kept: a whole JSON error body, say
SSE_FIELDS = frozenset({"", "data", "event", "id", "retry"})  # "": a comment line (":...")


def body_start(content: bytes | str) -> str:
    text = content.decode(errors="replace") if isinstance(content, bytes) else content
    return repr(text[:BODY_START_CHARS]) + ("..." if len(text) > BODY_START_CHARS else "")


def invalid_reply(status_code: int, what: str, content: bytes | str) -> APIResponseValidationError:
    return APIResponseValidationError(status_code, f"{what}; it begins {body_start(content)}",
                                      body=content.decode(errors="replace") if isinstance(content, bytes) else content)


def json_object(response: httpx.Response) -> dict:
    """A success reply's JSON object. A proxy's HTML page (or any other body) is a typed error naming the status
    and the body's start: response.json() raised a bare JSONDecodeError."""
    try:
        body = json.loads(response.content)
    except ValueError:  # (JSONDecodeError and UnicodeDecodeError both are)
        body = None
    if not isinstance(body, dict):
        raise invalid_reply(response.status_code, "the reply is not a JSON object", response.content)
    if is_error_body(body):  # a 200 carrying an error: it was taken for an empty completion
        raise stream_error(body)
    return body


def is_error_body(body) -> bool:
    """OpenAI's {"error": {...}} envelope or vLLM's flat {"object": "error", "message": ...}."""
    return isinstance(body, dict) and (bool(body.get("error")) or body.get("object") == "error")


def json_field(response: httpx.Response, key: str):
    body = json_object(response)
    if key not in body:
        raise invalid_reply(response.status_code, f"the reply has no {key!r}", response.content)
    return body[key]


def api_root(base_url: str | httpx.URL) -> str:
    """A bare "http://host:8000" gets /v1; a URL with a path is the API root as given, as openai's base_url
    ("https://host/v1beta/openai/", a gateway's "http://h/api/v2": appending /v1 sent every request astray)."""
    if not isinstance(base_url, (str, httpx.URL)):
        raise TypeError(f"base_url must be a str (or an httpx.URL), got {type(base_url).__name__}")
    root = str(base_url).rstrip("/")
    url = _checked_url(root, base_url)
    return root + "/v1" if not url.path.strip("/") else root


def _checked_url(root: str, base_url) -> httpx.URL:
    """root as a URL; a ValueError naming base_url where it is no http(s) URL with a host ("localhost:8000" read as
    scheme "localhost") or carries a query or fragment (the API's paths would land after it)."""
    try:
        url = httpx.URL(root)
    except (TypeError, httpx.InvalidURL) as err:
        raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}: {err}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"base_url must be an http:// or https:// URL with a host (as http://127.0.0.1:8000), "
                         f"got {base_url!r}")
    if url.query or url.fragment:
        raise ValueError(f"base_url takes no query or fragment (the API's paths would follow it), got {base_url!r}; "
                         f"a request's extra_query= adds query parameters")
    return url


def served_api_root(server_url: str) -> str:
    """The API root of a saguaro / vLLM server named by its URL (the CLIs' --url: its root, a --root-path
    included, or that root's /v1), for a Client's base_url, which is taken as given when it has a path."""
    root = server_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def server_root(base_url: str) -> str:
    """Where /health, /tokenize, /version live: the API root less a trailing /v1 (vLLM's layout)."""
    return api_root(base_url).removesuffix("/v1")


def api_key_or_env(api_key: str | None) -> str | None:
    """None: $SAGUARO_API_KEY, the variable `saguaro serve` reads its key from (openai reads $OPENAI_API_KEY; an
    OpenAI secret is not sent to a saguaro server unasked). "" is no key, whatever the environment holds."""
    return os.environ.get("SAGUARO_API_KEY") if api_key is None else api_key


def auth_headers(api_key: str | None) -> dict:
    """The key without surrounding whitespace (a key read from a file or a Kubernetes secret ends in a newline,
    which h11 refused with the key quoted in the error). One still holding a character a header cannot carry is a
    ValueError that never shows the key."""
    key = (api_key or "").strip()
    bad = next((i for i, c in enumerate(key) if not (" " <= c <= "~" or c == "\t")), None)
    if bad is not None:
        raise ValueError(f"api_key holds a control or non-ASCII character (at position {bad} of {len(key)}), "
                         "which an HTTP header cannot carry; the key is not shown")
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter; Retry-After wins. Which failures are retried: _policy.should_retry."""

    max_retries: int = 2
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self):
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        if not self.backoff_s >= 0 or not self.max_backoff_s >= 0:  # (NaN fails >= 0 too)
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {self.backoff_s!r}, {self.max_backoff_s!r}")

    def delay(self, attempt: int, retry_after: str | Mapping | None = None) -> float:
        """retry_after: a reply's headers (retry-after-ms, Retry-After) or a Retry-After value."""
        headers = {"retry-after": retry_after} if isinstance(retry_after, str) else retry_after or {}
        seconds = retry_after_s(headers)
        if seconds is not None:
            return min(seconds, self.max_backoff_s)
        base = min(self.backoff_s * (2 ** attempt), self.max_backoff_s)
        return base * random.uniform(0.5, 1.0)  # jitter: retrying clients do not stampede together


def retry_after_s(headers: Mapping) -> float | None:
    """The wait a reply asks for, as openai reads it: retry-after-ms (not standard, finer), else Retry-After in
    seconds or as an HTTP date (a date passed: now). None where there is none, or a negative or NaN (time.sleep
    refuses those)."""
    seconds = _number(headers.get("retry-after-ms"))
    if seconds is not None:
        return seconds / 1000
    value = headers.get("retry-after")
    seconds = _number(value)
    if seconds is None and value:
        seconds = _seconds_until(value)
    return seconds


def _number(value: str | None) -> float | None:
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


def _seconds_until(http_date: str) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(http_date)
    except (TypeError, ValueError, OverflowError):
        return None
    if when.tzinfo is None:  # (RFC 9110 dates are GMT; "-0000" parses naive)
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


DEFAULT_TIMEOUT_S = 600.0  # openai's: a long generation, not streamed, on a busy server takes minutes
CONNECT_TIMEOUT_S = 5.0    # openai's


def client_timeout(timeout) -> httpx.Timeout | None:
    """A client's timeouts from its `timeout`: seconds for a read, a write or a wait for the pool, and at most 5 s to
    connect (openai's), so a host that is gone (a dead node, a stale Service address) fails in seconds, not after
    the read timeout for each try of the connect. None: no limit; an httpx.Timeout as given."""
    check_timeout(timeout)
    if isinstance(timeout, (int, float)):
        return httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))
    return timeout


def check_timeout(timeout) -> None:
    """Seconds must be > 0 (httpx takes 0 or less and fails only mid-request); None or an httpx.Timeout pass."""
    if isinstance(timeout, (int, float)) and not timeout > 0:  # (NaN fails > 0 too)
        raise ValueError(f"timeout must be seconds > 0 (or None: no limit), got {timeout!r}")


def sampling_fields(model: str | None, max_tokens, temperature, top_p, top_k, stop, seed, extra: dict) -> dict:
    """Only what the caller set, so a server's own defaults apply to the rest."""
    fields = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
              "top_k": top_k, "stop": stop, "seed": seed}
    return {**{k: v for k, v in fields.items() if v is not None}, **extra}


def tokenize_body(prompt: str, model: str | None, add_special_tokens: bool) -> dict:
    return {"prompt": prompt, "add_special_tokens": add_special_tokens, **({"model": model} if model else {})}


def load_lora_body(lora_name: str, lora_path: str, load_inplace: bool) -> dict:
    """vLLM's LoadLoRAAdapterRequest; load_inplace only when set (a server without the field never sees it)."""
    body = {"lora_name": lora_field("lora_name", lora_name), "lora_path": lora_field("lora_path", lora_path)}
    return {**body, "load_inplace": True} if load_inplace else body


def lora_field(name: str, value) -> str:
    """A non-empty string, refused here with the argument's name (the server's 400 would name neither)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def chat_messages(messages) -> list[dict]:
    """A plain string is one user message; otherwise OpenAI message dicts."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    items = None if isinstance(messages, Mapping) else list(messages)  # (one dict would iterate its keys)
    if items is None or not all(isinstance(m, Mapping) for m in items):
        raise TypeError("messages must be a string or a list of message dicts ({\"role\", \"content\"}), got "
                        f"{messages!r:.200}")
    return [dict(m) for m in items]


def response_body(content: bytes):
    try:
        return json.loads(content)
    except ValueError:
        return content.decode(errors="replace")


@dataclass
class Completion:
    """A finished completion or chat completion."""

    text: str
    finish_reason: str | None
    model: str | None = None
    id: str | None = None
    usage: dict | None = None
    speculation: dict | None = None  # saguaro servers' speculation stats; None elsewhere
    raw: dict = field(default_factory=dict, repr=False)
    logprobs: dict | None = None     # the choice's OpenAI logprobs object, when the request asked (logprobs=...)
    tool_calls: list[dict] = field(default_factory=list)  # chat: OpenAI tool calls (id, type, function)
    reasoning: str | None = None     # chat, from a server with a reasoning parser: the <think> text
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it

    @classmethod
    def from_body(cls, body: dict) -> "Completion":
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        text = message.get("content") if "message" in choice else choice.get("text")
        return cls(text or "", choice.get("finish_reason"), body.get("model"), body.get("id"),
                   body.get("usage"), body.get("speculation"), body, choice.get("logprobs"),
                   message.get("tool_calls") or [], message.get("reasoning") or message.get("reasoning_content"),
                   choice.get("stop_reason"))


class StreamAccumulator:
    """Parses SSE lines into chunks and remembers the final chunk's facts. The deltas (first_choice_text) and facts are
    choice 0's, as a Completion's are: with n > 1 or several prompts the chunks interleave choices, whose
    texts (and tool calls) must not run together. Every choice's text is kept in `texts`."""

    def __init__(self, status_code: int = 200, expected_choices: int | None = None):
        self.texts: dict[int, str] = {}  # every choice's text so far, by index
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.speculation: dict | None = None
        self.model: str | None = None
        self.id: str | None = None
        self.tool_calls: list[dict] = []  # chat: tool calls assembled from their deltas
        self.reasoning: str | None = None  # chat: reasoning deltas joined (the text iterated is the content)
        self.stop_reason: int | str | None = None  # vLLM's, from the finishing chunk
        self._status = status_code
        self._data: list[str] = []  # the data lines of the event being read
        self._event: str | None = None  # its `event:` name
        self._events = 0  # events read, [DONE] included
        self._foreign = ""  # lines that are no SSE field (an HTML page, a JSON reply), their first FOREIGN_CHARS
        self._unfinished: set[int] = set()  # choices that sent text but no finish_reason yet
        self._expected = expected_choices  # how many the request asks for (_choices.expected_choices); None: unsaid

    def feed(self, line: str):
        """One line of the stream: at the blank line that ends an event, its parsed chunk (its facts taken) or DONE;
        else None. An event's data lines join with newlines (SSE), so one JSON chunk may span several."""
        if line:
            self._field(line)
            return None
        data, event = "\n".join(self._data).strip(), self._event
        self._data, self._event = [], None
        if event == "error":  # whatever its data holds: {"error": ...}, vLLM's flat body, plain text, nothing
            raise stream_error(_parsed(data))
        return self._dispatch(data) if data else None

    def end(self) -> None:
        """The body ended without [DONE]. One that held no event but other lines was never an event stream (a JSON
        error body raises its typed error). Some servers leave [DONE] out (as openai, that passes), but an end
        before any event, or before every choice asked for finished, cut the stream short: its text would pass for
        whole, or a choice never begun (n > 1, several prompts) would be missing unnoticed."""
        if not self._events and self._foreign:
            body = _parsed(self._foreign)
            if is_error_body(body):
                raise stream_error(body)
            raise invalid_reply(self._status, "the reply is not an event stream", self._foreign)
        missing = "no event" if not self._events else missing_choices(self._expected, self.texts, self._unfinished)
        if missing:
            raise APIConnectionError(f"the stream ended before [DONE] with {missing}: the server or a proxy cut it "
                                     "short (the text so far is partial)")

    def _field(self, line: str) -> None:
        name, _, value = line.partition(":")  # a comment (":...") has no name; id and retry are not ours
        if name == "data":
            self._data.append(value.removeprefix(" "))
        elif name == "event":
            self._event = value.removeprefix(" ")
        elif name not in SSE_FIELDS and len(self._foreign) < FOREIGN_CHARS:
            self._foreign += line[:FOREIGN_CHARS] + "\n"

    def _dispatch(self, data: str):
        self._events += 1
        if data == "[DONE]":
            return DONE
        chunk = _parsed(data)
        if not isinstance(chunk, dict):
            raise invalid_reply(self._status, "an event's data is not a JSON object", data)
        if is_error_body(chunk):  # (a truthy error only: a chunk may carry "error": null)
            raise stream_error(chunk)
        self._take(chunk)
        return chunk

    def _take(self, chunk: dict) -> None:
        self.model, self.id = chunk.get("model", self.model), chunk.get("id", self.id)
        self.usage = chunk.get("usage") or self.usage
        self.speculation = chunk.get("speculation") or self.speculation
        for choice in chunk.get("choices") or []:
            delta, index = choice.get("delta") or {}, choice.get("index", 0)
            self.texts[index] = self.texts.get(index, "") + choice_text(choice)
            self._track_finish(index, choice.get("finish_reason"))
            if index != 0:
                continue
            for call in delta.get("tool_calls") or []:
                self._add_call_delta(call)
            thought = delta.get("reasoning") or delta.get("reasoning_content")
            if thought:
                self.reasoning = (self.reasoning or "") + thought
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            self.stop_reason = choice.get("stop_reason", self.stop_reason) if choice.get("finish_reason") else self.stop_reason

    def _track_finish(self, index: int, finish_reason) -> None:
        if finish_reason:
            self._unfinished.discard(index)
        else:
            self._unfinished.add(index)

    def _add_call_delta(self, delta: dict) -> None:
        """OpenAI streams a call as deltas by index: the first names it, later ones append arguments."""
        index = delta.get("index", len(self.tool_calls))
        while len(self.tool_calls) <= index:
            self.tool_calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call, function = self.tool_calls[index], delta.get("function") or {}
        call["id"] = delta.get("id") or call["id"]
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def choice_text(choice: dict) -> str:
    """A chunk's choice's new text: a chat delta's content, or a completion's text."""
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def first_choice_text(chunk: dict) -> str:
    """What a stream's text loop yields for a chunk: choice 0's new text (n > 1 interleaves the choices)."""
    return "".join(choice_text(c) for c in chunk.get("choices") or [] if c.get("index", 0) == 0)


def stream_transport_error(err: httpx.TransportError, response: httpx.Response) -> APIConnectionError:
    """A stream's read that failed: a server quiet for the timeout is a timeout, as before the stream began. The
    message names the error's type and the read timeout in force (an async read timeout has no text of its own)."""
    what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    if isinstance(err, httpx.TimeoutException):
        read_s = response.request.extensions.get("timeout", {}).get("read")
        return APITimeoutError(f"the stream timed out ({what}; no byte for the read timeout, {read_s} s)")
    return APIConnectionError(f"the stream broke ({what})")


def _parsed(data: str):
    """An event's data as JSON; its text where it is none (an error event's plain message); None if empty."""
    try:
        return json.loads(data) if data else None
    except ValueError:
        return data


def stream_error(body) -> APIStatusError:
    """The typed error of an error event or chunk, with whatever message it carries."""
    if not body:
        body = {"error": {"message": "the stream sent an error event without a message"}}
    err = body.get("error", body) if isinstance(body, dict) else body
    return status_error(_stream_error_status(err if isinstance(err, dict) else {}), body)


def _stream_error_status(err: dict) -> int:
    """Headers were already sent with 200: the status travels in the error's code, when numeric, else in its type
    (a not_found_error whose code is "model_not_found" is a 404); 500 for neither."""
    if isinstance(err.get("code"), int):
        return err["code"]
    return status_of_type(err.get("type")) or 500


__all__ = ["APIStatusError", "Completion", "RetryPolicy", "StreamAccumulator"]


def streamed(body: dict) -> dict:
    """A generation body sent as a stream. Its usage is asked for unless the caller set stream_options: servers send
    it only when asked (OpenAI's, vLLM's), and a Stream's `usage` is read from it."""
    return {**body, "stream": True, "stream_options": body.get("stream_options") or {"include_usage": True}}
