"""Offline batch inference in OpenAI's batch file format (vLLM's `run_batch`): one JSON request a line in,
one JSON result a line out, in input order.

Every request goes through the serving app itself: in-process over an ASGI transport (app_client, no
port), or a running server's (server_client, `--url`). So a line means what it means to `saguaro serve`
(the same validation, replies and error bodies), and all of a file's requests share one continuously
batched engine. A line that is not a request gets an error record, as do a request the app refuses and
one that never reached the server; the other lines run on. Each input line gets exactly one record.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from types import GeneratorType
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import httpx
from tqdm import tqdm

from saguaro_dist.client._common import auth_headers, server_root

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class BatchRequest:
    """One input line, checked: a request for the app, or why it is not one."""
    line: int                 # 1-based, in the input
    custom_id: str | None
    url: str = ""
    body: dict = field(default_factory=dict)
    error: str | None = None  # set: the line gets an error record and never reaches the app


@dataclass
class BatchSummary:
    requests: int = 0
    failed: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def add(self, record: dict) -> None:
        self.requests += 1
        response = record["response"]
        if record["error"] is not None or response["status_code"] != 200:
            self.failed += 1
        else:
            self.completion_tokens += completion_tokens(response["body"])


def completion_tokens(body) -> int:
    """The tokens a reply says it generated: usage's completion_tokens (/v1/responses: output_tokens); 0 where
    another server's 200 leaves usage out or null (that crashed the summary before the line's record was written)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    count = usage.get("completion_tokens", usage.get("output_tokens")) if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


def parse_request(line: int, text: str | bytes, seen: set[str]) -> BatchRequest:
    """One line of the input file (bytes as read: a line that is not UTF-8 is that line's error). `seen`
    holds the custom_ids before it (they must be unique)."""
    try:
        # without its line break, which json counted as a line: a CRLF or LF line's error said "line 2"
        raw = json.loads((text.decode("utf-8") if isinstance(text, bytes) else text).rstrip("\r\n"))
    except UnicodeDecodeError as err:
        return BatchRequest(line, None, error=f"line {line} is not UTF-8 text: {err}")
    except json.JSONDecodeError as err:
        return BatchRequest(line, None, error=f"line {line} is not JSON: {err.msg} at column {err.colno}")
    except RecursionError:  # escaped run_batch: the requests in flight were cancelled and nothing was written
        return BatchRequest(line, None, error=f"line {line} is nested too deeply to read")
    except ValueError as err:  # json's others (an integer of over 4300 digits) ended the batch the same way
        return BatchRequest(line, None, error=f"line {line} cannot be read: {err}")
    if not isinstance(raw, dict):
        return BatchRequest(line, None, error=f"line {line} must be a JSON object")
    custom_id = raw.get("custom_id")
    error = _request_error(raw, custom_id, seen)
    if isinstance(custom_id, str):
        seen.add(custom_id)
    if error:
        return BatchRequest(line, custom_id if isinstance(custom_id, str) else None, error=f"line {line}: {error}")
    return BatchRequest(line, custom_id, raw["url"], raw["body"])


def _request_error(raw: dict, custom_id, seen: set[str]) -> str | None:
    if not isinstance(custom_id, str) or not custom_id:  # OpenAI's and vLLM's: a string (vLLM refuses 7 too)
        given = {dict: "an object", list: "an array"}.get(type(custom_id)) or json.dumps(custom_id)
        return f"custom_id must be a non-empty string, got {given}"
    if custom_id in seen:
        return f"custom_id {custom_id!r} is not unique"
    if raw.get("method", "POST") != "POST":
        return f"method must be POST, got {raw.get('method')!r}"
    if raw.get("url") not in BATCH_URLS:
        return f"url must be one of {list(BATCH_URLS)}, got {raw.get('url')!r}"
    if not isinstance(raw.get("body"), dict):
        return "body must be a JSON object (the request)"
    if _reads_as_true(raw["body"].get("stream", False)):
        return "stream is not supported in a batch (each result is one JSON line)"
    return None


def _reads_as_true(value) -> bool:
    """Whether the app's `stream: bool` field reads the value as true (pydantic's lax bool: "false" and 0 are
    false, not refused as truthy); a value it refuses is left to the app's own 400."""
    if isinstance(value, bool):  # the usual case, without building pydantic's validator
        return value
    from pydantic import TypeAdapter, ValidationError  # here: `saguaro --help` runs without the serving stack
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return False


def result_record(request: BatchRequest, status: int | None, body: dict | None, request_id: str,
                  code: str = "invalid_request") -> dict:
    """OpenAI's batch output line: `response` for whatever the app answered (errors included, with their
    status and body), `error` (code, message) only for a line that never reached it."""
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    error = {"code": code, "message": request.error} if request.error else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id, "response": response, "error": error}


async def answer(client: httpx.AsyncClient, request: BatchRequest) -> dict:
    """The app's reply to one request (or the line's error record). The request id names the generation
    in the server's logs and the reply's id."""
    request_id = f"batch-{uuid.uuid4().hex}"
    if request.error:
        return result_record(request, None, None, request_id)
    try:
        # json.dumps escapes what UTF-8 cannot carry (a lone surrogate the line held as "\\ud800"), so the app
        # judges such a line as it would over HTTP; httpx's json= encoder raised on it and ended the whole batch.
        content = json.dumps(request.body)
    except RecursionError:  # read at the loop's depth, written deeper: this line's error, not the batch's end
        return result_record(replace(request, error=f"line {request.line} is nested too deeply to send"), None, None,
                             request_id)
    try:
        reply = await client.post(request.url, content=content,
                                  headers={"X-Request-Id": request_id, "content-type": "application/json"})
    except httpx.HTTPError as err:  # a server that went away: this line's record says so, the rest go on
        failed = replace(request, error=f"line {request.line}: the request did not complete: {err!r}")
        return result_record(failed, None, None, request_id, code="request_failed")
    return result_record(request, reply.status_code, _json_body(reply), request_id)


