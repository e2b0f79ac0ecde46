"""What a request holds (its engine generations, tasks, its request id) is given back when its client goes
away, when it is refused part-way, and when a batch stops early: real HTTP over loopback to the app under
plain uvicorn (no Ray Serve to cancel handlers), a real engine over a tiny checkpoint."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.batch import app_client, run_batch
from test_serve_fixtures import make_tokenizer, write_llama

# Far longer a generation (ignore_eos: it cannot end sooner; 4000 tokens took ~3 s on the 2-core CI box) than
# a hang-up takes to land, milliseconds, seconds on a loaded box: a generation that makes all LONG tokens was
# never told to stop. Only a test that fails runs one to its end.
LONG = 20_000
CHAT = [{"role": "user", "content": "the cat"}]
LONG_BODIES = {  # one long generation on each generating route
    "/v1/completions": {"prompt": [4, 5, 6], "max_tokens": LONG, "ignore_eos": True},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": LONG, "ignore_eos": True},
    "/v1/responses": {"input": "the cat", "max_output_tokens": LONG, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """One batch slot (so a second request waits in the queue), a context long enough for LONG tokens."""
    path = write_llama(tmp_path_factory.mktemp("long_context"), make_tokenizer(), hidden=32, layers=1, seed=3,
                       max_positions=LONG + 256)
    with LLM(model=path, mode="ar", max_model_len=LONG + 256, max_batch_size=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def app(llm):
    return create_app(llm, ServerOptions("m"))


@pytest.fixture(scope="module")
def url(app):
    with serve_on_loopback(app) as base:
        yield base.removesuffix("/v1")


@pytest.fixture
def state(app, llm):
    """The app's serving state; each test starts and must end with nothing generating."""
    state = app.state.saguaro
    _until(lambda: state.running == 0 and _engine_idle(llm))
    yield state
    _until(lambda: state.running == 0 and _engine_idle(llm))


def _engine_idle(llm) -> bool:
    return llm.load.num_running == 0 and llm.load.num_waiting == 0


def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


@contextmanager
def open_request(url: str, path: str, body: dict):
    """A POST sent over a raw socket and left unread; leaving the block hangs up (closes the connection)."""
    address, payload = urlsplit(url), json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(head + payload)
        yield sock


# ---- a client that hangs up -----------------------------------------------------------------------
@pytest.mark.parametrize("path", list(LONG_BODIES))
def test_a_non_streamed_request_stops_generating_when_its_client_hangs_up(url, state, llm, path):
    cancelled, generated = state.cancelled, llm.metrics.generated_tokens
    with open_request(url, path, LONG_BODIES[path]):
        _until(lambda: llm.load.num_running == 1)  # generating; now hang up
    _until(lambda: state.running == 0)
    assert state.cancelled == cancelled + 1  # ended early (the old code made all LONG tokens for nobody)
    _until(lambda: _engine_idle(llm))
    assert llm.metrics.generated_tokens - generated < LONG  # the engine took the abort, not the generation's end


@pytest.mark.parametrize("path", list(LONG_BODIES))
def test_a_stream_stops_generating_when_its_client_hangs_up(url, state, llm, path):
    cancelled, generated = state.cancelled, llm.metrics.generated_tokens
    with open_request(url, path, {**LONG_BODIES[path], "stream": True}) as sock:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # streaming; now hang up
    _until(lambda: state.running == 0)
    assert state.cancelled == cancelled + 1
    _until(lambda: _engine_idle(llm))
    assert llm.metrics.generated_tokens - generated < LONG


@pytest.mark.parametrize("path", list(LONG_BODIES))
def test_a_queued_stream_stops_when_its_client_hangs_up_before_its_first_token(url, state, llm, path):
    """The handler waits for a stream's first delta before it answers (so a refusal is a 400): a hang-up
    then must not wait for a batch slot, here held by a long request, to be noticed."""
    cancelled = state.cancelled
    with open_request(url, "/v1/completions", LONG_BODIES["/v1/completions"]):
        _until(lambda: llm.load.num_running == 1)
        with open_request(url, path, {**LONG_BODIES[path], "stream": True}):
            _until(lambda: llm.load.num_waiting == 1)
        _until(lambda: state.cancelled == cancelled + 1)
        assert state.running == 1  # the first still generates; the second is gone
        _until(lambda: llm.load.num_waiting == 0)
        assert state.running == 1  # it left the queue while the first still generates, not when the slot freed


