"""A stream's bytes as SSE lines. A line ends at CRLF, LF or CR only (the SSE spec): httpx's iter_lines() also split
at U+0085, U+2028, U+2029 and others (str.splitlines), which JSON carries raw (vLLM sends them unescaped), so a chunk
holding one broke in two. UTF-8 is decoded incrementally: a character split across network chunks stays whole.
Only a chunk's new text is searched for line ends; a line begun is kept as pieces, joined once at its end (a long
line re-scanned with every chunk was quadratic). A line the body leaves unended is still read (a JSON reply to a
request for a stream ends so), but no blank line is made up after it: an event unended at EOF is discarded (the
spec), so a stream cut mid-event is a truncation, not an event of half a JSON chunk."""
from __future__ import annotations

import codecs
import re
from collections.abc import AsyncIterator, Iterable, Iterator

_LINE_END = re.compile(r"\r\n|\r|\n")


class LineSplitter:
    """feed() network chunks, then finish(): the lines, without their ends."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # (the spec's decoding)
        self._pieces: list[str] = []  # a line begun, not yet ended
        self._skip_lf = False   # the text so far ended at a CR: a LF opening the next chunk ends no second line
        self._started = False   # a leading BOM is dropped, once (the spec)

    def feed(self, chunk: bytes) -> list[str]:
        return self._split(self._decoder.decode(chunk))

    def finish(self) -> list[str]:
        """The lines left, the body's unended last one included."""
        lines = self._split(self._decoder.decode(b"", final=True))
        rest, self._pieces = "".join(self._pieces), []
        return [*lines, rest] if rest else lines

    def _split(self, text: str) -> list[str]:
        if not self._started and text:
            text, self._started = text.removeprefix("\ufeff"), True
        if self._skip_lf and text:
            text = text.removeprefix("\n")
            self._skip_lf = False
        if not text:
            return []
        self._skip_lf = text.endswith("\r")
        *lines, rest = _LINE_END.split(text)
        if lines:  # the line begun ends in this text
            lines[0], self._pieces = "".join([*self._pieces, lines[0]]), []
        if rest:
            self._pieces.append(rest)
        return lines


def sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The stream's lines, its unended last one included."""
    splitter = LineSplitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.finish()


async def async_sse_lines(chunks: AsyncIterator[bytes]):
    splitter = LineSplitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.finish():
        yield line
