"""Tool-call parsers for tool_choice "auto" (vLLM's names): how a model family writes calls in its reply.

  hermes       <tool_call>{"name", "arguments"}</tool_call> blocks, anywhere after some content
               (Hermes, Qwen 2.5 / 3 chat templates).
  llama3_json  the whole reply is {"name", "parameters"} objects, "; " between them, optionally after
               <|python_tag|> (Llama 3.1 - 3.3's JSON tool calling).
  mistral      [TOOL_CALLS] then a JSON list of {"name", "arguments"} (tokenizers before v11: Mistral 7B v0.3,
               Mixtral, Nemo), or [TOOL_CALLS]name{arguments} per call, [ARGS] maybe before the arguments (v11
               and later: Mistral Small 3.2, Magistral, Devstral). [TOOL_CALLS] is a special token there, so
               replies keep special tokens in their text, and call ids are 9 letters or digits, as Mistral's
               chat templates insist.
  qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call> (Qwen3-Coder),
               values typed by the request's tool schemas; tool_parsers_extra.py.
  pythonic     the reply is [name(key=literal, ...), ...] (Llama 3.2, Llama 4); tool_parsers_extra.py.
  openai       gpt-oss's harmony messages `commentary to=functions.NAME`; harmony.py (special tokens kept).

A reply that does not parse stays content: the model's text is never lost.
"""
from __future__ import annotations

import json
import random
import string
import uuid
from dataclasses import dataclass
from enum import Enum

from saguaro_dist.serve.harmony import HarmonyCallSyntax, parse_openai
from saguaro_dist.serve.tool_parsers_extra import QWEN_CALL_OPEN, QWEN_FUNCTION, parse_pythonic, parse_qwen3_coder

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A tool call's id, as vLLM writes them (mistral's parser makes its own 9-character ids)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments, id: str | None = None) -> "ToolCall":
        """arguments: JSON text, or a mapping to write as JSON. A name that is not a non-empty string is a
        TypeError, which each parser reads as "no call" (the reply stays content), whole and streamed alike."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a tool call's name must be a non-empty string, not {name!r}")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(id or new_call_id(), name, text)

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        return {"index": index, **self.message()}


Parsed = tuple[str | None, list[ToolCall]]  # (content, calls) of a finished reply


def parse_hermes(text: str) -> Parsed:
    """Hermes-format tool calls: the text before the first <tool_call> is content; the last block may lack
    its close tag (EOS came first)."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    try:
        calls = [ToolCall.new(b["name"], b.get("arguments", {})) for b in _hermes_blocks(text, start)]
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    return text[:start] or None, calls


def _hermes_blocks(text: str, i: int) -> list:
    """The JSON of each <tool_call> block from `i` on. Read as JSON, not up to the first close tag: a call
    whose arguments hold the text "</tool_call>" (code about tool calls) made the whole reply content, as a
    regex up to the tag cut its JSON there. Text between blocks is dropped; the last may lack its close tag
    (EOS came first)."""
    decoder, blocks = json.JSONDecoder(), []
    while (i := text.find(HERMES_OPEN, i)) >= 0:
        block, i = decoder.raw_decode(text, _skip(text, i + len(HERMES_OPEN), " \t\r\n"))
        i = _skip(text, i, " \t\r\n")
        if text.startswith(HERMES_CLOSE, i):
            i += len(HERMES_CLOSE)
        elif i < len(text):
            raise ValueError("a tool call's JSON must be followed by </tool_call>")
        blocks.append(block)
    return blocks


def parse_llama3_json(text: str) -> Parsed:
    """Llama 3's JSON calls: the reply (after an optional <|python_tag|>) is one or more {"name", "parameters"}
    objects separated by ";"; anything else in it makes the whole reply content."""
    body = text.strip()
    body = body[len(LLAMA_PYTHON_TAG):] if body.startswith(LLAMA_PYTHON_TAG) else body
    try:
        objects = _json_objects(body, separator=";")
        calls = [ToolCall.new(o["name"], o.get("parameters", o.get("arguments", {}))) for o in objects]
    except (ValueError, TypeError, KeyError):
        return text, []
    return (None, calls) if calls else (text, [])


def parse_mistral(text: str) -> Parsed:
    """Mistral's calls after the content, in either of vLLM's two forms: tokenizers before v11 write
    [TOOL_CALLS] then a JSON list (or one object) of {"name", "arguments"}; v11 and later write each call as
    [TOOL_CALLS]name{arguments} ([TOOL_CALLS]name[ARGS]{arguments} decoded by a Hugging Face tokenizer)."""
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return text, []
    body = text[start + len(MISTRAL_CALLS):].lstrip()
    try:  # a name never starts with "[" or "{": the form tells itself
        calls = _mistral_json_calls(body) if body.startswith(("[", "{")) else \
            [_mistral_v11_call(raw) for raw in text[start:].split(MISTRAL_CALLS)[1:]]
    except (ValueError, TypeError, KeyError):
        return text, []
    return (text[:start] or None, calls) if calls else (text, [])


