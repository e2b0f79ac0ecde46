"""gpt-oss's harmony replies, read as vLLM reads them with `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai`. From the decoded text (special tokens kept), not with the openai-harmony package,
which downloads its encoding at first use.

A reply is messages: a header, <|message|>, the body, then <|end|>, <|call|> or <|return|> (or the reply's end:
an EOS token is not text). gpt-oss's template ends the prompt with `<|start|>assistant`, so the first header
follows directly; later ones open with <|start|>. A header names the channel (`<|channel|>final`), maybe a
recipient (`to=functions.NAME`, after or before the channel) and a content type (`<|constrain|>json`, or a word
after the channel). Where a message's body goes (vLLM's rules):

  analysis                                  reasoning ("\\n" between messages)
  final; commentary without a recipient     content ("\\n" between messages; commentary is a preamble to calls)
  a recipient functions.NAME                a tool call, the body its arguments (JSON re-written compactly where
                                            it parses; as written where not, or where the content type is not JSON)
  another recipient (built-in tools), other channels    dropped

The reasoning parser (HarmonySplitter) gives reasoning and content; a call stays in the content as a harmony
message of its own (`<|start|>assistant<|channel|>commentary to=functions.NAME ...<|call|>`), which the
`openai` tool-call parser (parse_openai) turns into a call. Without that parser the call's text stays content,
as any family's unread calls do. parse_openai reads raw replies too (a server without the reasoning parser:
their analysis is left out). A reply with no <|message|> is not harmony: it is all content.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

CHANNEL, MESSAGE, START, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (CHANNEL, MESSAGE, START, CONSTRAIN, END, CALL, RETURN)  # special tokens in gpt-oss's tokenizer
_BODY_ENDS = (END, CALL, RETURN, START)  # a <|start|> with no end before it ends the body too
FUNCTIONS = "functions."
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?<![\w.])to=([^\s<]+)")
_CONSTRAINED = re.compile(r"<\|constrain\|>\s*([^\s<]+)")
_WORD = re.compile(r"[^\s<]+|<\|[a-z_]+\|>")


class Route(Enum):
    """Where a message's body goes."""
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"
    DROPPED = "dropped"


@dataclass(frozen=True)
class Header:
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None  # "json" for `<|constrain|>json` and for a bare `json`

    @classmethod
    def parse(cls, text: str) -> Header:
        """A header's text (after its <|start|>, before <|message|>): `assistant<|channel|>commentary
        to=functions.f <|constrain|>json`, or `assistant to=functions.f<|channel|>commentary json`."""
        channel, recipient = _CHANNEL_NAME.search(text), _RECIPIENT.search(text)
        content_type = _CONSTRAINED.search(text)
        if content_type is None and channel is not None:  # a bare word after the channel: `commentary json`
            words = [w for w in _WORD.findall(text[channel.end():]) if not w.startswith(("to=", "<|"))]
            return cls(channel.group(1), recipient and recipient.group(1), words[0] if words else None)
        return cls(channel and channel.group(1), recipient and recipient.group(1), content_type and content_type.group(1))

    @property
    def route(self) -> Route:
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return Route.CALL
        if self.channel == "analysis":  # a built-in tool's call in it too, as vLLM reads it
            return Route.REASONING
        if self.recipient is None and self.channel in (None, "final", "commentary"):
            return Route.CONTENT
        return Route.DROPPED

    def canonical(self) -> str:
        """A call's header as the reasoning parser's content carries it (what parse_openai reads back)."""
        constrain = f" {CONSTRAIN}{self.content_type}" if self.content_type else ""
        return f"{START}assistant{CHANNEL}{self.channel or 'commentary'} to={self.recipient}{constrain}{MESSAGE}"


class Step(Enum):
    OPEN = "open"    # a header was read
    TEXT = "text"    # body text (header None: text outside any message)
    CLOSE = "close"  # the body ended


@dataclass
class _Reader:
    """Harmony text, fed in pieces, as steps. Text that may still be (part of) a marker or a header is held
    until it cannot, so any cut of a reply into pieces gives the same steps as the whole of it."""
    held: str = ""
    header: Header | None = None  # the open message's (None: between messages, or before the first)
    harmony: bool = False         # a message has opened

    def feed(self, text: str, final: bool) -> list[tuple[Step, Header | None, str]]:
        self.held += text
        steps: list = []
        while self._body(final, steps) if self.header is not None else self._outside(final, steps):
            pass
        return steps

    def _body(self, final: bool, steps: list) -> bool:
        """Body text up to its end marker; whether reading goes on."""
        at, marker = _first(self.held, _BODY_ENDS)
        if at < 0:
            keep = 0 if final else _marker_tail(self.held, _BODY_ENDS)
            text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            steps.append((Step.TEXT, self.header, text))
            if final:
                steps.append((Step.CLOSE, self.header, ""))
                self.header = None
            return False
        steps += [(Step.TEXT, self.header, self.held[:at]), (Step.CLOSE, self.header, "")]
        self.held, self.header = self.held[at + len(marker):], None
        return True

    def _outside(self, final: bool, steps: list) -> bool:
        """A header up to <|message|>; text before a <|start|> is no header (text outside any message)."""
        at = self.held.find(MESSAGE)
        start = self.held.rfind(START, 0, at if at >= 0 else len(self.held))
        if start >= 0:
            _outside_text(self.held[:start], steps)
            self.held = self.held[start + len(START):]
            return True
        if at >= 0:
            self.header, self.harmony = Header.parse(self.held[:at]), True
            steps.append((Step.OPEN, self.header, ""))
            self.held = self.held[at + len(MESSAGE):]
            return True
        if final:  # a header cut off (markers, or after a message a bit of one) is dropped; plain text is content
            cut_header = any(m in self.held for m in MARKERS) or (self.harmony and _marker_tail(self.held, MARKERS))
            if not cut_header:  # (a reply that is not harmony, or text after the last message)
                _outside_text(self.held, steps)
            self.held = ""
        return False


