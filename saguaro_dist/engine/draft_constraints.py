"""What the draft must know of a request's constraints to propose what the constrained target would
choose: its grammar (structured outputs), logit bias / allowed tokens, bad words, penalties and the ends
min_tokens holds back. Acceptance
only: the target applies them itself, so a draft that cannot follow one loses speed, never exactness."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from saguaro_dist.engine.draft_state import DraftSeq
from saguaro_dist.engine.structured import GrammarCompiler, GrammarState, masked_rows
from saguaro_dist.spec.bad_words import RowBadWords, bad_words_mask, longest_prefix, tail
from saguaro_dist.spec.logit_bias import bias_row
from saguaro_dist.spec.min_tokens import RowEnds, hold_back_positions
from saguaro_dist.spec.penalties import RowPenalties, masked_row_penalties, penalize_batch, prompt_mask

log = logging.getLogger(__name__)


@dataclass
class RowRules:
    """What every draw of rows that each draw one token a step (the draft's K draws) follows beside a
    grammar: apply() to a step's logits, drew() the tokens drawn."""
    penalties: RowPenalties | None   # penalties, logit bias and allowed tokens
    bad_words: RowBadWords | None
    ends: RowEnds | None = None      # min_tokens' held-back ends

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        for mask in (self.bad_words, self.ends):  # masks: their place changes nothing
            if mask is not None:
                logits = mask.apply(logits)
        return logits

    def drew(self, tokens: torch.Tensor) -> None:
        for rule in (self.penalties, self.bad_words, self.ends):
            if rule is not None:
                rule.drew(tokens)


class DraftConstraints:
    def __init__(self, vocab_size: int, tokenizer_loader: Callable[[], object] | None = None,
                 eos_token_ids: Iterable[int] = ()):
        """tokenizer_loader: the draft's tokenizer, loaded on the first request with a grammar (None: it
        has none, and grammars are not followed); eos_token_ids: the target's, any of which ends its
        grammars (none: the tokenizer's EOS alone, then the draft cannot propose the others there)."""
        self.vocab_size = vocab_size
        self._tokenizer_loader, self._grammars = tokenizer_loader, None
        self._eos_token_ids = tuple(t for t in eos_token_ids if t < vocab_size)  # ids past it end nothing here

    def grammar_state(self, grammar: str | None, output: list[int]) -> GrammarState | None:
        """The request's grammar after its output so far, or None: none asked, or this draft cannot
        follow it (no tokenizer, a grammar it cannot compile): it then proposes unconstrained."""
        if grammar is None:
            return None
        try:
            if self._grammars is None:
                tokenizer = self._tokenizer_loader() if self._tokenizer_loader else None
                self._grammars = GrammarCompiler(tokenizer, self.vocab_size, self._eos_token_ids)
            state = self._grammars.state_of(grammar)
        except ValueError as err:
            log.warning("the draft does not follow this grammar (%s): it proposes unconstrained", err)
            return None
        return state if state.advance(output) else None

    def rows(self, owners: list[DraftSeq], paths: list[list[int]] | None) -> RowRules | None:
        """Rows drawing for owners[i] after its committed output and paths[i] (a branch's own tokens; None when
        reads_paths(owners) is false): what the constrained target would choose there, grammars aside (row_grammars).
        None when no request has penalties, a logit bias, allowed tokens, bad words or ends still held back."""
        penalties, banned, ends = self.penalties(owners, paths), self.bad_words(owners, paths), self.ends(owners, paths)
        return None if penalties is None and banned is None and ends is None else RowRules(penalties, banned, ends)

    @staticmethod
    def reads_paths(owners: list[DraftSeq]) -> bool:
        """Whether rows() or row_grammars() read the rows' paths (else a caller need not list them)."""
        return any(s.grammar is not None or s.sampling.penalized or s.sampling.biased or s.sampling.bad_words
                   or short_of_min_tokens(s) for s in distinct(owners))

    @staticmethod
    def ends(owners: list[DraftSeq], paths: list[list[int]] | None) -> RowEnds | None:
        """Each row's ends and the output tokens before its first draw, output + path (paths read only when a
        request is still short of min_tokens); None when none is."""
        if not any(short_of_min_tokens(s) for s in distinct(owners)):
            return None
        return RowEnds([s.sampling.end_token_ids if short_of_min_tokens(s) else () for s in owners],
                       [output_len(s) + len(path) if short_of_min_tokens(s) else 0 for s, path in zip(owners, paths)],
                       [s.sampling.min_tokens for s in owners])

    @staticmethod
    def bad_words(owners: list[DraftSeq], paths: list[list[int]] | None) -> RowBadWords | None:
        """Each row's bad words and the tail of its output + path (read only when a request has bad words);
        None when none has any."""
        if not any(s.sampling.bad_words for s in distinct(owners)):
            return None
        return RowBadWords([s.sampling.bad_words for s in owners],
                           [tail(output_tail(s) + path, longest_prefix(s.sampling.bad_words)) if s.sampling.bad_words
                            else [] for s, path in zip(owners, paths)])

    def penalties(self, owners: list[DraftSeq], paths: Iterable[list[int]]) -> RowPenalties | None:
        """Rows drawing for owners[i] after its committed output and the i-th path (a branch's own tokens;
        read only when a request has penalties): the draft then proposes what the penalized (and biased)
        target would choose. None when no request has penalties, a logit bias or allowed tokens."""
        if not any(s.sampling.penalized or s.sampling.biased for s in distinct(owners)):
            return None
        settings = [(s.sampling.presence_penalty, s.sampling.frequency_penalty, s.sampling.repetition_penalty)
                    for s in owners]
        bias = torch.stack([self._bias_row(s) for s in owners]) if any(s.sampling.biased for s in owners) else None
        in_prompt = torch.stack([self._prompt_row(s, self.vocab_size) for s in owners])
        return masked_row_penalties(in_prompt, [s.committed[s.prompt_len:] + path for s, path in zip(owners, paths)],
                                    settings, self.vocab_size, bias)

    @staticmethod
    def _prompt_row(s: DraftSeq, vocab_size: int) -> torch.Tensor:
        """s's prompt_mask, kept on s (its prompt never changes): rebuilt every round it cost ~70 us a sequence."""
        if s.in_prompt is None or s.in_prompt.shape[0] != vocab_size:
            s.in_prompt = prompt_mask(s.committed[:s.prompt_len], vocab_size)
        return s.in_prompt

    def _bias_row(self, s: DraftSeq) -> torch.Tensor:
        if s.bias is None:
            s.bias = bias_row(s.sampling.logit_bias, s.sampling.allowed_token_ids, self.vocab_size)
        return s.bias

    @staticmethod
    def row_grammars(owners: list[DraftSeq], paths: list[list[int]]) -> list[GrammarState | None] | None:
        """Each row's own matcher after its sequence's output and its path (None for a row whose path the
        grammar forbids: it draws unconstrained); None when no request has a grammar."""
        if all(s.grammar is None for s in distinct(owners)):
            return None
        rows = [s.grammar.copy() if s.grammar is not None else None for s in owners]
        return [g if g is not None and g.advance(path) else None for g, path in zip(rows, paths)]

    def positions(self, s: DraftSeq, logits: torch.Tensor) -> torch.Tensor:
        """The glue's logits [K+1, V] over [b, x_1..x_K] as the constrained target would rank them: masked
        by the grammar (row j after x_1..x_j), biased, bad words barred (row j after the output and x_1..x_j),
        the ends barred in the rows short of min_tokens, then penalized with row j counting the output and x_1..x_j."""
        if s.grammar is not None:
            logits = masked_rows(logits, s.grammar.row_masks(s.speculation, logits.shape[0]))
        if s.sampling.biased:
            logits = logits + self._bias_row(s).to(logits.device)
        if s.sampling.bad_words:
            banned = bad_words_mask(output_tail(s), s.speculation, logits.shape[0], s.sampling.bad_words, logits.shape[1])
            logits = logits.masked_fill(banned.to(logits.device), float("-inf"))
        if short_of_min_tokens(s):
            logits = hold_back_positions(logits, output_len(s), s.sampling.min_tokens, s.sampling.end_token_ids)
        if not s.sampling.penalized:
            return logits
        p = s.sampling  # (penalize_positions, with s's kept prompt mask)
        return penalize_batch(logits[None], self._prompt_row(s, logits.shape[1])[None], [s.committed[s.prompt_len:]],
                              [s.speculation], [(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)])[0]


def distinct(owners: list[DraftSeq]) -> Iterable[DraftSeq]:
    """owners without repeats, for checks that ask whether any sequence needs a rule: a tree's rows are its
    branches, a few per sequence (a round's ~250 rows read ~64 sequences' settings four times over)."""
    return {id(s): s for s in owners}.values()


def output_tail(s: DraftSeq) -> list[int]:
    """The last tokens of s's output that can start a bad word (the prompt never counts: vLLM's rule)."""
    n = longest_prefix(s.sampling.bad_words)
    return s.committed[max(s.prompt_len, len(s.committed) - n):]


def output_len(s: DraftSeq) -> int:
    """s's output tokens so far, the pending bonus included: the count before its next drafted token."""
    return len(s.committed) - s.prompt_len


def short_of_min_tokens(s: DraftSeq) -> bool:
    """Whether min_tokens still holds s's ends back at its next drafted token (and so at some later ones)."""
    return s.sampling.min_tokens > 0 and output_len(s) < s.sampling.min_tokens and bool(s.sampling.end_token_ids)
