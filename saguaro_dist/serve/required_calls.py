"""tool_choice "required", read as it is written: the reply is a JSON array of {"name", "parameters"} objects
generated under a grammar (serve/tools.py), so one pass over its characters finds each call's name and the
span of its parameters while the reply grows. A call opens once its name and the start of its parameters
are known, and its arguments stream as they grow, as a named call's do (vLLM streams required calls so).
Arguments are the model's own text, streamed or not, so the two agree character for character."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from saguaro_dist.serve.tool_parsers import ToolCall, new_call_id

_IN_CALL = 2  # depth inside one call object: [ is depth 1, its {"name": ..., "parameters": ...} depth 2


@dataclass
class _Call:
    """One call object of the array, as far as it is written."""
    key: str | None = None           # the key whose value is being read
    expect_value: bool = False       # after the key's ':'
    value_started: bool = False
    name: str | None = None
    args_start: int | None = None    # where the parameters' text starts in the reply
    args_end: int | None = None      # where it ends (None: still being written)
    id: str = field(default_factory=new_call_id)
    sent: int = -1                   # characters of arguments sent (-1: the call is not opened yet)


@dataclass
class RequiredCalls:
    """Feed the reply's text piece by piece; each feed returns chat's tool_calls deltas for what is new."""
    text: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    string_start: int = 0
    found: list[_Call] = field(default_factory=list)

    def feed(self, piece: str) -> list[dict]:
        start, self.text = len(self.text), self.text + piece
        for i in range(start, len(self.text)):
            self._scan(i, self.text[i])
        return self._deltas()

    @property
    def calls(self) -> list[ToolCall]:
        """The calls opened so far, with their arguments as written so far."""
        return [ToolCall(c.id, c.name, self._arguments(c)) for c in self.found if c.sent >= 0]

    def complete(self) -> bool:
        """Whether the reply is a whole array (not one cut short by max_tokens)."""
        try:
            return isinstance(json.loads(self.text), list)
        except ValueError:
            return False

    def _arguments(self, call: _Call) -> str:
        return self.text[call.args_start:len(self.text) if call.args_end is None else call.args_end]

    def _deltas(self) -> list[dict]:
        """In order: a call whose name and arguments' start are known opens (its id and name), then its
        arguments as they grow; a call that cannot open yet holds back the ones after it."""
        out = []
        for index, call in enumerate(self.found):
            if call.name is None or call.args_start is None:
                break
            new = self._arguments(call)[max(call.sent, 0):]
            if call.sent < 0:
                out.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": new}})
            elif new:
                out.append({"index": index, "function": {"arguments": new}})
            call.sent = max(call.sent, 0) + len(new)
        return out

    def _scan(self, i: int, c: str) -> None:
        if self.in_string:
            self._in_string(i, c)
        elif c == '"':
            self._value_starts(i)
            self.in_string, self.string_start = True, i
        elif c in "{[":
            self._value_starts(i)
            self.depth += 1
            if self.depth == _IN_CALL:
                self.found.append(_Call())
        elif c in "}]":
            if self.depth == _IN_CALL:
                self._value_ends(i)
            self.depth -= 1
        elif self.depth == _IN_CALL:
            self._punctuation(i, c)

    def _in_string(self, i: int, c: str) -> None:
        if self.escaped:
            self.escaped = False
        elif c == "\\":
            self.escaped = True
        elif c == '"':
            self.in_string = False
            if self.depth == _IN_CALL:
                self._string_ends(json.loads(self.text[self.string_start:i + 1]))

    def _punctuation(self, i: int, c: str) -> None:
        call = self.found[-1]
        if c == ":":
            call.expect_value, call.value_started = True, False
        elif c == ",":
            self._value_ends(i)
        elif not c.isspace():
            self._value_starts(i)  # a number, true, false or null

    def _value_starts(self, i: int) -> None:
        if self.depth != _IN_CALL or not self.found:
            return
        call = self.found[-1]
        if call.expect_value and not call.value_started:
            call.value_started = True
            if call.key == "parameters":
                call.args_start = i

    def _value_ends(self, i: int) -> None:
        call = self.found[-1]
        if call.key == "parameters" and call.args_start is not None and call.args_end is None:
            call.args_end = len(self.text[:i].rstrip())
        call.key, call.expect_value = None, False

    def _string_ends(self, literal: str) -> None:
        call = self.found[-1]
        if not call.expect_value:
            call.key = literal
        elif call.key == "name" and call.name is None:
            call.name = literal