def _json_body(reply: httpx.Response) -> dict:
    try:
        return reply.json()
    except ValueError:  # not the app's JSON (an unhandled failure): keep its text
        return {"error": {"message": reply.text, "type": "InternalServerError", "code": reply.status_code}}


def app_client(app) -> httpx.AsyncClient:
    """The serving app in-process: no port, no network."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a failure is that line's 500
    return httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None)


def server_client(url: str, api_key: str | None) -> httpx.AsyncClient:
    """A running server ("http://host:8000" or ".../v1"); generations take as long as they take."""
    return httpx.AsyncClient(base_url=server_root(url), headers=auth_headers(api_key), timeout=None)


# Only running requests count against --max-in-flight (as vLLM's semaphore): records finished behind a slow
# line wait in memory until it is written (counting them as in flight left one request running behind it).
# What waits is bounded by how far reading may run ahead: reading stops while this many times --max-in-flight
# records (running, waiting for a slot, or finished) are unwritten.
READ_AHEAD_PER_SLOT = 4


async def run_batch(client: httpx.AsyncClient, lines: Iterable[str | bytes], write: Callable[[dict], None],
                    max_in_flight: int) -> BatchSummary:
    """Answer every non-blank line, at most max_in_flight running at once, writing the records in input order
    (a finished one waits for those before it). Returns what ran."""
    summary, seen, unwritten = BatchSummary(), set(), deque()
    slots, read_ahead = asyncio.Semaphore(max_in_flight), READ_AHEAD_PER_SLOT * max_in_flight
    start = time.perf_counter()
    bar = tqdm(desc="Processed requests", unit="req", disable=None)  # shown only when stderr is a terminal

    def flush(record: dict) -> None:
        summary.add(record)
        write(record)
        bar.update(1)
        bar.set_postfix_str(f"failed {summary.failed}, output {summary.completion_tokens} tokens", refresh=False)

    with bar:
        async with client:
            reader, number = LineReader(lines), 0
            next_line = asyncio.ensure_future(reader.get())
            try:
                while next_line or unwritten:
                    reading = next_line is not None and len(unwritten) < read_ahead
                    if reading and next_line.done():
                        text, number = next_line.result(), number + 1
                        next_line = None if text is None else asyncio.ensure_future(reader.get())
                        text = without_bom(text) if number == 1 and text else text
                        if text and text.strip():
                            request = parse_request(number, text, seen)
                            unwritten.append(asyncio.ensure_future(_answer_in_slot(client, request, slots)))
                        continue
                    waits = ([next_line] if reading else []) + ([unwritten[0]] if unwritten else [])
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    while unwritten and unwritten[0].done():
                        flush(unwritten.popleft().result())
            finally:  # stopped early (a failed write, an interrupt): the requests in flight end with the batch
                reader.stop()
                await _cancel_all([*unwritten, *([next_line] if next_line else [])])
    summary.seconds = time.perf_counter() - start
    return summary


async def _answer_in_slot(client: httpx.AsyncClient, request: BatchRequest, slots: asyncio.Semaphore) -> dict:
    if request.error:  # never reaches the app: takes no slot
        return await answer(client, request)
    async with slots:
        return await answer(client, request)


class LineReader:
    """The input's lines, read on a thread of their own: a blocking read (a pipe that trickles) held up the
    event loop, so the lines already read did not run until max_in_flight more came or the input ended. A
    daemon thread, so one blocked on an open stdin neither holds up the loop's close nor the process's exit."""

    def __init__(self, lines: Iterable[str | bytes], read_ahead: int = 64):
        self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
        self._room, self._stopped = threading.Semaphore(read_ahead), False
        threading.Thread(target=self._read, args=(lines,), name="run-batch-reader", daemon=True).start()

    def _read(self, lines: Iterable[str | bytes]) -> None:
        iterator = iter(lines)
        try:
            while self._room.acquire() and not self._stopped:
                text = next(iterator, None)
                self._hand_over(text)
                if text is None:
                    return
        except Exception as err:  # a failed read: the batch's error, raised where the loop takes the line
            self._hand_over(err)
        finally:
            if isinstance(iterator, GeneratorType):  # here, after its last read: its finally may close its file
                iterator.close()

    def _hand_over(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: the batch is over
            pass

    async def get(self) -> str | bytes | None:
        """The next line; None at the end of the input."""
        item = await self._queue.get()
        self._room.release()
        if isinstance(item, Exception):
            raise item
        return item

    def stop(self) -> None:
        self._stopped = True
        self._room.release()  # a thread waiting for room ends instead of reading on


def without_bom(text: str | bytes) -> str | bytes:
    """The first line without a UTF-8 byte order mark (utf-8-sig's), which Windows PowerShell 5.1 writes: json
    refused it, and the file's first request became an error record."""
    return text.removeprefix(b"\xef\xbb\xbf" if isinstance(text, bytes) else "\ufeff")


async def _cancel_all(tasks) -> None:
    """Cancel the tasks and wait for them, so their requests are over (aborted) before the client closes."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
