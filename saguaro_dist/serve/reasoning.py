"""Reasoning outputs on /v1/chat/completions (vLLM's `--reasoning-parser`): a thinking model's
<think> ... </think> text comes back as the message's `reasoning`, the rest as its `content`.

  qwen3        reasoning only when the reply closes it with </think> (a leading <think> is dropped);
               without one the whole reply is content (thinking switched off: enable_thinking=False)
  deepseek_r1  the chat template opens <think> in the prompt: everything before </think> is reasoning,
               and a reply cut before it is all reasoning

A constrained reply (structured outputs, a named or required tool call) lets the model reason first, as
vLLM applies structured outputs once reasoning ends: `reasoning_first` makes one grammar of "any text up to
the first </think>, whitespace, then what the request allows", so every speculation path samples it
exactly. Not when the prompt already closed the reasoning (Qwen3 with enable_thinking off), nor for a
request's own Lark grammar (it is not nested): such replies are constrained whole and not split.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from saguaro_dist.engine.structured import JSON_DEFAULTS
from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.serve.tool_parsers import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParser(Enum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"

    @property
    def open_by_default(self) -> bool:
        """Whether text before any </think> is reasoning (the template opened <think> in the prompt)."""
        return self is ReasoningParser.DEEPSEEK_R1


def split_reasoning(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished reply."""
    if parser is None:
        return None, text
    end = text.find(THINK_CLOSE)
    if end < 0:  # deepseek_r1 cut before </think>: all reasoning, less a leading <think> (as the stream drops it)
        return (text.removeprefix(THINK_OPEN) or None, "") if parser.open_by_default else (None, text)
    reasoning = text[:end].removeprefix(THINK_OPEN)
    return reasoning or None, text[end + len(THINK_CLOSE):]


# Lark for llguidance: the lazy rule ends at the first </think>; the answer follows, after optional whitespace.
_REASONING_THEN = ('start: reasoning answer | reasoning WS answer\n'
                   'reasoning[lazy]: /(.|\\n)*<\\/think>/\n'
                   'WS: /[ \\t\\r\\n]+/\n')


def reasoning_first(spec: StructuredOutputsParams, prompt_text: str) -> StructuredOutputsParams | None:
    """spec with the model's reasoning allowed before it (see the module's note); None when the prompt
    already closed the reasoning or spec is a Lark grammar of the request's own."""
    if spec.grammar is not None or _reasoning_closed(prompt_text):
        return None
    return StructuredOutputsParams(grammar=_REASONING_THEN + "answer: " + _answer(spec))


def _reasoning_closed(prompt_text: str) -> bool:
    """The prompt ends with a closed think block: its template switched reasoning off (Qwen3's empty block
    with enable_thinking off). An earlier turn's block, followed by more of the conversation, does not count."""
    return prompt_text.rstrip().endswith(THINK_CLOSE)


def _answer(spec: StructuredOutputsParams) -> str:
    """spec's language as a Lark rule body: JSON through %json (our JSON defaults unless the schema's
    x-guidance says otherwise, as grammar_of applies them), a regex, or a choice of literals."""
    import llguidance

    if spec.json is not None or spec.json_object:
        schema = json.loads(spec.json) if spec.json is not None else {"type": "object"}
        schema = {**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}}
        return "%json " + json.dumps(schema)
    if spec.regex is not None:
        return "/" + llguidance.regex_to_lark(spec.regex) + "/"
    return " | ".join(json.dumps(c) for c in spec.choice)


@dataclass
class ReasoningStream:
    """Splits a streamed reply: `feed` each text piece, get (reasoning, content) pieces back. Text that
    might begin </think> is held back until it cannot; for qwen3 the reasoning is held until </think>
    shows it was reasoning (a reply without one is content, which then goes out at the end)."""
    parser: ReasoningParser | None
    held: str = ""
    thinking: bool = True  # before </think>
    opened: bool = False   # a leading <think> was looked for (and dropped)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        if self.parser is None or not self.thinking:
            return "", text
        self.held += text
        end = self.held.find(THINK_CLOSE)
        if end >= 0:
            self.thinking = False
            reasoning, rest = self.held[:end].removeprefix(THINK_OPEN), self.held[end + len(THINK_CLOSE):]
            self.held = ""
            return reasoning, rest
        if final:
            reasoning, content = split_reasoning(self.parser, self.held)
            self.held = ""
            return reasoning or "", content
        if not self.parser.open_by_default:
            return "", ""  # qwen3: reasoning or content? only </think> (or the end) tells
        if not self.opened:
            if THINK_OPEN.startswith(self.held):
                return "", ""  # may still become a leading <think>
            self.held, self.opened = self.held.removeprefix(THINK_OPEN), True
        keep = partial_suffix(self.held, THINK_CLOSE)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, ""
