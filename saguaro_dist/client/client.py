"""Blocking client for saguaro servers and any OpenAI-compatible server."""
from __future__ import annotations

import contextlib
import time

import httpx

from saguaro_dist.client import _common as common
from saguaro_dist.client import _policy as policy
from saguaro_dist.client._choices import expected_choices
from saguaro_dist.client._common import DONE, Completion, RetryPolicy
from saguaro_dist.client._options import DEFAULT, RequestOptions, split_options
from saguaro_dist.client._policy import RequestKind
from saguaro_dist.client._sse import sse_lines
from saguaro_dist.client._stream_state import STREAM_FACTS, StreamCore, StreamState, start_reading
from saguaro_dist.client.errors import status_error


class Stream:
    """Iterates choice 0's text deltas (`chunks()`: every parsed chunk); afterwards `finish_reason`, `usage`,
    `speculation`, `tool_calls` and `reasoning` hold what the stream said, and `texts` every choice's text by index.
    Loops, next() and chunks() share one reader; a loop left early closes the stream (a saguaro server stops
    generating), as does close(), and so does dropping the stream unclosed."""

    def __init__(self, response: httpx.Response, expected_choices: int | None = None):
        """expected_choices: how many choices the request asked for (_choices.expected_choices), which a stream
        that ends without [DONE] must all have finished; None: those it sent."""
        # what the reader holds: never this Stream (no cycle, see __del__)
        self._core = StreamCore(response, expected_choices)
        self._reader = None  # the one generator of parsed chunks, made at the first read
        self._owner = None   # the loop (chunks() view) that read last: the one whose early exit closes the stream

    @property
    def response(self) -> httpx.Response:
        return self._core.response

    def __iter__(self):
        chunks = self.chunks()
        with contextlib.closing(chunks):  # a loop left early closes it, and the stream with it
            for chunk in chunks:
                text = common.first_choice_text(chunk)
                if text:
                    yield text

    def __next__(self) -> str:
        """The next text delta, as openai's Stream: the stream stays open for a loop to go on from there."""
        self._owner = None
        for chunk in self._shared_reader():
            text = common.first_choice_text(chunk)
            if text:
                return text
        raise StopIteration

    def chunks(self):
        """Every parsed chunk dict up to [DONE]: those without text too (role-only, tool-call, usage-only). It
        fills the same facts as the text loop, and shares its reader and its read-once and close rules."""
        token = self._owner = object()
        try:
            for chunk in self._shared_reader():
                yield chunk
                self._owner = token  # (resumed: this loop reads on)
        finally:
            if self._owner is token:  # ended, or left early; not a loop dropped after another one went on reading
                self.close()

    def _shared_reader(self):
        if not start_reading(self._core.state):
            return iter(())  # read to its end already: nothing more, as openai's Stream
        if self._reader is None:
            self._core.state, self._reader = StreamState.READING, _read(self._core)
        return self._reader

    def __getattr__(self, name):
        if name in STREAM_FACTS:  # finish_reason, usage, speculation, model, id, ...
            return getattr(self._core.acc, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def close(self) -> None:
        self._core.mark_closed()
        self._core.response.close()  # closing early tells a saguaro server to stop generating
        if self._reader is not None and not self._reader.gi_running:
            self._reader.close()  # a loop under way (close() inside it) ends quietly at its next step

    def __del__(self):
        """Dropped unclosed (never read, or after next()): httpx would hold the connection, and the server go on
        generating, for as long as the process lives."""
        with contextlib.suppress(Exception):  # (a finalizer never raises; __init__ may not have run)
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read(core: StreamCore):
    """A stream's reader: its end or its error ends the stream (another loop yields nothing)."""
    try:
        yield from _parsed(core)
    except Exception:
        core.mark_ended()
        raise
    except BaseException:  # a read cancelled or interrupted (CancelledError, Ctrl-C): the rest of the reply is gone
        core.mark_closed()  # (a later read raises StreamClosedError, not a quiet, short end)
        raise
    finally:
        core.response.close()
    core.mark_ended()


def _parsed(core: StreamCore):
    try:
        for line in sse_lines(core.response.iter_bytes()):
            chunk = core.acc.feed(line)
            if chunk is DONE:
                return
            if chunk is not None:
                yield chunk
        core.acc.end()
    except httpx.TransportError as err:
        if core.state is StreamState.CLOSED:  # close() while a read was under way: the end it asked for
            return
        raise common.stream_transport_error(err, core.response) from err
    except httpx.DecodingError as err:
        raise policy.decoding_error(core.response.status_code, err) from err


class Client:
    """`Client("http://127.0.0.1:8000", api_key=...)`; `complete()`, `chat()`, `stream=True` for deltas.

    base_url: a bare "http://host:8000" (or ".../") gets /v1; one with a path is the API root as given, as openai's
    base_url ("http://host:8000/v1", "https://gateway/api/v2"). /health, /tokenize and /version live at that
    root less a trailing /v1. api_key None (the default) reads $SAGUARO_API_KEY, the variable `saguaro serve` reads
    its key from (never $OPENAI_API_KEY: an OpenAI secret is not sent to another server unasked); "" sends no key.
    timeout: seconds a read, a write or a wait for a pooled connection may take (default 600, openai's), and at most
    5 s to connect (openai's); None: no limit; an httpx.Timeout as given. A request's own timeout= (openai's
    per-request option) is read the same way.

    Retries (max_retries, backoff with jitter; Retry-After, in seconds or a date, and retry-after-ms honoured up to
    8 s) only where the server demonstrably did not process the request or says to try again: a connection never
    made, 408, 429, 503; also 502 for a generation;
    and for read-only calls (GET, tokenize, reset_prefix_cache) any transport failure, 500 and 504. A generation's
    read timeout or dropped connection is never retried (the server has it), nor a LoRA load/unload's
    5xx other than 503.
    Redirects: a POST's 307/308 and a GET's redirects are followed (never https -> http); any other 3xx is an
    APIStatusError naming its Location. api_key is stripped of surrounding whitespace."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, *,
                 model: str | None = None, timeout: float | httpx.Timeout | None = common.DEFAULT_TIMEOUT_S,
                 max_retries: int = 2, backoff_s: float = 0.5):
        timeouts = common.client_timeout(timeout)  # before a connection pool exists: a refused client leaks nothing
        self.model = model
        self._root = common.api_root(base_url)
        self._retry = RetryPolicy(max_retries=max_retries, backoff_s=backoff_s)
        self._http = httpx.Client(timeout=timeouts, headers=common.auth_headers(common.api_key_or_env(api_key)), limits=common.LIMITS)

    def complete(self, prompt, *, model=None, max_tokens=None, temperature=None, top_p=None, top_k=None,
                 stop=None, seed=None, stream: bool = False, **extra) -> Completion | Stream:
        """A text completion (`/v1/completions`); extra keyword arguments go into the request body, but openai's
        per-request options: extra_body (merged into the body), extra_headers, extra_query, timeout."""
        extra, options = split_options(extra)
        body = {"prompt": prompt, **common.sampling_fields(model or self.model, max_tokens, temperature, top_p,
                                                          top_k, stop, seed, extra)}
        return self._generate("/completions", body, stream, options)

    def chat(self, messages, *, model=None, max_tokens=None, temperature=None, top_p=None, top_k=None,
             stop=None, seed=None, stream: bool = False, **extra) -> Completion | Stream:
        """A chat completion; `messages` is OpenAI's list of {"role", "content"} or one user string."""
        extra, options = split_options(extra)
        body = {"messages": common.chat_messages(messages),
                **common.sampling_fields(model or self.model, max_tokens, temperature, top_p, top_k, stop, seed,
                                         extra)}
        return self._generate("/chat/completions", body, stream, options)

    def models(self) -> list[str]:
        response = self._send("GET", self._root + "/models", kind=RequestKind.READ_ONLY)
        return [m["id"] for m in common.json_field(response, "data")]

    def tokenize(self, prompt: str, *, model=None, add_special_tokens: bool = True) -> list[int]:
        """The server's token ids for `prompt` (vLLM's /tokenize): what a text prompt is generated from."""
        body = common.tokenize_body(prompt, model or self.model, add_special_tokens)
        response = self._send("POST", common.server_root(self._root) + "/tokenize", body, kind=RequestKind.READ_ONLY)
        return common.json_field(response, "tokens")

    def health(self) -> bool:
        try:
            return self._http.get(common.server_root(self._root) + "/health").status_code == 200
        except httpx.TransportError:
            return False

    def version(self) -> str:
        response = self._send("GET", common.server_root(self._root) + "/version", kind=RequestKind.READ_ONLY)
        return common.json_field(response, "version")

    def reset_prefix_cache(self) -> None:
        """Forget the server's kept prompt prefixes (a cold cache, e.g. before a benchmark)."""
        self._send("POST", common.server_root(self._root) + "/reset_prefix_cache", kind=RequestKind.READ_ONLY)

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, load_inplace: bool = False) -> str:
        """vLLM's runtime load (POST /v1/load_lora_adapter; the server needs VLLM_ALLOW_RUNTIME_LORA_UPDATING):
        requests whose `model` is lora_name then run the adapter. load_inplace reloads a name already loaded.
        Returns the server's "Success: ..." line."""
        body = common.load_lora_body(lora_name, lora_path, load_inplace)
        return self._send("POST", self._root + "/load_lora_adapter", body, kind=RequestKind.STATEFUL).text

    def unload_lora_adapter(self, lora_name: str) -> str:
        """vLLM's runtime unload (POST /v1/unload_lora_adapter): the name's running requests finish, new ones get a 404.
        Returns the server's "Success: ..." line."""
        body = {"lora_name": common.lora_field("lora_name", lora_name)}
        return self._send("POST", self._root + "/unload_lora_adapter", body, kind=RequestKind.STATEFUL).text

    def _generate(self, path: str, body: dict, stream: bool, options: RequestOptions) -> Completion | Stream:
        kind, url = RequestKind.GENERATION, self._root + path
        if stream:
            response = self._send("POST", url, common.streamed(body), kind=kind, stream=True, options=options)
            return Stream(response, expected_choices(body))
        return Completion.from_body(common.json_object(self._send("POST", url, body, kind=kind, options=options)))

    def _send(self, method: str, url: str, body: dict | None = None, *, kind: RequestKind,
              stream: bool = False, options: RequestOptions = DEFAULT) -> httpx.Response:
        for attempt in range(self._retry.max_retries + 1):
            response, error, headers = self._attempt(method, url, body, stream, options)
            if response is not None:
                return response
            if attempt == self._retry.max_retries or not policy.should_retry(kind, error, headers):
                raise error
            time.sleep(self._retry.delay(attempt, headers))
        raise AssertionError("unreachable")

    def _attempt(self, method, url, body, stream, options):
        """(response, None, None) on success, else (None, error, the reply's headers: Retry-After). The reply is
        always streamed and a whole one read here, so an error body that breaks off is the same typed (retried)
        error whether the caller asked for a stream or not."""
        try:
            response = self._follow(self._http.build_request(method, url, json=body, **options.request_args()))
        except httpx.TransportError as err:
            return None, policy.transport_error(method, url, err), None
        if not response.is_success:
            return None, self._failure(response), response.headers
        error = None if stream else self._read(response, method, url)
        return (None, error, None) if error else (response, None, None)

    def _follow(self, request: httpx.Request) -> httpx.Response:
        """The response, after the redirects that are safe to follow (policy.redirect_to_follow)."""
        response = self._http.send(request, stream=True, follow_redirects=False)
        for _ in range(policy.MAX_REDIRECTS):
            target = policy.redirect_to_follow(response)
            if target is None:
                break
            response.close()
            response = self._http.send(target, stream=True, follow_redirects=False)
        return response

    @staticmethod
    def _read(response: httpx.Response, method: str, url: str) -> Exception | None:
        """Reads a success reply's body; the error where it breaks off or does not decode."""
        try:
            response.read()
        except httpx.TransportError as err:
            return policy.transport_error(method, url, err)
        except httpx.DecodingError as err:
            return policy.decoding_error(response.status_code, err)
        finally:
            response.close()
        return None

    def _failure(self, response: httpx.Response) -> Exception:
        """The typed error of a reply that is no success; a body that breaks off keeps the status it came with."""
        if 300 <= response.status_code < 400:
            response.close()
            return policy.redirect_error(response)
        try:
            body = common.response_body(response.read())
        except (httpx.TransportError, httpx.DecodingError) as err:
            body = f"HTTP {response.status_code}; its body broke off or did not decode ({type(err).__name__}): {err}"
        finally:
            response.close()
        return status_error(response.status_code, body)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

