"""Incremental text for a sequence: stop strings, and deltas safe to stream."""
from __future__ import annotations

from dataclasses import dataclass


def find_stop(text: str, stops: tuple[str, ...], keep: bool = False, after: int = 0) -> tuple[int, str] | None:
    """The first stop string of `stops`, in their order, that the text holds, and where the text ends: where
    that string starts, or where it ends when `keep` (vLLM's include_stop_str_in_output). None: none there.
    after: only a stop string ending past text[:after] counts (that text came before min_tokens, vLLM's).
    List order, not the earliest start: vLLM's check_stop_strings, over the text one token added (the caller
    walks a round token by token, so a token bringing two stop strings ends as vLLM's would)."""
    for stop in stops:
        start = text.find(stop, max(0, after - len(stop) + 1))
        if start >= 0:
            return (start + len(stop) if keep else start), stop
    return None


def stable_prefix(text: str, stops: tuple[str, ...]) -> str:
    """The part of `text` no later token can change: hold back a possible stop-string start and
    an incomplete multi-byte character (decoded as U+FFFD)."""
    holdback = max((len(s) - 1 for s in stops), default=0)
    stable = text[: max(0, len(text) - holdback)]  # (a text shorter than the holdback: text[:-n] kept its start)
    return stable.rstrip("\ufffd")


# vLLM's window of prompt tokens the first output tokens are decoded after (its FastIncrementalDetokenizer):
# the shortest suffix of at least PROMPT_CONTEXT_MIN tokens, up to PROMPT_CONTEXT_MAX, that decodes whole.
PROMPT_CONTEXT_MIN, PROMPT_CONTEXT_MAX = 4, 23
# A held window (its text ends in U+FFFD) gives its text but for its last HELD_KEEP tokens once more than
# MAX_HELD of one invalid byte wait: a UTF-8 character is at most 4 bytes, so at most 3 can wait for the next.
MAX_HELD, HELD_KEEP = 4, 3