def _outside_text(text: str, steps: list) -> None:
    if text.strip():
        steps.append((Step.TEXT, None, text))


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first of `markers` in text: (where, which), or (-1, "")."""
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else (-1, "")


def _marker_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:n])), default=0)


@dataclass
class HarmonySplitter:
    """The `openai_gptoss` reasoning parser: `feed` each text piece, get (reasoning, content) pieces back
    (the module's note). keep_calls=False leaves calls out of the content; `calls` has each one's header and body."""
    keep_calls: bool = True
    reader: _Reader = field(default_factory=_Reader)
    calls: list[list] = field(default_factory=list)  # [header, body so far] per call
    written: set[Route] = field(default_factory=set)  # routes a message has written to: "\n" before the next's
    fresh: bool = True  # the open message has written nothing yet

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        out = {Route.REASONING: [], Route.CONTENT: []}
        for step, header, piece in self.reader.feed(text, final):
            if header is None:
                out[Route.CONTENT].append(piece)
            elif header.route is Route.CALL:
                self._call(step, header, piece, out[Route.CONTENT])
            elif step is Step.TEXT and piece and header.route in out:
                separator = "\n" if self.fresh and header.route in self.written else ""
                out[header.route].append(separator + piece)
                self.fresh = False
                self.written.add(header.route)
            elif step is Step.OPEN:
                self.fresh = True
        return "".join(out[Route.REASONING]), "".join(out[Route.CONTENT])

    def _call(self, step: Step, header: Header, piece: str, content: list[str]) -> None:
        if step is Step.OPEN:
            self.calls.append([header, ""])
        elif step is Step.TEXT:
            self.calls[-1][1] += piece
        if self.keep_calls:
            content.append({Step.OPEN: header.canonical(), Step.TEXT: piece, Step.CLOSE: CALL}[step])


def split_harmony(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished reply, as its stream splits it."""
    reasoning, content = HarmonySplitter().feed(text, final=True)
    return reasoning or None, content


def parse_openai(text: str, functions: tuple[dict, ...] = ()) -> tuple[str | None, list[tuple[str, str]]]:
    """The `openai` tool-call parser: (content, [(name, arguments JSON text)]) of a finished reply (raw harmony,
    or the reasoning parser's content); `functions` (the request's tools) is not needed. A call cut off by
    max_tokens is still a call, with the arguments written so far: the text cannot tell it from a finished one
    (its <|call|> is an EOS token, not text), and finish_reason says "length"."""
    splitter = HarmonySplitter(keep_calls=False)
    _, content = splitter.feed(text, final=True)
    calls = [(header.recipient.removeprefix(FUNCTIONS), _arguments(header, body)) for header, body in splitter.calls]
    return content or None, calls


def _arguments(header: Header, body: str) -> str:
    """JSON arguments re-written compactly where they parse (vLLM's), else as written."""
    if header.content_type is not None and "json" not in header.content_type:
        return body
    try:
        return json.dumps(json.loads(body), ensure_ascii=False)
    except ValueError:
        return body


class HarmonyCallSyntax:
    """Where calls begin in streamed content (tool_parsers.CallSyntax's interface): at a marker (the reasoning
    parser's content carries each call as a message opening with <|start|>), or at the reply's start when it
    opens with a header (a raw reply: no reasoning parser), where ` to=` may come before any marker."""

    def start(self, text: str, at_reply_start: bool) -> int:
        if at_reply_start and text.lstrip().startswith("to="):
            return 0
        at, _ = _first(text, MARKERS)
        return at

    def undecided(self, text: str, at_reply_start: bool) -> int:
        if at_reply_start and "to=".startswith(text.lstrip()):
            return len(text)
        return _marker_tail(text, MARKERS)


def reasoning_token_count(tokenizer, token_ids) -> int:
    """How many of a reply's tokens are analysis bodies (usage's reasoning_tokens), read by id: harmony's
    markers are single special tokens. 0 with a tokenizer that has no such tokens."""
    marks = _marker_ids(tokenizer)
    count, header, route = 0, [], None
    for token in token_ids:
        mark = marks.get(token)
        if route is not None:  # in a body
            if mark in _BODY_ENDS:
                route, header = None, []
            else:
                count += route is Route.REASONING
        elif mark == MESSAGE:
            route = Header.parse(tokenizer.decode(header, skip_special_tokens=False)).route
        elif mark == START:
            header = []
        else:
            header.append(token)
    return count


def _marker_ids(tokenizer) -> dict[int, str]:
    ids = {m: tokenizer.encode(m, add_special_tokens=False) for m in MARKERS}
    return {found[0]: m for m, found in ids.items() if len(found) == 1}
