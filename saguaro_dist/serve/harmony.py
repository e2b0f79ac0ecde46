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
`openai` tool-call parser (parse_openai) turns into a call. A call no parser reads (tool_choice none, or no
tool parser) is left out of the content, as vLLM's HarmonyParser leaves it (tools.ToolPlan's harmony).
parse_openai reads raw replies too (a server without the reasoning parser: their analysis is left out, as
vLLM drops it without a reasoning parser). A reply that does not open with a header (a marker or ` to=`) is
plain text, content as it comes (a constrained reply's JSON, say); so is text between messages. Content
joins the final and preamble messages with "\n", as vLLM's HarmonyParser joins them (the older
OpenAIToolParser kept only the last final, else the last preamble, while its stream sent them all: a
streamed preamble cannot be taken back, so the join keeps whole and streamed replies alike).

The markers are special tokens, but ordinary tokens can spell them too (a JSON string holding "<|end|>"): vLLM
reads harmony by token id, so such text is content. LiteralMarkers reads the ids: each "<|" no marker token wrote
gets LITERAL after its "<" (no decoded text holds a lone surrogate), which `plain` takes out where text leaves us.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from enum import Enum

CHANNEL, MESSAGE, START, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (CHANNEL, MESSAGE, START, CONSTRAIN, END, CALL, RETURN)  # special tokens in gpt-oss's tokenizer
_BODY_ENDS = (END, CALL, RETURN, START)  # a <|start|> with no end before it ends the body too
_HEADER_STARTS = (START, CHANNEL, CONSTRAIN, MESSAGE)  # (<|message|>: a body with no header)
FUNCTIONS = "functions."
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?<![\w.])to=([^\s<]+)")
_CONSTRAINED = re.compile(r"<\|constrain\|>\s*([^\s<]+)")
_WORD = re.compile(r"[^\s<]+|<\|[a-z_]+\|>")
LITERAL = "\udfff"  # between "<" and "|" of text that only looks like a marker (the module's note);
# also before the content's leading "t", so that content read again never opens with a ` to=` header

log = logging.getLogger(__name__)


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


class Mode(Enum):
    """Where the reader is in a reply."""
    OPENING = "opening"  # nothing read yet: does a header open the reply, or is it plain text?
    HEADER = "header"    # a header, up to its <|message|> (a reply cut in one drops it)
    BODY = "body"        # a message's body, up to its end marker
    PLAIN = "plain"      # text outside any message: a reply that is not harmony, or text between messages


def opening(text: str) -> bool | None:
    """Whether a reply beginning with `text` opens with a header (a marker that begins one, or ` to=` before
    any: gpt-oss's prompt ends `<|start|>assistant`), not plain text; None while its beginning cannot tell."""
    head = text.lstrip()
    if head.startswith(_HEADER_STARTS) or head.startswith("to="):
        return True
    if not head or any(m.startswith(head) for m in (*MARKERS, "to=")):
        return None
    return False