def _mistral_json_calls(body: str) -> list[ToolCall]:
    """Pre-v11: the first JSON value is the calls; text after it is left out, as vLLM leaves it."""
    given = json.JSONDecoder().raw_decode(body)[0]
    given = [given] if isinstance(given, dict) else given
    return [ToolCall.new(c["name"], c.get("arguments", {}), id=mistral_call_id()) for c in given]


def _mistral_v11_call(raw: str) -> ToolCall:
    """v11+: one call's `name{...}` or `name[ARGS]{...}`, its arguments as the model wrote them. Text after the
    arguments' JSON makes the reply content (vLLM sends it as part of the arguments, which are then not JSON)."""
    brace = raw.find("{")
    name = raw[:brace].replace(MISTRAL_ARGS, "").strip() if brace >= 0 else ""
    if not name:
        raise ValueError("a v11 Mistral tool call is a name, then its arguments' JSON object")
    end = json.JSONDecoder().raw_decode(raw, brace)[1]
    if raw[end:].strip():
        raise ValueError("text after a Mistral tool call's arguments")
    return ToolCall.new(name, raw[brace:end], id=mistral_call_id())


def mistral_call_id() -> str:
    return "".join(random.choices(_MISTRAL_ID_CHARS, k=9))


def _json_objects(text: str, separator: str) -> list[dict]:
    """The JSON objects `text` is made of, in order, whitespace and `separator` between them (ValueError
    for anything else, or an object that is not a mapping)."""
    decoder, objects, i = json.JSONDecoder(), [], 0
    while True:
        i = _skip(text, i, " \t\r\n" + separator)
        if i == len(text):
            return objects
        obj, i = decoder.raw_decode(text, i)
        if not isinstance(obj, dict):
            raise ValueError("a tool call must be a JSON object")
        objects.append(obj)


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


@dataclass(frozen=True)
class CallSyntax:
    """Where a family's calls begin in a reply, for streaming content before them: `markers` open the
    calls; with `leading_only` they count only at the reply's start (after whitespace)."""
    markers: tuple[str, ...]
    leading_only: bool = False

    def start(self, text: str, at_reply_start: bool) -> int:
        """Where the calls begin in `text` (the unsent rest of the reply), or -1 for not (yet). Calls that
        must open the reply take its leading whitespace with them: such a reply has no content."""
        if self.leading_only:
            rest = text.lstrip()
            return 0 if at_reply_start and any(rest.startswith(m) for m in self.markers) else -1
        hits = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(hits) if hits else -1

    def undecided(self, text: str, at_reply_start: bool) -> int:
        """How many characters at the end of `text` could still begin the calls (held back from content)."""
        if self.leading_only:
            rest = text.lstrip()
            return len(text) if at_reply_start and any(m.startswith(rest) for m in self.markers) else 0
        return max(partial_suffix(text, m) for m in self.markers)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser(Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    QWEN3_CODER = "qwen3_coder"
    PYTHONIC = "pythonic"
    OPENAI = "openai"  # gpt-oss's harmony calls (harmony.py)

    def parse(self, text: str, functions: tuple[dict, ...] = ()) -> Parsed:
        """functions: the request's tools (qwen3_coder types its arguments by their schemas)."""
        if self in _PARSE_WITH_TOOLS:
            content, calls = _PARSE_WITH_TOOLS[self](text, functions)
            try:
                return content, [ToolCall.new(name, arguments) for name, arguments in calls]
            except TypeError:  # a call without a name: the reply is content
                return text, []
        return _PARSE[self](text)

    @property
    def syntax(self) -> CallSyntax:
        return _SYNTAX[self]

    @property
    def keeps_special_tokens(self) -> bool:
        """Its call marker is a special token in its family's tokenizers: replies must keep them as text."""
        return self in (ToolCallParser.MISTRAL, ToolCallParser.OPENAI)


_PARSE = {ToolCallParser.HERMES: parse_hermes, ToolCallParser.LLAMA3_JSON: parse_llama3_json,
          ToolCallParser.MISTRAL: parse_mistral}
_SYNTAX = {ToolCallParser.HERMES: CallSyntax((HERMES_OPEN,)),
           ToolCallParser.LLAMA3_JSON: CallSyntax((LLAMA_PYTHON_TAG, "{"), leading_only=True),
           ToolCallParser.MISTRAL: CallSyntax((MISTRAL_CALLS,)),
           ToolCallParser.QWEN3_CODER: CallSyntax((QWEN_CALL_OPEN, QWEN_FUNCTION)),
           ToolCallParser.PYTHONIC: CallSyntax(("[",), leading_only=True),
           ToolCallParser.OPENAI: HarmonyCallSyntax()}
_PARSE_WITH_TOOLS = {ToolCallParser.QWEN3_CODER: parse_qwen3_coder, ToolCallParser.PYTHONIC: parse_pythonic,
                     ToolCallParser.OPENAI: parse_openai}
