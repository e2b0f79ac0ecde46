"""The API app's /v1/responses route (OpenAI's Responses API; its bodies and events are openai_responses*.py):
the input runs as a chat turn would."""
from __future__ import annotations

import time
from contextlib import aclosing

from fastapi import Request

from saguaro_dist.serve import responses
from saguaro_dist.serve.errors import APIError, stream_error
from saguaro_dist.serve.full_replies import logprobs_of, reply_text, shown
from saguaro_dist.serve.generate_routes import chat_jobs
from saguaro_dist.serve.harmony import LiteralMarkers
from saguaro_dist.serve.openai_responses import (InputMessage, ReasoningInputItem, ResponseEvents, ResponsesRequest,
                                                  output_items, response_body)
from saguaro_dist.serve.openai_responses_output import HarmonyReply
from saguaro_dist.serve.openai_responses import usage as responses_usage
from saguaro_dist.serve.prompts import encode_chat
from saguaro_dist.serve.protocol import PromptEnd
from saguaro_dist.serve.reasoning import ReasoningStream, split_reasoning
from saguaro_dist.serve.route_support import (ClosingStreamingResponse, cancel_on_disconnect, request_id_of,
                                              serving_state)
from saguaro_dist.serve.sse_stream import per_choice
from saguaro_dist.serve.fan_in import merge
from saguaro_dist.serve.state import Job, ServingState
from saguaro_dist.serve.tools import ToolStream


@cancel_on_disconnect
async def responses_route(body: ResponsesRequest, request: Request):
    """OpenAI's Responses API (serve/openai_responses.py): the input runs as a chat turn would. A constraint
    the engine cannot compile is refused naming the field that asked for it (text.format, tools)."""
    try:
        return await _respond(body, request)
    except ValueError as err:
        if (clash := body.tool_plan().clash_error(err)) is not None:  # ignore_eos, min_tokens, ...: as chat's
            raise clash from None
        field = body.structure_field()
        if field is None or not str(err).startswith("structured_outputs "):
            raise
        raise APIError(400, f"{field}{str(err).removeprefix('structured_outputs')}", param=field) from None


async def _respond(body: ResponsesRequest, request: Request):
    created_at = int(time.time())  # the request's start, not each event's (a stream's changed as it went)
    state = serving_state(request)
    body.reject_unsupported()
    model = state.check_model(body.model)
    end = prompt_end(body)
    prompt = encode_chat(state.tokenizer, body.messages(calls_as_written=state.harmony), body.chat_tools(), body.chat_template_kwargs,
                         state.chat_template, param="input", end=end)
    request_id = request_id_of(request)
    (job,) = state.named(chat_jobs(state, body, prompt, "input", end), request_id)
    response_id = f"resp_{request_id}"
    if body.stream:
        batches = merge([state.stream(job)], state.stream_interval_s, lambda d: bool(d.text) or d.finished)
        first = await anext(batches, None)  # before answering: a request the engine rejects still gets a 400
        events = ResponseEvents(response_id, model, body, created_at, _logprob_items(state, job), streamed=True,
                                params=job.params)
        events = _response_events(state, job, events, batches, first)
        return ClosingStreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await state.collect(job)
    events = ResponseEvents(response_id, model, body, created_at, _logprob_items(state, job), params=job.params)
    items = _whole_items(state, job, body, result, events)
    return response_body(response_id, model, body, items, "completed", result.finish_reason, created_at=created_at,
                         params=job.params, **_response_extra(state, job, result.token_ids, result.metrics))


def prompt_end(body: ResponsesRequest) -> PromptEnd:
    """vLLM's should_continue_final_message: an assistant message or reasoning item the client marks in_progress
    or incomplete, last in the input, is a prefill the reply continues; otherwise a new assistant turn opens."""
    last = body.input[-1] if isinstance(body.input, list) else None
    partial = isinstance(last, (InputMessage, ReasoningInputItem)) and last.status in ("in_progress", "incomplete")
    return PromptEnd.CONTINUE if partial and getattr(last, "role", "assistant") == "assistant" else PromptEnd.NEW_TURN


def _whole_items(state: ServingState, job: Job, body: ResponsesRequest, result, events: ResponseEvents) -> list[dict]:
    """The output items of a finished reply (a gpt-oss reply's: as its stream makes them, HarmonyReply)."""
    parser = state.reasoning_parser_for(job)
    if parser is not None and parser.harmony:
        return _harmony_items(state, body, result, events)
    reasoning, text = split_reasoning(parser, reply_text(state, result))
    content, calls = state.tool_plan_for(body).parse(text)
    return output_items(shown(body, reasoning), content, calls, events.logprob_items(result.logprobs or []),
                        result.finish_reason)


