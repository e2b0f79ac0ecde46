"""Reasoning outputs on /v1/chat/completions (vLLM's `--reasoning-parser`): a thinking model's
<think> ... </think> text comes back as the message's `reasoning`, the rest as its `content`.

  qwen3, deepseek_r1  everything before the first </think> is reasoning, less a leading <think> (Qwen3.5's and
               DeepSeek-R1's templates open <think> in the prompt; older Qwen3 ones let the model write it); a
               reply cut before </think> is all reasoning, as vLLM's newest Qwen3 parser reads it. qwen3 only, as
               vLLM's: a reply with no </think> that opens a tool call while thinking (Qwen3.5's, Qwen3-Coder's
               `<tool_call>`, whitespace, `<function=` or `<function name`) ends its reasoning where that
               <tool_call> starts, and the call is content, for the tool parser (tool_call_at). A prompt that
               already closed the think block (Qwen3's enable_thinking=False: <think>\n\n</think>) leaves the
               reply all content: the server gives such a reply no parser (prompt_closed_reasoning)
  openai_gptoss  gpt-oss's harmony channels (harmony.py): analysis is reasoning, final (and commentary) the
               content; its markers are special tokens, kept in the text. A constrained reply may write an
               analysis message first, then its constraint as the final channel's body (harmony_first)

A constrained reply (structured outputs, a named or required tool call) lets the model reason first, as
vLLM applies structured outputs once reasoning ends: `reasoning_first` makes one grammar of "any text up to
the first </think>, whitespace, then what the request allows", so every speculation path samples it
exactly. A call opened while thinking does not end it there: the split reads a </think> anywhere first, so a
finished constrained reply's reasoning ends at its first </think> in the grammar and in the split alike. Where
the tokenizer has a tag as one token (Qwen3's, DeepSeek-R1's: added tokens, which llguidance reads as special
and masks unless named), the grammar takes that token too. Not when the prompt already
closed the reasoning (Qwen3 with enable_thinking off; harmony: the prompt leaves a message open), nor for a
request's own grammar (it is not nested): such replies are constrained whole and not split (gpt-oss's: read
as harmony, as they come).
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
TOOL_CALL, FUNCTION = "<tool_call>", "<function"
# A <tool_call> that opens a call (vLLM's qwen3 parser: <function= or <function name=... after any whitespace);
# one that only mentions the tag does not end the reasoning.
_CALL_OPENS = re.compile(re.escape(TOOL_CALL) + r"(?=\s*<function[\s=])")


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

    def as_grammar_reads(self) -> ReasoningParser:
        """The parser that splits a reply where reasoning_first's grammar ends the reasoning: at the first
        </think> only (qwen3's call opened while thinking does not end it there: the grammar never let the
        constrained part start at a call, so a reply cut inside the reasoning is all reasoning)."""
        return ReasoningParser.DEEPSEEK_R1 if self is ReasoningParser.QWEN3 else self


def split_reasoning(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished reply."""
    if parser is None:
        return None, text
    if parser.harmony:
        return split_harmony(text)
    text = text.removeprefix(THINK_OPEN)
    end = text.find(THINK_CLOSE)
    if end >= 0:
        return text[:end] or None, text[end + len(THINK_CLOSE):]
    call = tool_call_at(parser, text)
    if call >= 0:  # the call is content: the tool parser reads it
        return text[:call] or None, text[call:]
    return text or None, ""  # cut before </think> (max_tokens): all reasoning


def tool_call_at(parser: ReasoningParser | None, text: str) -> int:
    """Where a call opened while thinking starts in a reply with no </think>: qwen3's implicit end of the
    reasoning, as vLLM's Qwen3ReasoningParser reads Qwen3.5's and Qwen3-Coder's calls (-1: none)."""
    match = _CALL_OPENS.search(text) if parser is ReasoningParser.QWEN3 else None
    return match.start() if match else -1


