"""Reasoning outputs on /v1/chat/completions (vLLM's `--reasoning-parser`): a thinking model's
<think> ... </think> text comes back as the message's `reasoning`, the rest as its `content`.

  qwen3        reasoning only when the reply closes it with </think> (a leading <think> is dropped);
               without one the whole reply is content (thinking switched off: enable_thinking=False)
  deepseek_r1  the chat template opens <think> in the prompt: everything before </think> is reasoning,
               and a reply cut before it is all reasoning
  openai_gptoss  gpt-oss's harmony channels (harmony.py): analysis is reasoning, final (and commentary) the
               content; its markers are special tokens, kept in the text. A constrained reply may write an
               analysis message first, then its constraint as the final channel's body (harmony_first)

A constrained reply (structured outputs, a named or required tool call) lets the model reason first, as
vLLM applies structured outputs once reasoning ends: `reasoning_first` makes one grammar of "any text up to
the first </think>, whitespace, then what the request allows", so every speculation path samples it
exactly. Not when the prompt already closed the reasoning (Qwen3 with enable_thinking off; harmony: the
prompt leaves a message open), nor for a request's own grammar (it is not nested): such replies are
constrained whole and not split (gpt-oss's: read as harmony, as they come).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from saguaro_dist.engine.structured import checked_grammar_of, json_schema_of
from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.serve.harmony import MARKERS, HarmonySplitter, message_open, reasoning_token_count, split_harmony
from saguaro_dist.serve.tool_parsers import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParser(Enum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"
    OPENAI_GPTOSS = "openai_gptoss"

    @property
    def harmony(self) -> bool:
        """gpt-oss's harmony format (harmony.py) rather than <think> tags."""
        return self is ReasoningParser.OPENAI_GPTOSS

    @property
    def keeps_special_tokens(self) -> bool:
        """Its markers are special tokens in its family's tokenizers: replies must keep them as text."""
        return self.harmony

    @property
    def open_by_default(self) -> bool:
        """Whether text before any </think> is reasoning (the template opened <think> in the prompt)."""
        return self is ReasoningParser.DEEPSEEK_R1


def split_reasoning(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished reply."""
    if parser is None:
        return None, text
    if parser.harmony:
        return split_harmony(text)
    end = text.find(THINK_CLOSE)
    if end < 0:  # deepseek_r1 cut before </think>: all reasoning, less a leading <think> (as the stream drops it)
        return (text.removeprefix(THINK_OPEN) or None, "") if parser.open_by_default else (None, text)
    reasoning = text[:end].removeprefix(THINK_OPEN)
    return reasoning or None, text[end + len(THINK_CLOSE):]


@dataclass(frozen=True)
class ReasoningTokens:
    """Counts how many of a reply's generated tokens are its reasoning (usage's reasoning_tokens), split as
    split_reasoning splits its text: the tokens before </think>, less a leading <think>'s. From the token
    ids, as vLLM counts: a thinking model's tags are single tokens (Qwen3's, DeepSeek-R1's), found by id.
    A tokenizer that spells a tag in several tokens may generate it in other pieces than its own encoding:
    then the tag is found in the decoded ids instead."""
    tokenizer: object
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> ReasoningTokens:
        return cls(tokenizer, *(tuple(tokenizer.encode(tag, add_special_tokens=False)) for tag in (THINK_OPEN, THINK_CLOSE)))

    def count(self, parser: ReasoningParser | None, token_ids: Sequence[int]) -> int:
        if parser is None or not token_ids:
            return 0
        if parser.harmony:
            return reasoning_token_count(self.tokenizer, token_ids)
        ids = list(token_ids)
        start, end = self._open_length(ids), _find(ids, self.close_ids)
        if end < 0 and len(self.close_ids) > 1:
            end = self._by_text(ids, THINK_CLOSE)
        if end < 0:  # no </think>: qwen3's reply is all content, deepseek_r1's all reasoning
            return len(ids) - start if parser.open_by_default else 0
        return max(0, end - start)

    def _open_length(self, ids: list[int]) -> int:
        """Tokens of a leading <think> (split_reasoning drops it from the reasoning)."""
        if ids[:len(self.open_ids)] == list(self.open_ids):
            return len(self.open_ids)
        if len(self.open_ids) > 1 and self._by_text(ids, THINK_OPEN) == 0:
            return self._tokens_within(ids, len(THINK_OPEN))
        return 0

    def _by_text(self, ids: list[int], tag: str) -> int:
        """How many tokens come before `tag` in the ids' text (-1: it is not there)."""
        at = self._decode(ids).find(tag)
        return at if at < 0 else self._tokens_within(ids, at)

    def _tokens_within(self, ids: list[int], chars: int) -> int:
        """The most leading tokens whose text fits in `chars` characters (a binary search: a longer prefix of
        the ids never decodes to less text), so a tag's tokens are never counted as reasoning."""
        low, high = 0, len(ids)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if len(self._decode(ids[:mid])) <= chars else (low, mid - 1)
        return low

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _find(ids: list[int], part: tuple[int, ...]) -> int:
    """Where `part` first occurs in ids as a run, or -1."""
    width = len(part)
    return next((i for i in range(len(ids) - width + 1) if width and tuple(ids[i:i + width]) == part), -1)


