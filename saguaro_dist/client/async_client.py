"""Asyncio client, the same API as `Client` with awaitables and async iterators."""
from __future__ import annotations

import asyncio
import contextlib

import httpx

from saguaro_dist.client import _common as common
from saguaro_dist.client import _policy as policy
from saguaro_dist.client._choices import expected_choices
from saguaro_dist.client._common import DONE, Completion, RetryPolicy
from saguaro_dist.client._options import DEFAULT, RequestOptions, split_options
from saguaro_dist.client._policy import RequestKind
from saguaro_dist.client._sse import async_sse_lines
from saguaro_dist.client._stream_state import STREAM_FACTS, StreamCore, StreamState, start_reading
from saguaro_dist.client.errors import status_error


class AsyncStream:
    """`async for` over choice 0's text deltas (`chunks()`: every parsed chunk); afterwards `finish_reason`, `usage`,
    `speculation`, `tool_calls`, `reasoning`, and `texts` (every choice's text by index). Loops, anext() and
    chunks() share one reader; a loop left early closes the stream, as Stream's does, and so does dropping it."""

    def __init__(self, response: httpx.Response, expected_choices: int | None = None):
        """expected_choices: as Stream's."""
        # what the reader holds: never this stream (no cycle, see __del__)
        self._core = StreamCore(response, expected_choices)
        self._reader = None  # the one async generator of parsed chunks, made at the first read
        self._owner = None   # the loop that read last: the one whose early exit closes the stream (as Stream's)
        self._loop = _running_loop()  # where a dropped stream's close is sent

    @property
    def response(self) -> httpx.Response:
        return self._core.response

    def __aiter__(self):
        return self._texts()

    async def _texts(self):
        chunks = self.chunks()
        try:
            async for chunk in chunks:
                text = common.first_choice_text(chunk)
                if text:
                    yield text
        finally:
            await chunks.aclose()  # a loop left early closes it, and the stream with it

    async def __anext__(self) -> str:
        """The next text delta, as openai's AsyncStream: the stream stays open for a loop to go on from there."""
        self._owner = None
        async for chunk in self._shared_reader():
            text = common.first_choice_text(chunk)
            if text:
                return text
        raise StopAsyncIteration

    async def chunks(self):
        """Every parsed chunk dict up to [DONE], as Stream.chunks()."""
        token = self._owner = object()
        try:
            async for chunk in self._shared_reader():
                yield chunk
                self._owner = token
        finally:
            if self._owner is token:  # a loop dropped is closed later (asyncio's hook): by then another may read on
                await self.aclose()

    def _shared_reader(self):
        if not start_reading(self._core.state):
            return _nothing()  # read to its end already: nothing more, as openai's AsyncStream
        if self._reader is None:
            self._core.state, self._reader = StreamState.READING, _read(self._core)
        return self._reader

    def __getattr__(self, name):
        if name in STREAM_FACTS:
            return getattr(self._core.acc, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    async def aclose(self) -> None:
        self._core.mark_closed()
        await self._core.response.aclose()  # closing early tells a saguaro server to stop generating
        if self._reader is not None and not self._reader.ag_running:
            await self._reader.aclose()  # a loop under way (aclose() inside it) ends quietly at its next step

    async def close(self) -> None:
        """openai's AsyncStream.close(): aclose()."""
        await self.aclose()

    def __del__(self):
        """Dropped unclosed (never read, or after anext()): httpx would hold the connection, and the server go on
        generating, as long as the loop lives. A finalizer cannot await: the close goes to the stream's loop, as
        asyncio's own hook closes a dropped async generator (the reader's close, sent too, then finds it closed)."""
        with contextlib.suppress(Exception):  # (a finalizer never raises; __init__ may not have run)
            if self._core.response.is_closed or self._loop is None or self._loop.is_closed():
                return
            closing = self._core.response.aclose()
            try:
                self._loop.call_soon_threadsafe(self._loop.create_task, closing)
            except RuntimeError:  # the loop closed meanwhile: nothing left to close it on
                closing.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # (made outside a coroutine)
        return None


async def _read(core: StreamCore):
    """A stream's reader: its end or its error ends the stream (another loop yields nothing)."""
    try:
        async for chunk in _parsed(core):
            yield chunk
    except Exception:
        core.mark_ended()
        raise
    except BaseException:  # a read cancelled or interrupted (CancelledError, Ctrl-C): the rest of the reply is gone
        core.mark_closed()  # (a later read raises StreamClosedError, not a quiet, short end)
        raise
    finally:
        await core.response.aclose()
    core.mark_ended()


async def _parsed(core: StreamCore):
    try:
        async for line in async_sse_lines(core.response.aiter_bytes()):
            chunk = core.acc.feed(line)
            if chunk is DONE:
                return
            if chunk is not None:
                yield chunk
        core.acc.end()
    except httpx.TransportError as err:
        if core.state is StreamState.CLOSED:  # aclose() while a read was under way: the end it asked for
            return
        raise common.stream_transport_error(err, core.response) from err
    except httpx.DecodingError as err:
        raise policy.decoding_error(core.response.status_code, err) from err


async def _nothing():
    return
    yield  # (an async generator of nothing)


class AsyncClient:
    """The same API as `Client` (its docstring tells which failures are retried and which redirects followed),
    with awaitables and async iterators."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, *,
                 model: str | None = None, timeout: float | httpx.Timeout | None = common.DEFAULT_TIMEOUT_S,
                 max_retries: int = 2, backoff_s: float = 0.5):
        timeouts = common.client_timeout(timeout)  # before a connection pool exists: a refused client leaks nothing
        self.model = model
        self._root = common.api_root(base_url)
        self._retry = RetryPolicy(max_retries=max_retries, backoff_s=backoff_s)
        self._http = httpx.AsyncClient(timeout=timeouts, headers=common.auth_headers(common.api_key_or_env(api_key)), limits=common.LIMITS)

    async def complete(self, prompt, *, model=None, max_tokens=None, temperature=None, top_p=None, top_k=None,
                       stop=None, seed=None, stream: bool = False, **extra) -> Completion | AsyncStream:
        extra, options = split_options(extra)
        body = {"prompt": prompt, **common.sampling_fields(model or self.model, max_tokens, temperature, top_p,
                                                          top_k, stop, seed, extra)}
        return await self._generate("/completions", body, stream, options)

    async def chat(self, messages, *, model=None, max_tokens=None, temperature=None, top_p=None, top_k=None,
                   stop=None, seed=None, stream: bool = False, **extra) -> Completion | AsyncStream:
        extra, options = split_options(extra)
        body = {"messages": common.chat_messages(messages),
                **common.sampling_fields(model or self.model, max_tokens, temperature, top_p, top_k, stop, seed,
                                         extra)}
        return await self._generate("/chat/completions", body, stream, options)

    async def models(self) -> list[str]:
        response = await self._send("GET", self._root + "/models", kind=RequestKind.READ_ONLY)
        return [m["id"] for m in common.json_field(response, "data")]

    async def tokenize(self, prompt: str, *, model=None, add_special_tokens: bool = True) -> list[int]:
        body = common.tokenize_body(prompt, model or self.model, add_special_tokens)
        url = common.server_root(self._root) + "/tokenize"
        response = await self._send("POST", url, body, kind=RequestKind.READ_ONLY)
        return common.json_field(response, "tokens")

    async def health(self) -> bool:
        try:
            return (await self._http.get(common.server_root(self._root) + "/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def version(self) -> str:
        response = await self._send("GET", common.server_root(self._root) + "/version", kind=RequestKind.READ_ONLY)
        return common.json_field(response, "version")

    async def reset_prefix_cache(self) -> None:
        """Forget the server's kept prompt prefixes (a cold cache, e.g. before a benchmark)."""
        await self._send("POST", common.server_root(self._root) + "/reset_prefix_cache", kind=RequestKind.READ_ONLY)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, load_inplace: bool = False) -> str:
        """vLLM's runtime load (POST /v1/load_lora_adapter; the server needs VLLM_ALLOW_RUNTIME_LORA_UPDATING):
        requests whose `model` is lora_name then run the adapter. load_inplace reloads a name already loaded.
        Returns the server's "Success: ..." line."""
        body = common.load_lora_body(lora_name, lora_path, load_inplace)
        return (await self._send("POST", self._root + "/load_lora_adapter", body, kind=RequestKind.STATEFUL)).text

    async def unload_lora_adapter(self, lora_name: str) -> str:
        """vLLM's runtime unload (POST /v1/unload_lora_adapter): the name's running requests finish, new ones get a 404.
        Returns the server's "Success: ..." line."""
        body = {"lora_name": common.lora_field("lora_name", lora_name)}
        return (await self._send("POST", self._root + "/unload_lora_adapter", body, kind=RequestKind.STATEFUL)).text

    async def _generate(self, path: str, body: dict, stream: bool, options: RequestOptions) -> Completion | AsyncStream:
        kind, url = RequestKind.GENERATION, self._root + path
        if stream:
            response = await self._send("POST", url, common.streamed(body), kind=kind, stream=True, options=options)
            return AsyncStream(response, expected_choices(body))
        return Completion.from_body(common.json_object(await self._send("POST", url, body, kind=kind, options=options)))

    async def _send(self, method: str, url: str, body: dict | None = None, *, kind: RequestKind,
                    stream: bool = False, options: RequestOptions = DEFAULT) -> httpx.Response:
        for attempt in range(self._retry.max_retries + 1):
            response, error, headers = await self._attempt(method, url, body, stream, options)
            if response is not None:
                return response
            if attempt == self._retry.max_retries or not policy.should_retry(kind, error, headers):
                raise error
            await asyncio.sleep(self._retry.delay(attempt, headers))
        raise AssertionError("unreachable")

    async def _attempt(self, method, url, body, stream, options):
        """As Client._attempt: always streamed, a whole reply read here."""
        try:
            response = await self._follow(self._http.build_request(method, url, json=body, **options.request_args()))
        except httpx.TransportError as err:
            return None, policy.transport_error(method, url, err), None
        if not response.is_success:
            return None, await self._failure(response), response.headers
        error = None if stream else await self._read(response, method, url)
        return (None, error, None) if error else (response, None, None)

    async def _follow(self, request: httpx.Request) -> httpx.Response:
        response = await self._http.send(request, stream=True, follow_redirects=False)
        for _ in range(policy.MAX_REDIRECTS):
            target = policy.redirect_to_follow(response)
            if target is None:
                break
            await response.aclose()
            response = await self._http.send(target, stream=True, follow_redirects=False)
        return response

    @staticmethod
    async def _read(response: httpx.Response, method: str, url: str) -> Exception | None:
        try:
            await response.aread()
        except httpx.TransportError as err:
            return policy.transport_error(method, url, err)
        except httpx.DecodingError as err:
            return policy.decoding_error(response.status_code, err)
        finally:
            await response.aclose()
        return None

    async def _failure(self, response: httpx.Response) -> Exception:
        if 300 <= response.status_code < 400:
            await response.aclose()
            return policy.redirect_error(response)
        try:
            body = common.response_body(await response.aread())
        except (httpx.TransportError, httpx.DecodingError) as err:
            body = f"HTTP {response.status_code}; its body broke off or did not decode ({type(err).__name__}): {err}"
        finally:
            await response.aclose()
        return status_error(response.status_code, body)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def close(self) -> None:
        """openai's AsyncOpenAI.close(): aclose()."""
        await self.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