@dataclass(frozen=True)
class ReasoningTokens:
    """Counts how many of a reply's generated tokens are its reasoning (usage's reasoning_tokens), split as
    split_reasoning splits its text: the tokens before the first </think> in it (with none, before qwen3's call
    opened while thinking: tool_call_at), less a leading <think>'s. A thinking model's tags are single tokens
    (Qwen3's, DeepSeek-R1's), found by id; but a model may also spell a tag in other tokens, so the text before
    the tag's first token is searched for the tag's text too."""
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
        start, end = self._open_length(ids), self._close_at(ids)
        if end < 0:
            end = self._call_at(parser, ids)
        return len(ids) - start if end < 0 else max(0, end - start)  # neither: all reasoning

    def _call_at(self, parser: ReasoningParser, ids: list[int]) -> int:
        """Where a call opened while thinking starts, in tokens (-1: none), read from the text as the split
        reads it (its <tool_call>'s own token, or one spelling it, is not reasoning)."""
        at = tool_call_at(parser, self._decode(ids))
        return at if at < 0 else self._tokens_within(ids, at)

    def _open_length(self, ids: list[int]) -> int:
        """Tokens of a leading <think>, its own or spelled in pieces (split_reasoning drops it)."""
        if ids[:len(self.open_ids)] == list(self.open_ids):
            return len(self.open_ids)
        # (the text must start with it: a tag found at character 0 of a later token, e.g. " <think>", is no leading one)
        return self._tokens_within(ids, len(THINK_OPEN)) if self._decode(ids).startswith(THINK_OPEN) else 0

    def prompt_closed(self, prompt_ids: Sequence[int]) -> bool | None:
        """Whether the prompt's last think tag closes the block, by the tags' ids (vLLM's is_reasoning_end scans
        back alike); None where a tag is not one token (the caller reads the text)."""
        if len(self.open_ids) != 1 or len(self.close_ids) != 1:
            return None
        tags = {self.open_ids[0]: False, self.close_ids[0]: True}
        return next((tags[token] for token in reversed(prompt_ids) if token in tags), False)

    def _close_at(self, ids: list[int]) -> int:
        """Where the first </think> starts, in tokens (-1: none): its own tokens, unless the text before them
        spells it already."""
        at = _find(ids, self.close_ids)
        spelled = self._by_text(ids if at < 0 else ids[:at], THINK_CLOSE)
        return spelled if spelled >= 0 else at

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
_REASONING_THEN = ('start: opened reasoning answer | opened reasoning WS answer\n'
                   'spelled[lazy]: /(.|\\n)*<\\/think>/\n'
                   'WS: /[ \\t\\r\\n]+/\n')
_TAG_TEXT = 'opened: ""\nreasoning: spelled\n'
# Where a tag is one token, `<[id]>` names it: a leading <think>, and </think> after text that spells none.
_TAG_TOKENS = ('opened: "" | <[{open}]>\n'
               'reasoning: spelled | THOUGHT <[{close}]>\n'
               'THOUGHT: /(.|\\n)*/ & ~/(.|\\n)*<\\/think>(.|\\n)*/\n')


# gpt-oss (vLLM's harmony structured outputs): an optional analysis message, then the final channel, whose
# body is what the request allows, ended by <|end|> or EOS (<|return|> is one). Markers are special tokens
# (bare `<|channel|>` in Lark); the analysis body holds no marker's text either, so the splitter, which reads
# the text, splits it where the grammar does. JSON may declare its type in the header, as gpt-oss writes it.
_HARMONY_THEN = ('start: analysis? final\n'
                 'analysis: <|channel|> "analysis" <|message|> ANALYSIS <|end|> <|start|> "assistant"\n'
                 'ANALYSIS: /(.|\\n)*/ & ~/(.|\\n)*(' + "|".join(map(re.escape, MARKERS)) + ')(.|\\n)*/\n'
                 'final: <|channel|> "final" content_type <|message|> answer <|end|>?\n')
_JSON_TYPES = '"" | " json" | " " <|constrain|> "json"'


def reasoning_first(spec: StructuredOutputsParams, prompt_text: str, parser: ReasoningParser | None = None,
                    tags: ReasoningTokens | None = None, closed: bool | None = None) -> StructuredOutputsParams | None:
    """spec with the model's reasoning allowed before it (see the module's note); None when the prompt
    already closed the reasoning or spec is a grammar of the request's own. `tags`: the tokenizer's tag ids;
    `closed`: whether the prompt closed the reasoning, where the caller knows (else read from prompt_text)."""
    if spec.grammar is not None:
        return None
    if parser is not None and parser.harmony:
        return harmony_first(spec, prompt_text)
    if prompt_closed_reasoning(prompt_text) if closed is None else closed:
        return None
    return StructuredOutputsParams(grammar=_REASONING_THEN + _tag_rules(tags) + "answer: " + _answer(spec))