# Lark for llguidance: the lazy rule ends at the first </think>; the answer follows, after optional whitespace.
_REASONING_THEN = ('start: reasoning answer | reasoning WS answer\n'
                   'reasoning[lazy]: /(.|\\n)*<\\/think>/\n'
                   'WS: /[ \\t\\r\\n]+/\n')


# gpt-oss (vLLM's harmony structured outputs): an optional analysis message, then the final channel, whose
# body is what the request allows, ended by <|end|> or EOS (<|return|> is one). Markers are special tokens
# (bare `<|channel|>` in Lark); the analysis body holds no marker's text either, so the splitter, which reads
# the text, splits it where the grammar does. JSON may declare its type in the header, as gpt-oss writes it.
_HARMONY_THEN = ('start: analysis? final\n'
                 'analysis: <|channel|> "analysis" <|message|> ANALYSIS <|end|> <|start|> "assistant"\n'
                 'ANALYSIS: /(.|\\n)*/ & ~/(.|\\n)*(' + "|".join(map(re.escape, MARKERS)) + ')(.|\\n)*/\n'
                 'final: <|channel|> "final" content_type <|message|> answer <|end|>?\n')
_JSON_TYPES = '"" | " json" | " " <|constrain|> "json"'


def reasoning_first(spec: StructuredOutputsParams, prompt_text: str,
                    parser: ReasoningParser | None = None) -> StructuredOutputsParams | None:
    """spec with the model's reasoning allowed before it (see the module's note); None when the prompt
    already closed the reasoning or spec is a grammar of the request's own."""
    if spec.grammar is not None:
        return None
    if parser is not None and parser.harmony:
        return harmony_first(spec, prompt_text)
    if _reasoning_closed(prompt_text):
        return None
    return StructuredOutputsParams(grammar=_REASONING_THEN + "answer: " + _answer(spec))


def harmony_first(spec: StructuredOutputsParams, prompt_text: str) -> StructuredOutputsParams | None:
    """gpt-oss's: spec as the final channel's body after an optional analysis message; None where the
    prompt leaves a message open (the reply continues its body)."""
    if message_open(prompt_text):
        return None
    is_json = spec.json is not None or spec.json_object
    return StructuredOutputsParams(grammar=_HARMONY_THEN + "content_type: " + (_JSON_TYPES if is_json else '""')
                                   + "\nanswer: " + _answer(spec))


def _reasoning_closed(prompt_text: str) -> bool:
    """The prompt ends with a closed think block: its template switched reasoning off (Qwen3's empty block
    with enable_thinking off). An earlier turn's block, followed by more of the conversation, does not count."""
    return prompt_text.rstrip().endswith(THINK_CLOSE)


def _answer(spec: StructuredOutputsParams) -> str:
    """spec's language as a Lark rule body: JSON through %json (with the options grammar_of gives it), a
    regex, or a choice of literals. A spec the plain path refuses is refused alike (its ValueError: a 400)."""
    import llguidance

    if spec.json is not None or spec.json_object:
        return "%json " + json.dumps(json_schema_of(spec))
    checked_grammar_of(spec)
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
    harmony: HarmonySplitter | None = None  # openai_gptoss's own splitter

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        if self.parser is not None and self.parser.harmony:
            self.harmony = self.harmony or HarmonySplitter()
            return self.harmony.feed(text, final)
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
