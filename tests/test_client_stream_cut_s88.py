"""The SDK's streams cut short, against a real ASGI app under uvicorn on loopback that streams every choice of a
request (n per prompt, choice by choice, then the usage chunk and [DONE]) and stops where a test says. Old: a
stream with n > 1 (or several prompts) that ended cleanly after choice 0 finished but before choice 1 sent anything
ended quietly: the client knew only the choices it had seen, so the caller got n - 1 choices and no error. A stream
whose every choice finished may leave out [DONE] (as openai's client: it ends at the body's end)."""
from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from http_helpers import serve_on_loopback
from saguaro_dist.client import APIConnectionError, AsyncClient, Client
from saguaro_dist.client._choices import expected_choices, missing_choices

TOKENS = ("a", "b")


def _prompt_count(body: dict) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return 1
    return len(prompt) if prompt is not None else 1


def _choice_chunk(body: dict, index: int, text: str, finish: str | None, usage: dict | None) -> dict:
    if "messages" in body:
        choice = {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "finish_reason": finish}
    return {"id": "x", "model": "m", "choices": [choice], **({"usage": usage} if usage else {})}


def _events(body: dict, stop_at: str):
    """The stream's SSE events, choice by choice, up to `stop_at`: "whole", "no_done" (all but [DONE]),
    "after_choice0" (choice 0 finished, nothing of the others), "mid_choice0" (choice 0 unfinished)."""
    choices = body.get("n", 1) * (1 if "messages" in body else _prompt_count(body))
    options, sent = body.get("stream_options") or {}, 0
    for index in range(choices):
        for position, token in enumerate(TOKENS):
            finish = "length" if position == len(TOKENS) - 1 else None
            sent += 1
            usage = {"prompt_tokens": 1, "completion_tokens": sent} if options.get("continuous_usage_stats") else None
            yield _choice_chunk(body, index, token, finish, usage)
            if stop_at == "mid_choice0":
                return
        if stop_at == "after_choice0":
            return
    if options.get("include_usage"):
        yield {"id": "x", "model": "m", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": sent}}
    if stop_at == "whole":
        yield "[DONE]"


async def _generate(request):
    body = await request.json()
    events = _events(body, request.path_params["stop_at"])
    lines = (f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return StreamingResponse(lines, media_type="text/event-stream")


@pytest.fixture(scope="module")
def root():
    """The app's root; a client's base URL is <root>/<stop_at>/v1 (a URL with a path is the API root as given)."""
    app = Starlette(routes=[Route("/{stop_at}/v1/completions", _generate, methods=["POST"]),
                            Route("/{stop_at}/v1/chat/completions", _generate, methods=["POST"])])
    with serve_on_loopback(app) as url:
        yield url.removesuffix("/v1")


def _sync_stream(base_url: str, method: str, prompt, **kwargs):
    with Client(base_url, max_retries=0) as client:
        stream = getattr(client, method)(prompt, stream=True, max_tokens=2, **kwargs)
        return [chunk for chunk in stream.chunks()], stream


async def _async_stream(base_url: str, method: str, prompt, **kwargs):
    async with AsyncClient(base_url, max_retries=0) as client:
        stream = await getattr(client, method)(prompt, stream=True, max_tokens=2, **kwargs)
        return [chunk async for chunk in stream.chunks()], stream


@pytest.fixture(params=["sync", "async"])
def read(request, root):
    """read(stop_at, method, prompt, **request fields): (every chunk, the stream) through either client."""
    def run(stop_at, method, prompt, **kwargs):
        base_url = f"{root}/{stop_at}/v1"
        if request.param == "sync":
            return _sync_stream(base_url, method, prompt, **kwargs)
        return asyncio.run(_async_stream(base_url, method, prompt, **kwargs))
    return run


REQUESTS = {"complete n=2": ("complete", "x", {"n": 2}),
            "complete 2 prompts": ("complete", ["x", "y"], {}),
            "complete token prompts": ("complete", [[1, 2], [3]], {}),
            "chat n=3": ("chat", "hi", {"n": 3}),
            "chat n=2 in extra_body": ("chat", "hi", {"extra_body": {"n": 2}})}


@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_a_stream_cut_before_a_later_choice_began_raises(read, request_name):
    method, prompt, fields = REQUESTS[request_name]
    with pytest.raises(APIConnectionError, match=r"ended before \[DONE\].*never began"):
        read("after_choice0", method, prompt, **fields)


@pytest.mark.parametrize("method", ["complete", "chat"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_cut_inside_choice_0_raises(read, method, n):
    with pytest.raises(APIConnectionError, match=r"ended before \[DONE\].*choice 0"):
        read("mid_choice0", method, "x", n=n)


@pytest.mark.parametrize("request_name", list(REQUESTS))
@pytest.mark.parametrize("stop_at", ["whole", "no_done"])
def test_a_stream_every_choice_of_which_finished_reads_whole(read, request_name, stop_at):
    """With or without [DONE] (openai's client ends at the body's end, too); the usage chunk is read."""
    method, prompt, fields = REQUESTS[request_name]
    chunks, stream = read(stop_at, method, prompt, **fields)
    choices = len(stream.texts)
    assert choices >= 2 and all(text == "".join(TOKENS) for text in stream.texts.values())
    assert stream.usage == {"prompt_tokens": 1, "completion_tokens": 2 * choices}
    assert stream.finish_reason == "length"


@pytest.mark.parametrize("method", ["complete", "chat"])
@pytest.mark.parametrize("stream_options", [{"include_usage": False},
                                            {"include_usage": True, "continuous_usage_stats": True}])
def test_usage_options_read_whole(read, method, stream_options):
    chunks, stream = read("whole", method, "x", n=2, stream_options=stream_options)
    assert stream.texts == {0: "ab", 1: "ab"}
    want_usage = {"prompt_tokens": 1, "completion_tokens": 4} if stream_options["include_usage"] else None
    assert stream.usage == want_usage
    if stream_options.get("continuous_usage_stats"):
        assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("body, want", [({"prompt": "x"}, 1), ({"prompt": "x", "n": 3}, 3),
                                        ({"prompt": [1, 2, 3], "n": 2}, 2), ({"prompt": ["x", "y"], "n": 2}, 4),
                                        ({"messages": [], "n": 2}, 2), ({"prompt": "x", "n": True}, None),
                                        ({"prompt": "x", "n": 0}, None), ({"prompt_embeds": "..."}, None)])
def test_expected_choices(body, want):
    """None where the request does not say plainly: a stream without [DONE] is then checked on the choices seen."""
    assert expected_choices(body) == want


def test_missing_choices_names_what_is_missing():
    assert missing_choices(3, {0: "a", 1: "b"}, {1}) == "choice 1 unfinished; choice 2 of 3 never began"
    assert missing_choices(None, {0: "a"}, set()) is None and missing_choices(1, {0: "a"}, set()) is None