def _tag_rules(tags: ReasoningTokens | None) -> str:
    """The rules naming the tags' own tokens, where each is one token; else the tags are text alone."""
    if tags is None or len(tags.open_ids) != 1 or len(tags.close_ids) != 1:
        return _TAG_TEXT
    return _TAG_TOKENS.format(open=tags.open_ids[0], close=tags.close_ids[0])


def harmony_first(spec: StructuredOutputsParams, prompt_text: str) -> StructuredOutputsParams | None:
    """gpt-oss's: spec as the final channel's body after an optional analysis message; None where the
    prompt leaves a message open (the reply continues its body)."""
    if message_open(prompt_text):
        return None
    is_json = spec.json is not None or spec.json_object
    return StructuredOutputsParams(grammar=_HARMONY_THEN + "content_type: " + (_JSON_TYPES if is_json else '""')
                                   + "\nanswer: " + _answer(spec))


def prompt_closed_reasoning(prompt_text: str, continues: bool = False) -> bool:
    """The prompt ends with a closed think block: its template switched reasoning off (Qwen3's empty block
    with enable_thinking off). An earlier turn's block, followed by more of the conversation, does not count.
    A prompt that `continues` its final message (an assistant prefill) is read by its last think tag, as vLLM's
    is_reasoning_end reads it: Qwen3's template writes that turn "<think>...</think>\\n\\n" + its content."""
    if continues:
        return prompt_text.rfind(THINK_CLOSE) > prompt_text.rfind(THINK_OPEN)
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
    """Splits a streamed reply: `feed` each text piece, get (reasoning, content) pieces back, as split_reasoning
    splits the whole (vLLM streams reasoning as it comes). Text that might begin the leading <think> or a
    </think> is held back until it cannot; under qwen3, a <tool_call> that opens or may still open a call too,
    with all after it: the call is content unless a </think> follows (the whole reply's split reads that first),
    so it comes out at the end or at the </think>."""
    parser: ReasoningParser | None
    held: str = ""
    thinking: bool = True  # before </think>
    opened: bool = False   # a leading <think> was looked for (and dropped): later ones are reasoning
    harmony: HarmonySplitter | None = None  # openai_gptoss's own splitter
    scanned: int = 0  # `held` opens with a call (qwen3): how much of it was searched for </think> (0: none opened)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        if self.parser is not None and self.parser.harmony:
            self.harmony = self.harmony or HarmonySplitter()
            return self.harmony.feed(text, final)
        if self.parser is None or not self.thinking:
            return "", text
        self.held += text
        if not self.opened:
            if THINK_OPEN.startswith(self.held) and not final:
                return "", ""  # may still become a leading <think>
            self.held, self.opened = self.held.removeprefix(THINK_OPEN), True
        end = self.held.find(THINK_CLOSE, max(0, self.scanned - len(THINK_CLOSE) + 1))  # (each piece read once)
        if end >= 0:
            self.thinking = False
            reasoning, rest, self.held = self.held[:end], self.held[end + len(THINK_CLOSE):], ""
            return reasoning, rest
        if final:
            call = tool_call_at(self.parser, self.held)
            cut = len(self.held) if call < 0 else call
            reasoning, rest, self.held = self.held[:cut], self.held[cut:], ""
            return reasoning, rest
        cut = 0 if self.scanned else _undecided_from(self.parser, self.held)  # (an opened call: all held)
        out, self.held = self.held[:cut], self.held[cut:]
        self.scanned = len(self.held) if self.scanned or _CALL_OPENS.match(self.held) else 0
        return out, ""


def _undecided_from(parser: ReasoningParser, text: str) -> int:
    """Where the streamed reasoning text stops being surely reasoning: a </think> begun at its end; under qwen3
    also a <tool_call> begun at its end, or one that opens a call or may still (its content, unless a </think>
    comes later)."""
    starts = [len(text) - partial_suffix(text, THINK_CLOSE)]
    if parser is ReasoningParser.QWEN3:
        starts += [len(text) - partial_suffix(text, TOOL_CALL), _call_may_open_at(text)]
    return min(starts)


def _call_may_open_at(text: str) -> int:
    """The first <tool_call> followed by a call's <function= (or <function name) or by what may yet become one
    (whitespace, part of "<function"); len(text) where none."""
    at = text.find(TOOL_CALL)
    while at >= 0:
        after = text[at + len(TOOL_CALL):].lstrip()
        if FUNCTION.startswith(after) or _CALL_OPENS.match(text, at):
            return at
        at = text.find(TOOL_CALL, at + 1)
    return len(text)