@dataclass
class _Reader:
    """Harmony text, fed in pieces, as steps. Text that may still be (part of) a marker or a header is held
    until it cannot, so any cut of a reply into pieces gives the same steps as the whole of it; each piece
    is scanned once (plus a marker's length held back), so a long reply costs time linear in its length."""
    held: str = ""
    header: Header | None = None  # the open message's
    mode: Mode = Mode.OPENING
    scanned: int = 0  # HEADER: how much of `held` was searched for its end already
    opened: bool = False  # a message has opened (the reply is harmony)

    def feed(self, text: str, final: bool) -> list[tuple[Step, Header | None, str]]:
        self.held += text
        steps: list = []
        read = {Mode.OPENING: self._opening, Mode.HEADER: self._header, Mode.BODY: self._body, Mode.PLAIN: self._plain}
        while read[self.mode](final, steps):
            pass
        return steps

    def _opening(self, final: bool, steps: list) -> bool:
        opens = opening(self.held)
        if opens is None and not final:
            return False
        self.mode = Mode.HEADER if opens else Mode.PLAIN
        return True

    def _header(self, final: bool, steps: list) -> bool:
        """Up to <|message|>; a <|start|> before it begins the header anew (what came before is no header)."""
        at, marker = _first(self.held, (MESSAGE, START), max(0, self.scanned - len(MESSAGE) + 1))
        if marker == MESSAGE:
            self._open(Header.parse(self.held[:at]), self.held[at + len(MESSAGE):], steps)
            return True
        if marker == START:
            self.held, self.scanned = self.held[at + len(START):], 0
            return True
        if final:  # a header cut off: it is dropped
            self.held = ""
        self.scanned = len(self.held)
        return False

    def _open(self, header: Header, rest: str, steps: list) -> None:
        self.header, self.held, self.mode, self.opened = header, rest, Mode.BODY, True
        steps.append((Step.OPEN, header, ""))

    def _body(self, final: bool, steps: list) -> bool:
        """Body text up to its end marker; whether reading goes on."""
        at, marker = _first(self.held, _BODY_ENDS)
        if at < 0:
            keep = 0 if final else _marker_tail(self.held, _BODY_ENDS)
            text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            steps.append((Step.TEXT, self.header, text))
            if final:
                self._close(steps, Mode.PLAIN)
            return False
        steps.append((Step.TEXT, self.header, self.held[:at]))
        self.held = self.held[at + len(marker):]
        self._close(steps, Mode.HEADER if marker == START else Mode.PLAIN)  # (a <|start|> opens the next header)
        return True

    def _close(self, steps: list, mode: Mode) -> None:
        steps.append((Step.CLOSE, self.header, ""))
        self.header, self.mode, self.scanned = None, mode, 0

    def _plain(self, final: bool, steps: list) -> bool:
        """Text as it comes, up to a marker: <|start|>, <|channel|> or <|constrain|> begins a header,
        <|message|> a body without one; a stray end marker is dropped."""
        at, marker = _first(self.held, MARKERS)
        if at < 0:  # a marker's beginning is held; at the end, after a message, it is a cut-off marker: dropped
            keep = 0 if final and not self.opened else _marker_tail(self.held, MARKERS)
            _outside_text(self.held[:len(self.held) - keep], steps)
            self.held = "" if final else self.held[len(self.held) - keep:]
            return False
        _outside_text(self.held[:at], steps)
        rest = self.held[at + len(marker):]
        if marker == MESSAGE:
            self._open(Header(), rest, steps)
        elif marker in (START, CHANNEL, CONSTRAIN):
            self.held, self.mode = (rest if marker == START else self.held[at:]), Mode.HEADER
        else:
            self.held = rest
        return True


def message_open(text: str) -> bool:
    """Whether `text` (a prompt's end) leaves a message's body open: its last <|message|> has no end after it
    (a prefilled answer the reply continues)."""
    at = text.rfind(MESSAGE)
    return at >= 0 and _first(text, _BODY_ENDS, at)[0] < 0


def _outside_text(text: str, steps: list) -> None:
    if text:
        steps.append((Step.TEXT, None, text))