@dataclass
class DecodeState:
    """Where a sequence's incremental decode stands: ids[:read_offset] are text already, and
    ids[prefix_offset:read_offset] is the context the next piece is decoded in. Until the first piece,
    the context is the prompt's end (prompt_tail), as in vLLM: a SentencePiece tokenizer drops the
    leading space of a string's first word, which the first output word keeps after a prompt."""
    prefix_offset: int = 0
    read_offset: int = 0
    stepped: int = 0  # ids[:stepped] went through a decode step (their text is out, or waits for a character's end)
    prompt_tail: tuple[int, ...] = ()  # the prompt's last PROMPT_CONTEXT_MAX ids, then the end chosen as context
    prompt_chosen: bool = False        # prompt_tail was cut to the context (at the first decode)

    @classmethod
    def after_prompt(cls, prompt_token_ids: list[int]) -> DecodeState:
        return cls(prompt_tail=tuple(prompt_token_ids[-PROMPT_CONTEXT_MAX:]))


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._rust_decode = _rust_decode(tokenizer)
        self._skipped_ids = _skipped_ids(tokenizer)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of token_ids, as vLLM's output text: no clean_up_tokenization_spaces, which (a
        WordPiece tokenizer's default) rewrites " ." as "." or " n't" as "n't" in a whole decode, where
        a piece-by-piece decode could not take back what it had streamed."""
        if self.tokenizer is None:
            return ""
        if self._rust_decode is not None:
            return self._rust_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def decode_more(self, token_ids: list[int], state: DecodeState, final: bool = False,
                    skip_special_tokens: bool = True, upto: int | None = None) -> str:
        """The text that ids[state.stepped:upto] add (upto None: all), each id decoded in its own step, as AR
        (one token a round) and vLLM decode them: so the text is the ids' alone, never how rounds grouped them
        (a round ending inside a character would hold back its whole text; a SentencePiece byte-fallback
        decode shows bytes that make no character together as one U+FFFD each, but a character and U+FFFD
        when they come apart). An incomplete character at the end waits for its next bytes unless `final`:
        the last step then gives it (no step left: what waited)."""
        if self.tokenizer is None:
            return ""
        upto = len(token_ids) if upto is None else upto
        if state.stepped >= upto:
            return self._step(token_ids, upto, state, final, skip_special_tokens) if final else ""
        pieces = [self._step(token_ids, end, state, final and end == upto, skip_special_tokens)
                  for end in range(state.stepped + 1, upto + 1)]
        state.stepped = upto
        return "".join(pieces)

    def _step(self, token_ids: list[int], end: int, state: DecodeState, final: bool, skip_special_tokens: bool) -> str:
        """What ids[state.read_offset:end] add, decoded with the last piece as context (a tokenizer may render
        a token differently at the start of a string, e.g. SentencePiece's leading space): a few tokens a
        step, not the whole output (re-decoding it all: 63 us at 128 tokens, 397 us at 1000, per sequence).
        An incomplete character at the end (U+FFFD) waits unless `final`. The first piece's context is the
        prompt's end (state.prompt_tail). A skipped special token adds no text, and a held window gives its
        settled text once more than MAX_HELD tokens wait: so a step costs O(1) ids, however long a run of them."""
        if not final and end >= 2 and skip_special_tokens and token_ids[end - 1] in self._skipped_ids:
            return ""  # the window decodes as at the step before, which held or moved on: the same "" again
        if final and state.read_offset == 0 and all(skip_special_tokens and t in self._skipped_ids
                                                     for t in token_ids[:end]):
            return ""  # no output token has text: a prompt's unfinished last character is not the output's (vLLM's "")
        tail, tail_text = self._prompt_context(state, skip_special_tokens) if state.read_offset == 0 else ([], 0)
        ids = tail + list(token_ids[state.prefix_offset:end])
        n_context = tail_text + state.read_offset - state.prefix_offset
        context = self.decode(ids[:n_context], skip_special_tokens)
        text = self.decode(ids, skip_special_tokens)
        held = len(text) <= len(context) or text.endswith("\ufffd")
        # (a token merged across the prompt's end) vLLM's stream resets, checking only a text it gives: a held
        # byte-fallback text shows a run of not-yet-valid bytes as U+FFFD each, so need not start with the context
        if tail and (final or not held) and not text.startswith(context):
            state.prompt_tail = ()
            return self._step(token_ids, end, state, final, skip_special_tokens)
        if not final and held:
            if end - state.read_offset <= MAX_HELD:
                return ""
            return self._release(ids, n_context, (context, text), end, state, skip_special_tokens)
        state.prefix_offset, state.read_offset = state.read_offset, end
        return text[len(context):]

    def _release(self, ids: list[int], n_context: int, texts: tuple[str, str], end: int, state: DecodeState,
                 skip_special_tokens: bool) -> str:
        """The text of a held window (ids, its first n_context the context) but for its last HELD_KEEP text
        tokens, once more than MAX_HELD of one byte that alone is U+FFFD wait: no character has 5 bytes alike,
        and one still incomplete lies in the last 3; what is before is settled where the window's text starts
        with it (a character the last tokens completed, split off, would show U+FFFD instead: then it waits).
        Holding a run of invalid bytes to the end re-decoded a growing window at each token: O(n^2)."""
        context, text = texts
        pending = [i for i in range(n_context, len(ids)) if not (skip_special_tokens and ids[i] in self._skipped_ids)]
        last = {ids[i] for i in pending[-MAX_HELD - 1:]}
        if len(pending) <= MAX_HELD or len(last) > 1 or self.decode(list(last), skip_special_tokens) != "\ufffd":
            return ""  # only a run of one invalid byte is surely no character's: a literal U+FFFD then an emoji, 7
            # byte tokens, is; and a byte-fallback decode shows a run with any invalid byte as U+FFFD a byte
        split = pending[-HELD_KEEP]
        read = end - (len(ids) - split)
        head = self.decode(ids[:split], skip_special_tokens)
        if read <= state.read_offset or len(head) <= len(context) or not (
                head.startswith(context) and text.startswith(head)):
            return ""
        state.prefix_offset, state.read_offset = state.read_offset, read
        return head[len(context):]

    def _prompt_context(self, state: DecodeState, skip_special_tokens: bool) -> tuple[list[int], int]:
        """The prompt's end the first piece is decoded after, and how many of its tokens are text: up to its
        last whole character (vLLM's stream, primed with the prompt, holds an incomplete last character
        back: the output's first piece completes it, or shows it as U+FFFD)."""
        if not state.prompt_chosen:
            state.prompt_tail, state.prompt_chosen = self._whole_suffix(state.prompt_tail, skip_special_tokens), True
        tail = list(state.prompt_tail)
        whole = (n for n in range(len(tail), 0, -1) if not self.decode(tail[:n], skip_special_tokens).endswith("\ufffd"))
        return tail, next(whole, 0)

    def _whole_suffix(self, tail: tuple[int, ...], skip_special_tokens: bool) -> tuple[int, ...]:
        """vLLM's choice: the shortest end of PROMPT_CONTEXT_MIN tokens or more that decodes without U+FFFD
        (an incomplete character there would shift the text the output is read off); none: all of it."""
        if len(tail) <= PROMPT_CONTEXT_MIN:
            return tail
        ends = (tail[-n:] for n in range(PROMPT_CONTEXT_MIN, len(tail)))
        return next((end for end in ends if "\ufffd" not in self.decode(list(end), skip_special_tokens)), tail)


def _skipped_ids(tokenizer) -> frozenset[int]:
    """Ids every decode with skip_special_tokens drops wherever they stand: the tokenizers library drops added
    tokens marked special, transformers' slow decode all_special_ids; those in both."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = getattr(tokenizer, "all_special_ids", None) or ()
    return frozenset(i for i in special if i in added and getattr(added[i], "special", False))


def _rust_decode(tokenizer):
    """The tokenizers library's own decode where transformers' fast tokenizer would call it alone (its decode
    and _decode not overridden; without clean-up they add nothing else): the same text without transformers'
    per-call argument checks (3 of a decode's 4 us), which a token-by-token decode pays twice a token."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or (cls.decode, cls._decode) != (
            PreTrainedTokenizerFast.decode, PreTrainedTokenizerFast._decode):
        return None
    return tokenizer.backend_tokenizer.decode
