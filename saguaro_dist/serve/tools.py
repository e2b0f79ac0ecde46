"""OpenAI tool calling on /v1/chat/completions, with vLLM's rules.

`tool_choice`:
  none      the tools are shown to the chat template; the reply is text.
  named     the reply is that function's arguments, constrained to its JSON schema.
  required  the reply is a JSON array of {"name", "parameters"} calls, constrained to the given functions.
  auto      the model decides; the server's tool-call parser reads its text (`hermes`: the
            <tool_call>{"name", "arguments"}</tool_call> blocks of Hermes and Qwen 2.5 / 3 chat
            templates). A server without a parser answers 400, as vLLM does.
named and required constrain through structured outputs, which every path (sd, ssd hit or miss, Ray)
samples exactly, so a tool call is the target's own distribution under the schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import Enum

from saguaro_dist.sampling_params import StructuredOutputsParams


class ToolChoiceKind(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


class ToolCallParser(Enum):
    HERMES = "hermes"


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)
ANY_OBJECT = {"type": "object"}  # a function declared without parameters


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments: str) -> "ToolCall":
        return cls(f"chatcmpl-tool-{uuid.uuid4().hex}", name, arguments)

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        return {"index": index, **self.message()}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the engine and how its text becomes tool calls."""
    kind: ToolChoiceKind
    functions: tuple[dict, ...] = ()  # OpenAI function definitions: name, description, parameters
    name: str | None = None           # the named function
    parallel: bool = True             # required: more than one call allowed

    def structure(self) -> StructuredOutputsParams | None:
        """The constraint named and required generate under (none for auto and none)."""
        if self.kind is ToolChoiceKind.NAMED:
            return StructuredOutputsParams(json=self._parameters(self.name))
        if self.kind is ToolChoiceKind.REQUIRED:
            return StructuredOutputsParams(json=self._calls_schema())
        return None

    def _parameters(self, name: str) -> dict:
        function = next(f for f in self.functions if f["name"] == name)
        return function.get("parameters") or ANY_OBJECT

    def _calls_schema(self) -> dict:
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                   "parameters": self._parameters(f["name"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return schema if self.parallel else {**schema, "maxItems": 1}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished reply. Text that does not parse stays content."""
        if self.kind is ToolChoiceKind.NAMED:
            return None, [ToolCall.new(self.name, text)]
        if self.kind is ToolChoiceKind.REQUIRED:
            return _parse_required(text)
        if self.kind is ToolChoiceKind.AUTO:
            return parse_hermes(text)
        return text, []

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced (named) call ends with "stop".
        called = calls and self.kind in (ToolChoiceKind.AUTO, ToolChoiceKind.REQUIRED)
        return "tool_calls" if called and reason == "stop" else reason


def _parse_required(text: str) -> tuple[str | None, list[ToolCall]]:
    try:
        calls = json.loads(text)
        return None, [ToolCall.new(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    except (ValueError, TypeError, KeyError):  # cut short by max_tokens: the text is all there is
        return text, []


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes-format tool calls: the text before the first <tool_call> is content."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    try:
        blocks = [json.loads(m.group(1)) for m in _HERMES_BLOCK.finditer(text, start)]
        calls = [ToolCall.new(b["name"], json.dumps(b.get("arguments", {}), ensure_ascii=False)) for b in blocks]
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    return text[:start] or None, calls


class ToolStream:
    """One streamed choice's deltas under a ToolPlan: `feed` each text piece, `finish` at the end; each
    returns the chat delta to send ({} for nothing yet).

    named: the text is the arguments, streamed as they come (the first delta names the call). required
    and auto's calls are sent whole when the reply ends (a half-written call has no name to send);
    auto's content streams until a <tool_call> starts, holding back text that could begin one."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""   # text not sent yet
        self.sent = 0    # characters of content sent (auto)
        self.named_call: ToolCall | None = None
        self.calls: list[ToolCall] = []

    def step(self, text: str, final: bool) -> dict:
        """The delta for `text`, and on the last step whatever the end of the reply releases."""
        delta = self.feed(text)
        if not final:
            return delta
        tail = self.finish()
        content = delta.get("content", "") + tail.get("content", "")
        return {**delta, **tail, **({"content": content} if content else {})}

    def feed(self, text: str) -> dict:
        kind = self.plan.kind
        if kind is ToolChoiceKind.NONE:
            return {"content": text} if text else {}
        if kind is ToolChoiceKind.NAMED:
            return self._named(text)
        self.held += text
        return self._auto_content() if kind is ToolChoiceKind.AUTO else {}

    def finish(self) -> dict:
        if self.plan.kind in (ToolChoiceKind.NONE, ToolChoiceKind.NAMED):
            return {}
        content, self.calls = self.plan.parse(self.held)
        delta = {"content": content} if content and not self.calls else {}
        if self.calls:
            delta["tool_calls"] = [call.delta(i) for i, call in enumerate(self.calls)]
        return delta

    def _named(self, text: str) -> dict:
        if not text:
            return {}
        if self.named_call is None:
            self.named_call = ToolCall.new(self.plan.name, "")
            self.calls = [self.named_call]
            return {"tool_calls": [{**self.named_call.delta(0), "function": {"name": self.plan.name, "arguments": text}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def _auto_content(self) -> dict:
        """Content up to where a <tool_call> starts or might start; after one, nothing until the end."""
        if self.sent < 0:
            return {}
        start = self.held.find(HERMES_OPEN)
        if start >= 0:
            out, self.held, self.sent = self.held[:start], self.held[start:], -1
        else:
            keep = partial_suffix(self.held, HERMES_OPEN)
            out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            self.sent += len(out)
        return {"content": out} if out else {}


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