# ---- a request refused part-way --------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_refused_part_way_stops_the_choices_already_started(url, state, llm, stream):
    """Two prompts: the engine takes the first, refuses the second (a token id past the vocabulary)."""
    body = {"prompt": [[4, 5, 6], [len(llm.tokenizer) + 5]], "max_tokens": LONG, "ignore_eos": True, "stream": stream}
    cancelled = state.cancelled
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "prompt token ids" in reply.json()["error"]["message"]
    assert state.running == 0  # the first prompt's generation ended with the request, not LONG tokens later
    # every prompt is checked before any starts (vLLM's): old, the first ran, then counted as a client gone away
    assert state.cancelled == cancelled


@pytest.mark.parametrize("fan_in", ["gather_or_cancel", "merge"])
def test_a_choice_stopped_for_a_failed_sibling_is_no_hang_up(url, state, llm, fan_in):
    """A choice cancelled because another of the request's generations failed is stopped, but not counted as a
    client gone away (old: cancelled +1, and an abort recorded, for a request answered with the failure)."""
    from saguaro_dist.serve.fan_in import gather_or_cancel, merge
    from saguaro_dist.serve.state import Job
    job, cancelled = Job([4, 5, 6], SamplingParams(max_tokens=LONG, ignore_eos=True)), state.cancelled

    async def failing_sibling():
        while llm.load.num_running == 0:  # the long choice generates: then this one fails
            await asyncio.sleep(0.005)
        raise ValueError("sibling failed")
        yield  # (an async generator, for merge)

    async def run() -> None:
        if fan_in == "gather_or_cancel":
            await gather_or_cancel([state.collect(job), anext(failing_sibling(), None)])
        else:
            async for _ in merge([state.stream(job), failing_sibling()]):
                pass
    with pytest.raises(ValueError, match="sibling failed"):
        asyncio.run(run())
    assert state.running == 0 and state.cancelled == cancelled


# ---- batch files ---------------------------------------------------------------------------------
def test_a_batch_that_stops_early_leaves_nothing_running(app, state, llm):
    """A write that fails (a full disk) ends run_batch: the requests still in flight end with it."""
    lines = ["not json", json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": [4, 5], "max_tokens": LONG, "ignore_eos": True}})]

    def write(record: dict) -> None:
        raise OSError("no space left on device")

    async def run() -> list:
        with pytest.raises(OSError):
            await run_batch(app_client(app), lines, write, max_in_flight=2)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert asyncio.run(run()) == []
    assert state.running == 0


# ---- request ids ----------------------------------------------------------------------------------
def test_a_request_id_is_free_again_as_soon_as_its_stream_is_closed(llm):
    """The engine may not have taken the closed stream's abort yet: the id must not be refused for that."""
    params, short = SamplingParams(max_tokens=LONG, ignore_eos=True), SamplingParams(max_tokens=2, ignore_eos=True)

    async def reuse() -> list[str]:
        reasons = []
        for _ in range(3):  # (the old code refused the second stream nearly every time: one try could pass)
            stream = llm.stream(prompt_token_ids=[4, 5, 6], sampling_params=params, request_id="mine")
            await anext(stream)
            await stream.aclose()  # aborts it; the next stream takes its id at once
            deltas = [d async for d in llm.stream(prompt_token_ids=[4, 5], sampling_params=short, request_id="mine")]
            assert {d.request_id for d in deltas} == {"mine"}
            reasons.append(deltas[-1].finish_reason)
        return reasons
    assert asyncio.run(reuse()) == ["length"] * 3
    _until(lambda: _engine_idle(llm))


def test_two_open_streams_never_share_a_request_id(llm):
    """While a stream is open its id is taken (vLLM's "already running"); abort(id) ends that stream."""
    params = SamplingParams(max_tokens=LONG, ignore_eos=True)

    async def twice() -> str:
        first = llm.stream(prompt_token_ids=[4, 5, 6], sampling_params=params, request_id="twin")
        await anext(first)
        with pytest.raises(ValueError, match="already running"):
            await anext(llm.stream(prompt_token_ids=[4, 5], sampling_params=params, request_id="twin"))
        llm.abort("twin")
        return [d async for d in first][-1].finish_reason
    assert asyncio.run(twice()) == "abort"
    _until(lambda: _engine_idle(llm))
