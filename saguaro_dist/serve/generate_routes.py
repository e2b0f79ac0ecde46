"""The API app's generating routes for /v1/completions and /v1/chat/completions: each request's jobs, answered
whole (full_replies.py) or streamed (sse_stream.py)."""
from __future__ import annotations

from dataclasses import replace

from fastapi import Request

from saguaro_dist.serve import responses
from saguaro_dist.serve.beam_route import beam_response
from saguaro_dist.serve.chat_request import REPLY_ROLE, PromptEnd
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.full_replies import full_response
from saguaro_dist.serve.prompts import encode_chat
from saguaro_dist.serve.protocol import ChatCompletionRequest, CompletionRequest
from saguaro_dist.serve.route_support import cancel_on_disconnect, request_id_of, response_role, serving_state
from saguaro_dist.serve.sse_stream import stream_response
from saguaro_dist.serve.state import Job, ServingState
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind


@cancel_on_disconnect
async def completions(body: CompletionRequest, request: Request):
    created = responses.arrival_time()  # every chunk's and the body's `created`: the request's arrival
    state = serving_state(request)
    body.reject_unsupported()
    model = state.check_model(body.model)
    jobs = state.jobs([state.encode(p, body.add_special_tokens) for p in body.prompts()], body, "prompt")
    return await _respond(state, body, jobs, model, responses.COMPLETION, request_id_of(request, body.request_id),
                          created=created)


@cancel_on_disconnect
async def chat(body: ChatCompletionRequest, request: Request):
    created = responses.arrival_time()
    state = serving_state(request)
    body.reject_unsupported()
    model = state.check_model(body.model)
    messages = [m.with_calls_as_written() for m in body.messages] if state.harmony else body.messages
    end = body.prompt_end()
    prompt = encode_chat(state.tokenizer, messages, body.tools, body.chat_template_kwargs, state.chat_template,
                         end=end, add_special_tokens=body.add_special_tokens)
    jobs = chat_jobs(state, body, prompt, "messages", end)
    try:
        return await _respond(state, body, jobs, model, responses.CHAT, request_id_of(request, body.request_id),
                              body.reply_role(response_role(request)), created)
    except ValueError as err:  # a constraint the tool choice wrote, refused: name tool_choice, not structured_outputs
        if (named := body.tool_structure_error(err)) is None:
            raise
        raise named from None


def chat_jobs(state: ServingState, body, prompt: list[int], param: str, end: PromptEnd) -> list[Job]:
    """A chat turn's jobs under its tool plan (chat completions and responses alike); `end`: how the prompt
    ends (a continued message's reasoning is read by its last think tag: ServingState.reasoning_parser_for)."""
    plan = state.tool_plan_for(body)
    if plan.kind is ToolChoiceKind.AUTO and plan.parser is None:
        raise APIError(400, '"auto" tool choice needs a server started with a tool-call parser (--tool-call-parser '
                            f'{" | ".join(p.value for p in ToolCallParser)}); name a function or use "required" instead',
                       param="tool_choice")
    jobs = [replace(job, continues=end is PromptEnd.CONTINUE) for job in state.jobs([prompt], body, param)]
    if body.include_reasoning:  # vLLM's include_reasoning false: the constraint holds from the first token
        jobs = map(state.reason_first, jobs)
    jobs = [replace(job, params=plan.adjust(job.params)) for job in jobs]
    if state.harmony:  # harmony's channels, read on every reply (tools or not) with either parser
        jobs = [replace(job, params=replace(job.params, skip_special_tokens=False)) for job in jobs]
    return jobs


async def _respond(state: ServingState, body, jobs: list[Job], model: str, fmt: responses.Format, request_id: str,
                   role: str = REPLY_ROLE, created: int | None = None):
    """`role`: a chat reply's (the request's reply_role); completions have none. `created`: the request's arrival."""
    if body.use_beam_search:  # vLLM's search over one-token steps (beam_route.py)
        return await beam_response(state, body, jobs, model, fmt, request_id, role, created)
    jobs = state.named(jobs, request_id)
    if body.stream:
        return await stream_response(state, body, jobs, model, fmt, request_id, role, created)
    return await full_response(state, body, jobs, model, fmt, request_id, role, created)
