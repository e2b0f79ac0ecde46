"""OpenAI tool calling on /v1/chat/completions, with vLLM's rules.

`tool_choice`:
  none      the tools are shown to the chat template; the reply is text (a gpt-oss server's less its calls).
  named     the reply is that function's arguments, constrained to its JSON schema.
  required  the reply is a JSON array of {"name", "parameters"} calls, constrained to the given functions.
  auto      the model decides; the server's tool-call parser reads its text (serve/tool_parsers.py:
            hermes, llama3_json, mistral; tool_parsers_extra.py: qwen3_coder, pythonic, which also reads
            the tools' schemas). A server without a parser answers 400, as vLLM does.
  allowed_tools (OpenAI's {"type": "allowed_tools", ...}): auto or required, callable only the listed subset;
            every tool still reaches the prompt (OpenAI's rule, so a changing subset keeps the prompt's cache).
            required's grammar names the subset only; auto's text cannot be held to it, so a reply calling
            outside it is read as under none (vLLM has no allowed_tools on chat).
named and required constrain through structured outputs, which every path (sd, ssd hit or miss, Ray)
samples exactly, so a tool call is the target's own distribution under the schema.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from saguaro_dist.sampling_params import SamplingParams, StructuredOutputsParams
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.harmony import HarmonySplitter, parse_openai, plain, plain_delta
from saguaro_dist.serve.required_calls import RequiredCalls
from saguaro_dist.serve.tool_parsers import ToolCall, ToolCallParser

ANY_OBJECT = {"type": "object"}  # a function declared without parameters


class ToolChoiceKind(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the engine and how its text becomes tool calls."""
    kind: ToolChoiceKind
    functions: tuple[dict, ...] = ()  # OpenAI function definitions: name, description, parameters
    name: str | None = None           # the named function
    parallel: bool = True             # required and auto: more than one call allowed
    parser: ToolCallParser | None = None  # auto: how the server reads calls in the reply
    harmony: bool = False  # a gpt-oss server (either harmony parser): a reply's calls are never its content
    allowed: tuple[str, ...] | None = None  # allowed_tools: the names that may be called (None: every function)

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
        """The calls array's schema. Each function's parameters sit under the root's $defs (its own key) as a
        schema resource of its own ($id: the tool's, else a urn) referenced by that id, so its "#..." references
        ("#", "#/properties/a", "#/$defs/X", "#anchor") resolve against the parameters, as a named choice reads them."""
        calls, defs = [], {}
        for i, f in enumerate(self.callable_functions()):
            key = f"tool_{i}"
            defs[key] = _own_resource(self._parameters(f["name"]), f"urn:saguaro:tool:{i}", defs)
            calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                           "parameters": {"$ref": defs[key]["$id"]}},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
        return schema if self.parallel else {**schema, "maxItems": 1}

    def clash_error(self, err: ValueError) -> APIError | None:
        """The engine's refusal of this plan's constraint beside a setting it cannot be combined with (ignore_eos,
        min_tokens, ...: it says "structured_outputs ..."), naming tool_choice as chat and responses do. None for
        any other error, parameters that do not compile included (the route names tools)."""
        rest = str(err).removeprefix("structured_outputs ")
        if rest == str(err) or rest.startswith("is not valid") or self.structure() is None:
            return None
        choice = self.name if self.kind is ToolChoiceKind.NAMED else \
            "required" if self.allowed is None else "allowed_tools (required)"
        return APIError(400, f"tool_choice {choice!r} {rest}", param="tool_choice")

    def callable_functions(self) -> tuple[dict, ...]:
        """The functions a call may name: allowed_tools' subset, else all of them."""
        return tuple(f for f in self.functions if self.allowed is None or f["name"] in self.allowed)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished reply. Text that does not parse stays content."""
        harmony_read = self.kind is ToolChoiceKind.AUTO and self.parser is ToolCallParser.OPENAI or \
            self.harmony and self.kind is ToolChoiceKind.NONE
        raw, text = text, text if harmony_read else plain(text)  # (parse_openai tells literal marker text itself)
        if self.kind is ToolChoiceKind.NAMED:  # stripped: after reasoning, whitespace may lead the arguments
            return (None, [ToolCall.new(self.name, text.strip())]) if text.strip() else (None, [])
        if self.kind is ToolChoiceKind.REQUIRED:
            return _parse_required(text)
        if self.kind is ToolChoiceKind.AUTO and self.parser is not None:
            content, calls = self.parser.parse(text, self.functions)  # functions: qwen3_coder types by them
            calls = calls if self.parallel else calls[:1]  # parallel_tool_calls false: the first call (vLLM's)
            if self.allowed is not None and any(c.name not in self.allowed for c in calls):
                return replace(self, kind=ToolChoiceKind.NONE).parse(raw)  # a call outside allowed_tools: text
            return content, calls
        if self.harmony and self.kind is ToolChoiceKind.NONE:  # calls no parser reads are left out (vLLM's)
            return parse_openai(text)[0] or "", []
        return text, []

    def adjust(self, params: SamplingParams) -> SamplingParams:
        """A parser whose call marker is a special token needs special tokens kept in the text."""
        if self.kind is ToolChoiceKind.AUTO and self.parser is not None and self.parser.keeps_special_tokens:
            return replace(params, skip_special_tokens=False)
        return params

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced (named) call ends with "stop".
        called = calls and self.kind in (ToolChoiceKind.AUTO, ToolChoiceKind.REQUIRED)
        return "tool_calls" if called and reason == "stop" else reason


def _own_resource(parameters: dict, urn: str, taken: dict) -> dict:
    """`parameters` with an $id its references resolve against: its own when that is an absolute URI no earlier
    tool holds (refs may name it in full), else `urn` (a relative or "#name" $id would resolve against the array)."""
    own = parameters.get("$id")
    usable = isinstance(own, str) and ":" in own.split("#")[0] and not own.startswith("urn:saguaro:") and \
        all(d["$id"] != own for d in taken.values())
    return {**parameters, "$id": own if usable else urn}


def _parse_required(text: str) -> tuple[str | None, list[ToolCall]]:
    """What a stream of the same reply sends in all (ToolStream): the calls opened, with their arguments as the
    model wrote them (a reply cut by max_tokens: as far as it got, the raw JSON was the content before); the text
    only when it was cut before any call opened. (vLLM reads the whole reply as JSON, so a cut one fails there.)"""
    reader = RequiredCalls()
    reader.feed(text)
    if reader.calls:
        return None, reader.calls
    return (None if reader.complete() else text), []


class ToolStream:
    """One streamed choice's deltas under a ToolPlan: `feed` each text piece, `finish` at the end; each
    returns the chat delta to send ({} for nothing yet).

    named: the text is the arguments, streamed as they come (the first delta names the call). required:
    each call opens once its name is written and its arguments stream as they grow (required_calls.py).
    auto's calls are sent whole when the reply ends (a half-written call has no name to send); its
    content streams until the parser's calls start, holding back text that could begin them."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""   # text not sent yet
        self.sent = 0    # characters of content sent (auto)
        self.named_call: ToolCall | None = None
        self.required = RequiredCalls() if plan.kind is ToolChoiceKind.REQUIRED else None
        self.calls: list[ToolCall] = []
        # tool_choice none on a gpt-oss server: the content less any harmony call (and raw analysis)
        self.harmony = HarmonySplitter(keep_calls=False) if plan.harmony and plan.kind is ToolChoiceKind.NONE else None

    def step(self, text: str, final: bool) -> dict:
        """The delta for `text`, and on the last step whatever the end of the reply releases."""
        delta = self.feed(text)
        if not final:
            return plain_delta(delta)
        tail = self.finish()
        content = delta.get("content", "") + tail.get("content", "")
        return plain_delta({**delta, **tail, **({"content": content} if content else {})})

    def feed(self, text: str) -> dict:
        kind = self.plan.kind
        if kind is ToolChoiceKind.NONE:
            return self._text(text, final=False)
        if kind is ToolChoiceKind.NAMED:
            return self._named(text)
        if kind is ToolChoiceKind.REQUIRED:
            deltas = self.required.feed(text)
            self.calls = self.required.calls
            return {"tool_calls": deltas} if deltas else {}
        self.held += text
        return self._auto_content() if kind is ToolChoiceKind.AUTO else {}

    def finish(self) -> dict:
        if self.plan.kind is ToolChoiceKind.NONE:
            return self._text("", final=True)
        if self.plan.kind is ToolChoiceKind.NAMED:
            return {}
        if self.plan.kind is ToolChoiceKind.REQUIRED:  # cut before any call opened: the text, as unstreamed
            text = self.required.text
            return {"content": text} if text and not self.calls and not self.required.complete() else {}
        content, self.calls = self.plan.parse(self.held)
        delta = {"content": content} if content else {}  # with calls: text read before them (harmony's preamble)
        if self.calls:
            delta["tool_calls"] = [call.delta(i) for i, call in enumerate(self.calls)]
        return delta

    def _text(self, text: str, final: bool) -> dict:
        if self.harmony is not None:
            text = self.harmony.feed(text, final)[1]
        return {"content": text} if text else {}

    def _named(self, text: str) -> dict:
        if self.named_call is not None:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        text = text.lstrip()  # whitespace after reasoning is not part of the arguments
        if not text:
            return {}
        self.named_call = ToolCall.new(self.plan.name, "")
        self.calls = [self.named_call]
        return {"tool_calls": [{**self.named_call.delta(0), "function": {"name": self.plan.name, "arguments": text}}]}

    def _auto_content(self) -> dict:
        """Content up to where the calls start or might start; after they start, nothing until the end."""
        if self.sent < 0 or self.plan.parser is None:
            return {}
        syntax, at_start = self.plan.parser.syntax, self.sent == 0
        start = syntax.start(self.held, at_start)
        if start >= 0:
            out, self.held, self.sent = self.held[:start], self.held[start:], -1
        else:
            keep = syntax.undecided(self.held, at_start)
            out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            self.sent += len(out)
        return {"content": out} if out else {}