def _first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The first of `markers` in text from `start`: (where, which), or (-1, "")."""
    hits = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
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
    written: set[Route] = field(default_factory=set)  # routes a message has written to: separator before the next's
    fresh: bool = True  # the open message has written nothing yet
    separator: str = "\n"  # (Responses': a mark where an item ends, each message being its own there, as vLLM's)
    leading: bool = True  # the content holds nothing but whitespace yet (see _guarded)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        parts = self.parts(text, final)
        reasoning, content = ("".join(p for r, p in parts if r is route) for route in (Route.REASONING, Route.CONTENT))
        return plain(reasoning), content if self.keep_calls else plain(content)  # (calls: parse_openai plains them)

    def parts(self, text: str, final: bool) -> list[tuple[Route, str]]:
        out: list[tuple[Route, str]] = []  # feed's pieces in the reply's order, not plained
        for step, header, piece in self.reader.feed(text, final):
            if header is None:
                out.append((Route.CONTENT, self._guarded(piece)))
            elif header.route is Route.CALL:
                self._call(step, header, piece, out)
            elif step is Step.TEXT and piece and header.route in (Route.REASONING, Route.CONTENT):
                separator = self.separator if self.fresh and header.route in self.written else ""
                piece = self._guarded(piece) if header.route is Route.CONTENT else piece
                out.append((header.route, separator + piece))
                self.fresh = False
                self.written.add(header.route)
            elif step is Step.OPEN:
                self.fresh = True
        return out

    def _guarded(self, piece: str) -> str:
        """Content text, with LITERAL before its leading "t": the content is read again as harmony (the tool
        parsers, tool_choice none), where a reply opening with `to=` opens a header (opening), so a final answer
        "to=be ..." was dropped whole as a header cut off. `plain` takes LITERAL out."""
        body = piece.lstrip()
        if not (self.leading and body):
            return piece
        self.leading = False
        return piece[:len(piece) - len(body)] + LITERAL + body if body.startswith("t") else piece

    def _call(self, step: Step, header: Header, piece: str, out: list) -> None:
        self.leading = False  # (the content opens with this call's header)
        if step is Step.OPEN:
            self.calls.append([header, ""])
        self.calls[-1][1] += piece  # (an OPEN's and a CLOSE's piece is "")
        if self.keep_calls:
            out.append((Route.CONTENT, {Step.OPEN: header.canonical(), Step.TEXT: piece, Step.CLOSE: CALL}[step]))


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
    calls = [(plain(header.recipient.removeprefix(FUNCTIONS)), _arguments(header, plain(body)))
             for header, body in splitter.calls]
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
        if at_reply_start and opening(text) is not False:  # (None: `undecided` holds it all)
            return 0 if opening(text) else -1
        at, _ = _first(text, MARKERS)
        return at

    def undecided(self, text: str, at_reply_start: bool) -> int:
        if at_reply_start and opening(text) is None:
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


def plain(text: str) -> str:
    """Text as the model wrote it: LITERAL taken out."""
    return text.replace(LITERAL, "")


def plain_delta(delta: dict) -> dict:
    """A chat delta's content and calls' names and arguments, plain."""
    out = {**delta, "content": plain(delta.get("content", "")), "tool_calls": [
        {**c, "function": {k: plain(v) for k, v in c["function"].items()}} if "function" in c else c
        for c in delta.get("tool_calls", ())]}
    return {k: v for k, v in out.items() if v or k not in ("content", "tool_calls")}


@dataclass
class LiteralMarkers:
    """A reply's text with LITERAL in each "<|" that no marker token wrote (the module's note), fed in pieces
    with their token ids (a piece's text may lag its ids: a possible stop string waits). Where a marker's text
    begins is the length of the text of the ids before it: the ordinary tokens since the last marker are
    decoded once, when the next marker comes, so a reply costs one decode of its ids."""
    tokenizer: object
    marker_ids: dict[int, str]
    run: list[int] = field(default_factory=list)  # ordinary ids since the last marker
    decoded: int = 0  # the text's length up to the run
    starts: set[int] = field(default_factory=set)  # where markers' text begins, not read yet
    read: int = 0     # characters of text read
    last: str = ""    # the last one (a "<" may end a piece and its "|" begin the next)

    @classmethod
    def of(cls, tokenizer) -> LiteralMarkers:
        return cls(tokenizer, _marker_ids(tokenizer) if tokenizer is not None else {})

    def feed(self, text: str, token_ids) -> str:
        self._locate(token_ids)
        joined, base = self.last + text, self.read - len(self.last)
        pieces, cut, at = [], 0, joined.find("<|")
        while at >= 0:
            if base + at not in self.starts:
                pieces.append(joined[cut:at + 1] + LITERAL)
                cut = at + 1
            at = joined.find("<|", at + 1)
        self._check(joined, base)
        out = ("".join(pieces) + joined[cut:])[len(self.last):]
        self.read, self.last = self.read + len(text), text[-1:] or self.last
        return out

    def _locate(self, token_ids) -> None:
        for token in token_ids:
            marker = self.marker_ids.get(token)
            if marker is None:
                self.run.append(token)
                continue
            at = self.decoded + len(self.tokenizer.decode(self.run, skip_special_tokens=False,
                                                          clean_up_tokenization_spaces=False))
            self.starts.add(at)
            self.decoded, self.run = at + len(marker), []

    def _check(self, joined: str, base: int) -> None:
        """Forgets the markers read; logs one whose place in the text does not hold its "<"."""
        for at in [a for a in self.starts if a < base + len(joined) - 1]:
            self.starts.discard(at)
            if at >= base and joined[at - base] != "<":
                log.warning("harmony: a marker token's text is not where its ids put it (at %d)", at)