def _harmony_items(state: ServingState, body: ResponsesRequest, result, events: ResponseEvents) -> list[dict]:
    """A gpt-oss reply's items, fed as its stream is: in pieces (each marker token alone, each run of ordinary
    tokens between), each with its own tokens' logprob entries, so that each message's item carries its tokens'
    (fed whole, the first message took every entry). The pieces' texts are the reply's text cut in order."""
    reply, marks = HarmonyReply.of(events, state.tool_plan_for(body)), LiteralMarkers.of(state.tokenizer)
    ids, entries = result.token_ids, result.logprobs or []
    pieces = token_pieces(state.tokenizer, marks.marker_ids, ids, result.text)
    for n, (start, end, text) in enumerate(pieces):
        reply.feed(marks.feed(text, ids[start:end]), n == len(pieces) - 1, entries[start:end])
    reply.events.finish(result.finish_reason)
    return reply.events.items


def token_pieces(tokenizer, marker_ids: dict[int, str], ids: list[int], text: str) -> list[tuple[int, int, str]]:
    """(start, end, its text): ids cut before and after each marker token, and `text` cut with them, by each
    piece's decoded length (a marker's: its own text). The texts are `text` in order whatever the lengths (the
    last piece takes what is left; a stop token left out of the text gets "")."""
    cuts = [i for n, token in enumerate(ids) if token in marker_ids for i in (n, n + 1)]
    bounds = list(dict.fromkeys([0, *cuts, len(ids)]))  # (in order; a marker first or last cuts nothing there)
    pieces, at = [], 0
    for start, end in zip(bounds, bounds[1:]):
        run = ids[start:end]
        size = len(marker_ids[run[0]]) if end - start == 1 and run[0] in marker_ids else len(
            tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        pieces.append((start, end, text[at:at + size]))
        at += size
    if pieces and at < len(text):
        start, end, piece = pieces[-1]
        pieces[-1] = (start, end, piece + text[at:])
    return pieces or [(0, 0, text)]


def _logprob_items(state: ServingState, job: Job):
    """Engine logprob entries -> Responses' logprobs items, which are chat's `logprobs.content` entries."""
    def items(entries: list) -> list:
        logprobs = logprobs_of(state, responses.CHAT, job, entries)
        return logprobs["content"] if logprobs else []
    return items


def _response_extra(state: ServingState, job: Job, token_ids: list[int], metrics) -> dict:
    """A response's usage (reasoning_tokens: 0 without a reasoning parser, as OpenAI's field is always
    there) and our speculation stats."""
    cached = metrics.num_cached_tokens if metrics is not None else 0
    reasoning = state.reasoning_count(job, token_ids) or 0
    return {"usage": responses_usage(len(job.prompt_ids), len(token_ids), cached, reasoning),
            "speculation": responses.speculation([metrics], state.engine.config.mode.value)}


async def _response_events(state: ServingState, job: Job, events: ResponseEvents, batches, first):
    parser, plan = state.reasoning_parser_for(job), state.tool_plan_for(events.body)
    reasoning, tools = ReasoningStream(parser), ToolStream(plan)
    harmony = HarmonyReply.of(events, plan) if parser is not None and parser.harmony else None
    token_ids, marks = [], LiteralMarkers.of(state.tokenizer) if state.harmony else None
    events.opening()  # (each batch's events are sent by events.take(): the calls' returns are not needed)
    try:
        async with aclosing(batches):
            batch = first
            while batch is not None:
                for _, text, ids, last, logprobs in per_choice(batch):
                    token_ids += ids
                    text = marks.feed(text, ids) if marks else text
                    if harmony is not None:  # its messages in order, each its own item
                        harmony.feed(text, last.finished, logprobs)
                    else:
                        thought, text = reasoning.feed(text, last.finished)
                        thought, delta = shown(events.body, thought) or "", tools.step(text, last.finished)
                        events.text(thought, delta.get("content", ""), logprobs)
                        events.calls(delta.get("tool_calls", []))
                    if last.finished:
                        events.closing(last.finish_reason, **_response_extra(state, job, token_ids, last.metrics))
                yield events.take()
                batch = await anext(batches, None)
    except Exception as err:  # noqa: BLE001 - headers are sent: the error travels as events, the last response.failed
        yield events.take() + events.failed(stream_error(err))
