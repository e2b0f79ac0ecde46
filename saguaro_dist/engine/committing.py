"""How verified tokens become a request's output (the Engine's part that commits a round): stop conditions in
vLLM's order, grammar commits, the text decoded (only when a reader or a stop string needs it), and the
deltas readers get. A mixin of Engine: it reads the engine's eos ids, context length, detokenizer, metrics,
grammar compiler and what each reader has been sent (`_emitted`)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from saguaro_dist.engine.detokenizer import find_stop, stable_prefix
from saguaro_dist.engine.sequence import FinishReason, OutputKind, Sequence, SeqStatus
from saguaro_dist.engine.structured import GrammarError
from saguaro_dist.engine.target import NoTokenAllowed

log = logging.getLogger(__name__)


@dataclass
class Update:
    """What a step changed for one request (streamed to its caller)."""
    seq: Sequence
    text_delta: str
    token_delta: list[int]
    finished: bool
    logprobs_delta: list[dict[int, float]] | None = None  # one per token of token_delta, if the request asked
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with a request's first update, if it asked
    error: Exception | None = None  # the request failed alone (finished): its caller gets this instead


class Committing:
    def _updates(self, seqs: list[Sequence], now: float) -> list[Update]:
        """Deltas for the readers due one (see _due)."""
        due = [s for s in seqs if self._due(s, now)]
        for s in due:
            s.last_update_time = now
        return [self._delta(s) for s in due]

    def _due(self, s: Sequence, now: float) -> bool:
        """Whether s's reader gets an update this round: at the end; never before it for FINAL_ONLY (its
        one update carries everything); for DELTA every round until text went out, then once per
        stream_interval_s. Why: each update is a hand-off to the reader's thread (on Ray an actor call
        each way), which shares the GIL with the round loop, and a text decode (40-100 us a sequence)."""
        if s.finished:
            return True
        if s.output_kind is OutputKind.FINAL_ONLY:
            return False
        text_sent = self._emitted.get(s.seq_id, ("", 0))[0]
        return not text_sent or now - s.last_update_time >= s.stream_interval_s

    def _append(self, s: Sequence, tokens: list[int], now: float) -> None:
        """Add verified tokens up to the first stop condition; cut stop strings from the text. A request whose
        grammar llguidance could not follow (s.error: while scoring, or committing here) ends there alone; so does one
        whose constraints allowed no token (target.NoTokenAllowed) at the round's last token, drawn from that row."""
        if not s.output_token_ids:
            s.metrics.record_first_token(time.perf_counter() - s.arrival_time)
        logprobs = s.round_logprobs  # the target's, for these tokens (if asked)
        if logprobs:
            s.round_logprobs = []
        empty_row = isinstance(s.error, NoTokenAllowed)
        for i, t in enumerate(tokens):
            if empty_row and i == len(tokens) - 1:
                self._fail_alone(s)
                break
            if s.grammar is not None and not self._committed(s, t):
                break
            s.output_token_ids.append(t)
            self.metrics.generated_tokens += 1
            if logprobs:
                s.output_logprobs.append(logprobs[i])
            self._check_stop(s, t)
            if s.finished:
                break
        if empty_row and s.finish_reason is not FinishReason.ABORT:
            s.error = None  # it stopped (EOS, a stop token, max_tokens) before the position no token could take
        self._update_text(s, now)

    def _check_stop(self, s: Sequence, token: int) -> None:
        """End s at its newest token in vLLM v1's order (vllm/v1/core/sched/utils.py check_stop): EOS (unless
        ignore_eos), then stop_token_ids ("stop", stop_reason the id), then length, so an EOS or a stop token that
        is also the max_tokens-th (or fills the context) is "stop". As vLLM, only the tokenizer's EOS ends with no
        stop_reason: the generation config's other eos ids are stop_token_ids (unless ignore_eos). min_tokens is
        kept by the sampler (every end barred until then); stop strings come after, in _update_text."""
        if token in self.eos_token_ids and not s.params.ignore_eos:
            s.stop_reason = None if token == self.eos_token_id else token
            self._finish(s, FinishReason.STOP)
        elif token in s.params.stop_token_ids:
            s.stop_reason = token
            self._finish(s, FinishReason.STOP)
        elif self._at_length(s):
            self._finish(s, FinishReason.LENGTH)

    def _at_length(self, s: Sequence) -> bool:
        """max_tokens reached (None: no limit but the context), or the context's end (vLLM's check_stop)."""
        limit = s.params.max_tokens
        return (limit is not None and len(s.output_token_ids) >= limit) or s.num_tokens >= self.context_len

    def _committed(self, s: Sequence, token: int) -> bool:
        """Advance s's grammar past token; False when s failed instead (now, or while its round was scored):
        it finishes with that error, and its grammar's compiled matcher, which shares the failed lexer, goes."""
        if not isinstance(s.error, GrammarError):  # (NoTokenAllowed: at the round's last token, in _append)
            try:
                s.grammar.commit(token)
                return True
            except GrammarError as err:
                s.error = err
        self._fail_alone(s)
        return False

    def _fail_alone(self, s: Sequence) -> None:
        """s ends with its error (s.error); its grammar's compiled matcher, if it failed, goes."""
        log.warning("request %s failed alone: %s", s.request_id, s.error)
        if isinstance(s.error, GrammarError):
            self.grammars.forget(s.grammar.grammar)
        self._finish(s, FinishReason.ABORT)

    def _update_text(self, s: Sequence, now: float) -> None:
        """Decode what the new tokens add to s.text, token by token in every mode (Detokenizer.decode_more), so
        that text, stop strings, min_tokens and the cut are the token sequence's alone, as AR's (one a round)."""
        # Text nobody reads this round is decoded later, with the next update's (a decode in the round
        # loop costs 40-100 us a sequence: the tokenizer's tables are cold after a forward). Stop
        # strings need it every round.
        if not s.params.stop:
            if self._due(s, now):
                s.text += self._decode_more(s, self._text_ids(s), s.finished)
            return
        self._stop_token_by_token(s)

    def _stop_token_by_token(self, s: Sequence) -> None:
        """Decode the new tokens one at a time and end s at the one that completes a stop string past the
        first min_tokens tokens' text: the tokens of a speculative round after it are dropped, so that SD / SSD
        give AR's tokens (and logprobs), which stop there. The last token ends the text (final) in the step
        that decodes it, as AR's round does; an end after it (EOS or a stop token left out of the text, a
        failure at a token never appended) is a step of its own. As vLLM, a step that a stop token or EOS
        ended is not searched (its stop_reason stays the token)."""
        ids, token_stop = self._text_ids(s), s.finish_reason is FinishReason.STOP  # (no stop string yet)
        last = len(s.output_token_ids) if s.finished and s.finish_reason is not FinishReason.ABORT else None
        for n in range(s.decode_state.stepped + 1, len(ids) + 1):
            searched = len(s.text)
            s.text += self._decode_more(s, ids, n == last, upto=n)
            if self._stop_string_at(s, n, searched, search=not (token_stop and n == last)):
                return
        if s.finished and last != len(ids):  # what waited (an incomplete character) comes out
            searched = len(s.text)
            s.text += self._decode_more(s, ids, True)
            self._stop_string_at(s, len(ids), searched, search=not token_stop)

    def _stop_string_at(self, s: Sequence, n: int, searched: int, search: bool) -> bool:
        """Whether s ends at its n-th token's text (its first n tokens' text is s.text): at a stop string past
        the first min_tokens tokens' text. The round's tokens after the n-th go (counted by _append).
        searched: s.text's length before this token, every stop string ending there already looked for (each
        step before was searched, or was the end): only one ending past it is new, so a request scans its
        text once (vLLM's check_stop_strings), not once a token."""
        if n <= s.params.min_tokens:
            s.stop_after = len(s.text)
            return False
        if not search:
            return False
        after = max(s.stop_after, searched)
        stop = find_stop(s.text, s.params.stop, keep=s.params.include_stop_str_in_output, after=after)
        if stop is None:
            return False
        s.text, s.stop_reason = s.text[:stop[0]], stop[1]
        self.metrics.generated_tokens -= len(s.output_token_ids) - n
        del s.output_token_ids[n:], s.output_logprobs[n:]
        s.finish_reason = FinishReason.STOP  # also where max_tokens or EOS came later in the round
        s.error = None  # a grammar failure later in the round (at a token never appended) came after it
        self._finish(s, FinishReason.STOP)
        s.metrics.num_generated_tokens = len(s.output_token_ids)
        return True

    def _text_ids(self, s: Sequence) -> list[int]:
        if s.finish_reason is FinishReason.STOP and not s.params.include_stop_str_in_output:
            return s.output_token_ids[:-1]  # the token that ended it (EOS, a stop_token_id) is not text, as in vLLM
        return s.output_token_ids

    def _decode_more(self, s: Sequence, ids: list[int], final: bool, upto: int | None = None) -> str:
        return self.detok.decode_more(ids, s.decode_state, final, s.params.skip_special_tokens, upto)

    def _delta(self, s: Sequence) -> Update:
        text_sent, tokens_sent = self._emitted.get(s.seq_id, ("", 0))
        # (a stop string kept in the output cuts no text before its end: nothing waits for one)
        visible = s.text if s.finished else stable_prefix(s.text, () if s.params.include_stop_str_in_output else s.params.stop)
        visible = visible if visible.startswith(text_sent) else text_sent
        self._emitted[s.seq_id] = (visible, len(s.output_token_ids))
        logprobs = s.output_logprobs[tokens_sent:] if s.params.logprobs is not None else None
        prompt_logprobs = s.prompt_logprobs if tokens_sent == 0 else None
        return Update(s, visible[len(text_sent):], s.output_token_ids[tokens_sent:], s.finished, logprobs, prompt_logprobs,
                      s.error)

    def _finish(self, s: Sequence, reason: FinishReason) -> None:
        if not s.finished:
            s.status, s.finish_reason = SeqStatus.FINISHED, reason
            s.metrics.num_generated_tokens = len(s.output_token_ids)
            s.metrics.total_time_s = time.perf_counter() - s.arrival_time
