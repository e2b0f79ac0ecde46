"""The reply of OpenAI's Responses API (`POST /v1/responses`, openai_responses.py): the Response object
with its output items (reasoning, message, function calls) and usage, and the SSE events of a streamed one."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from saguaro_dist.serve import responses
from saguaro_dist.serve.harmony import HarmonySplitter, Route, plain
from saguaro_dist.serve.tool_parsers import ToolCall
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

if TYPE_CHECKING:  # annotations only: the request module imports this one
    from saguaro_dist.sampling_params import SamplingParams
    from saguaro_dist.serve.openai_responses import ResponsesRequest

# Where a gpt-oss reply's next message of a route begins (HarmonySplitter's separator here: each message is its
# own item, as vLLM's harmony path makes them). A lone surrogate, as harmony.LITERAL: no decoded text holds one.
MESSAGE_BREAK = "\udffe"


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    """text None: no content yet (a streamed item's, whose content_part.added brings its part, as message_item's)."""
    content = [] if text is None else [reasoning_part(text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status, "content": content}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str, logprobs: list | None = None) -> dict:
    """logprobs: chat's `logprobs.content` entries ({token, logprob, bytes, top_logprobs}), Responses' shape."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, status: str = "completed", logprobs: list | None = None) -> dict:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def new_item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def function_call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    """reasoning_tokens: output tokens the reasoning parser read as reasoning (reasoning.ReasoningTokens).
    cache_write_tokens: OpenAI's count of tokens written to a cache it bills; this server bills none (0), and
    the openai SDK's ResponseUsage requires the field."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def response_body(response_id: str, model: str, body: ResponsesRequest, output: list[dict], status: str,
                  finish_reason: str | None = None, *, created_at: int, params: SamplingParams | None = None,
                  **extra) -> dict:
    """The Response object: status completed, incomplete (max_output_tokens reached) or in_progress.
    created_at: when the request came (OpenAI's), the same in each of a stream's events. params: the sampling
    settings the reply runs under (None: the request's own)."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {"type": "text"}
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, **_settings(body, params),
            "metadata": body.metadata or {}, "max_tool_calls": body.max_tool_calls, "truncation": body.truncation or "disabled",
            "reasoning": _reasoning(body),
            "parallel_tool_calls": body.parallel_tool_calls, "tool_choice": _tool_choice(body),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "text": {"format": fmt},
            "store": False, **extra}


def _settings(body: ResponsesRequest, params: SamplingParams | None) -> dict:
    """The values the reply ran under, defaults included (vLLM's: a request leaving temperature out still
    learns it), and the request's annotations echoed (OpenAI's; vLLM's from_request echoes user,
    top_logprobs, service_tier)."""
    used = ((params.temperature, params.top_p, params.max_tokens) if params is not None
            else (body.temperature, body.top_p, body.max_output_tokens))
    return {**dict(zip(("temperature", "top_p", "max_output_tokens"), used)), "user": body.user,
            "top_logprobs": body.top_logprobs or 0, "service_tier": body.service_tier or "auto",
            "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier}


def _reasoning(body: ResponsesRequest) -> dict:
    effort = body.reasoning.effort if body.reasoning else None
    return {"effort": effort, "summary": None}


def _tool_choice(body: ResponsesRequest):
    choice = body.tool_choice or "auto"  # as given (OpenAI's default: auto, with tools or without)
    return choice if isinstance(choice, str) else choice.model_dump()


def output_items(reasoning: str | None, content: str | None, calls: list[ToolCall],
                 logprobs: list | None = None, finish_reason: str | None = None) -> list[dict]:
    """reasoning (if any), the message (unless calls came without content), then the calls. logprobs, of
    every generated token as chat's are, ride on the message. Cut by max_output_tokens: the last item is
    incomplete (OpenAI's)."""
    items = [] if reasoning is None else [reasoning_item(new_item_id("rs"), reasoning)]
    if content or not calls:
        items.append(message_item(new_item_id("msg"), content or "", logprobs=logprobs))
    items += [function_call_item(call) for call in calls]
    items[-1]["status"] = _last_status(finish_reason)
    return items


def _last_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _failure_code(error_type: str | None) -> str:
    """A failed response's error code, of the openai SDK's ResponseError codes, for an error envelope's type."""
    return {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}.get(error_type,
                                                                                                       "server_error")


class ResponseEvents:
    """The SSE events of one streamed response, in OpenAI's order: created, in_progress, then per output
    item added / its text deltas / done (a reasoning item first when the model reasons), completed; a stream
    that fails on the way ends with error and response.failed instead (failed)."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, created_at: int,
                 logprob_items: Callable[[list], list] = lambda entries: [], streamed: bool = False,
                 params: SamplingParams | None = None):
        self.response_id, self.model, self.body, self.created_at = response_id, model, body, created_at
        self.params = params  # the job's sampling settings, which each Response object reports
        # streamed: every event is also kept until take(), so that a stream failing half way through a batch
        # still sends each event it numbered (a sequence_number skipped is a gap clients see)
        self.unsent: list[str] | None = [] if streamed else None
        self.logprob_items = logprob_items  # the engine's logprob entries as Responses' logprobs items
        self.pending_logprobs: list = []  # entries of tokens whose text has not gone out in a message delta
        self.sequence = 0
        self.items: list[dict] = []  # finished items, for the completed response
        self.open: dict | None = None  # the item being streamed: {"kind", "id", "text"}

    def error(self, envelope: dict) -> str:
        """An `error` event for errors.stream_error's envelope (its code a string, as the SDK's event has it)."""
        err = envelope["error"]
        code = err.get("code")
        return self.event("error", code=None if code is None else str(code), message=err["message"],
                          param=err.get("param"))

    def failed(self, envelope: dict) -> str:
        """The last events of a stream that failed after its headers went out: `error` (vLLM's), then
        response.failed (OpenAI's terminal event): status failed, its error, the items so far (the open one
        incomplete, with what it got)."""
        err = envelope["error"]
        output = self.items + ([self._open_item("incomplete")] if self.open is not None else [])
        error = {"code": _failure_code(err.get("type")), "message": err["message"], "param": err.get("param"),
                 "type": err.get("type")}
        body = response_body(self.response_id, self.model, self.body, output, "failed", created_at=self.created_at,
                             params=self.params, error=error)
        return self.error(envelope) + self.event("response.failed", response=body)

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        text = f"event: {kind}\n" + responses.sse(data)
        if self.unsent is not None:
            self.unsent.append(text)
        return text

    def take(self) -> str:
        """A streamed response's events since the last take (each once, in sequence order)."""
        out, self.unsent = "".join(self.unsent), []
        return out

    def opening(self) -> str:
        body = response_body(self.response_id, self.model, self.body, [], "in_progress", created_at=self.created_at,
                             params=self.params)
        return self.event("response.created", response=body) + self.event("response.in_progress", response=body)

    def text(self, reasoning: str, content: str, logprob_entries: list = ()) -> str:
        """Events for one batch: reasoning text, then content (which closes the reasoning item); the
        batch's log-probabilities go out with the next content delta."""
        self.pending_logprobs += logprob_entries
        return self._pieces("reasoning", reasoning) + self._pieces("message", content)

    def _pieces(self, kind: str, text: str) -> str:
        """Deltas of text; a MESSAGE_BREAK closes the item of this kind (a gpt-oss reply's next message)."""
        out = ""
        for i, piece in enumerate(text.split(MESSAGE_BREAK)):
            if i and self.open is not None and self.open["kind"] == kind:
                out += self._close()
            out += self._delta(kind, piece) if piece else ""
        return out

    def calls(self, entries: list[dict]) -> str:
        """Events for chat's tool_calls deltas (tools.ToolStream): an entry with an id starts a call."""
        out = ""
        for entry in entries:
            function = entry.get("function", {})
            if "id" in entry:  # (a message before it takes the entries of the text held back while it was written)
                out += self._close_taking_logprobs() + self._open_call(ToolCall(entry["id"], function["name"], ""))
            if function.get("arguments"):
                self.open["text"] += function["arguments"]
                out += self.event("response.function_call_arguments.delta", output_index=len(self.items),
                                  item_id=self.open["id"], delta=function["arguments"])
        return out

    def _open_call(self, call: ToolCall) -> str:
        item = function_call_item(call, "in_progress")
        self.open = {"kind": "function_call", "id": item["id"], "text": "", "call": call}
        return self.event("response.output_item.added", output_index=len(self.items), item=item)

    def _delta(self, kind: str, text: str) -> str:
        out = ""
        if self.open is None or self.open["kind"] != kind:
            out += self._close() + self._open(kind)
        self.open["text"] += text
        index, ids = len(self.items), {"item_id": self.open["id"], "content_index": 0}
        if kind == "reasoning":
            return out + self.event("response.reasoning_text.delta", output_index=index, delta=text, **ids)
        logprobs, self.pending_logprobs = self.logprob_items(self.pending_logprobs), []
        self.open["logprobs"] += logprobs
        return out + self.event("response.output_text.delta", output_index=index, delta=text, logprobs=logprobs, **ids)

    def _open(self, kind: str) -> str:
        self.open = {"kind": kind, "id": new_item_id("rs" if kind == "reasoning" else "msg"), "text": "", "logprobs": []}
        index, item_key = len(self.items), {"item_id": self.open["id"], "content_index": 0}
        if kind == "reasoning":  # its part opens and closes as the message's does (vLLM's, OpenAI's)
            return (self.event("response.output_item.added", output_index=index,
                               item=reasoning_item(self.open["id"], None, "in_progress"))
                    + self.event("response.content_part.added", output_index=index, part=reasoning_part(""), **item_key))
        return (self.event("response.output_item.added", output_index=index,
                           item=message_item(self.open["id"], None, "in_progress"))
                + self.event("response.content_part.added", output_index=index, part=text_part(""), **item_key))

    def _close_taking_logprobs(self, status: str = "completed") -> str:
        """_close, a message first taking the log-probabilities no content delta took (a reply that is all
        reasoning, text held back to the end or while a call was written), as the unstreamed message has every
        token's."""
        if self.open is not None and self.open["kind"] == "message":
            self.open["logprobs"] += self.logprob_items(self.pending_logprobs)
            self.pending_logprobs = []
        return self._close(status)

    def _close(self, status: str = "completed") -> str:
        if self.open is None:
            return ""
        kind, text, ident, item = self.open["kind"], self.open["text"], self.open["id"], self._open_item(status)
        index, ids = len(self.items), {"item_id": ident, "content_index": 0}
        if kind == "reasoning":
            out = (self.event("response.reasoning_text.done", output_index=index, text=text, **ids)
                   + self.event("response.content_part.done", output_index=index, part=reasoning_part(text), **ids))
        elif kind == "function_call":
            out = self.event("response.function_call_arguments.done", output_index=index, item_id=ident,
                             name=self.open["call"].name, arguments=text)  # (name: OpenAI's event has it)
        else:
            logprobs = self.open["logprobs"]
            out = (self.event("response.output_text.done", output_index=index, text=text, logprobs=logprobs, **ids)
                   + self.event("response.content_part.done", output_index=index, part=text_part(text, logprobs), **ids))
        self.items.append(item)
        self.open = None
        return out + self.event("response.output_item.done", output_index=index, item=item)

    def _open_item(self, status: str) -> dict:
        """The item being streamed, with its text so far."""
        kind, text, ident = self.open["kind"], self.open["text"], self.open["id"]
        if kind == "reasoning":
            return reasoning_item(ident, text, status)
        if kind == "function_call":
            return function_call_item(ToolCall(self.open["call"].id, self.open["call"].name, text), status)
        return message_item(ident, text, status, logprobs=self.open["logprobs"])

    def finish(self, finish_reason: str | None) -> str:
        """The open item closed (an empty message if no text came); the last incomplete when max_output_tokens
        ended the reply (OpenAI's)."""
        if ({i["type"] for i in self.items} | {(self.open or {}).get("kind")}) & {"message", "function_call"}:
            return self._close_taking_logprobs(_last_status(finish_reason))
        return self._close_taking_logprobs() + self._open("message") + self._close_taking_logprobs(_last_status(finish_reason))

    def closing(self, finish_reason: str | None, **extra) -> str:
        """The last events: finish's, then completed (incomplete when max_output_tokens ended it)."""
        out = self.finish(finish_reason)
        body = response_body(self.response_id, self.model, self.body, self.items, "completed", finish_reason,
                             created_at=self.created_at, params=self.params, **extra)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return out + self.event(kind, response=body)


@dataclass
class HarmonyReply:
    """A gpt-oss reply (the openai_gptoss reasoning parser) as a response's items: its messages in the reply's
    order, each its own item (vLLM's harmony path; chat joins them with "\n"), whole or streamed alike; the
    content through chat's tool stream. A named or required call's arguments are the content: joined there."""
    events: ResponseEvents
    tools: ToolStream
    splitter: HarmonySplitter

    @classmethod
    def of(cls, events: ResponseEvents, plan: ToolPlan) -> HarmonyReply:
        free = plan.kind in (ToolChoiceKind.AUTO, ToolChoiceKind.NONE)
        return cls(events, ToolStream(plan), HarmonySplitter(separator=MESSAGE_BREAK if free else "\n"))

    def feed(self, text: str, final: bool, logprob_entries: list = ()) -> str:
        """The events of the next piece of the reply."""
        out, shown = "", self.events.body.include_reasoning
        self.events.pending_logprobs += list(logprob_entries)  # (they go out with the next content delta)
        for route, piece in self.splitter.parts(text, final):
            if route is Route.REASONING:
                out += self.events.text(plain(piece) if shown else "", "")
            else:
                out += self._content(self.tools.step(piece, False))
        return out + (self._content(self.tools.step("", True)) if final else "")

    def _content(self, delta: dict) -> str:
        return self.events.text("", delta.get("content", "")) + self.events.calls(delta.get("tool_calls", []))
