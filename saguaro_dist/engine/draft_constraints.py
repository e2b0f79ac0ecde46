"""What the draft must know of a request's constraints to propose what the constrained target would
choose: its grammar (structured outputs), logit bias / allowed tokens, and penalties. Acceptance only:
the target applies them itself, so a draft that cannot follow one loses speed, never exactness."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from saguaro_dist.engine.draft_state import DraftSeq
from saguaro_dist.engine.structured import GrammarCompiler, GrammarState, masked_rows
from saguaro_dist.spec.logit_bias import bias_row
from saguaro_dist.spec.penalties import RowPenalties, penalize_positions, row_penalties

log = logging.getLogger(__name__)


class DraftConstraints:
    def __init__(self, vocab_size: int, tokenizer_loader: Callable[[], object] | None = None):
        """tokenizer_loader: the draft's tokenizer, loaded on the first request with a grammar (None: it
        has none, and grammars are not followed)."""
        self.vocab_size = vocab_size
        self._tokenizer_loader, self._grammars = tokenizer_loader, None

    def grammar_state(self, grammar: str | None, output: list[int]) -> GrammarState | None:
        """The request's grammar after its output so far, or None: none asked, or this draft cannot
        follow it (no tokenizer, a grammar it cannot compile): it then proposes unconstrained."""
        if grammar is None:
            return None
        try:
            if self._grammars is None:
                tokenizer = self._tokenizer_loader() if self._tokenizer_loader else None
                self._grammars = GrammarCompiler(tokenizer, self.vocab_size, ())
            state = self._grammars.state_of(grammar)
        except ValueError as err:
            log.warning("the draft does not follow this grammar (%s): it proposes unconstrained", err)
            return None
        return state if state.advance(output) else None

    def penalties(self, owners: list[DraftSeq], paths: Iterable[list[int]]) -> RowPenalties | None:
        """Rows drawing for owners[i] after its committed output and the i-th path (a branch's own tokens;
        read only when a request has penalties): the draft then proposes what the penalized (and biased)
        target would choose. None when no request has penalties, a logit bias or allowed tokens."""
        if not any(s.sampling.penalized or s.sampling.biased for s in owners):
            return None
        prompts = {id(s): s.committed[:s.prompt_len] for s in owners}  # one list (one scan) per sequence
        settings = [(s.sampling.presence_penalty, s.sampling.frequency_penalty, s.sampling.repetition_penalty)
                    for s in owners]
        bias = torch.stack([self._bias_row(s) for s in owners]) if any(s.sampling.biased for s in owners) else None
        return row_penalties([prompts[id(s)] for s in owners],
                             [s.committed[s.prompt_len:] + path for s, path in zip(owners, paths)], settings,
                             self.vocab_size, bias)

    def _bias_row(self, s: DraftSeq) -> torch.Tensor:
        if s.bias is None:
            s.bias = bias_row(s.sampling.logit_bias, s.sampling.allowed_token_ids, self.vocab_size)
        return s.bias

    @staticmethod
    def row_grammars(owners: list[DraftSeq], paths: list[list[int]]) -> list[GrammarState | None] | None:
        """Each row's own matcher after its sequence's output and its path (None for a row whose path the
        grammar forbids: it draws unconstrained); None when no request has a grammar."""
        if all(s.grammar is None for s in owners):
            return None
        rows = [s.grammar.copy() if s.grammar is not None else None for s in owners]
        return [g if g is not None and g.advance(path) else None for g, path in zip(rows, paths)]

    def positions(self, s: DraftSeq, logits: torch.Tensor) -> torch.Tensor:
        """The glue's logits [K+1, V] over [b, x_1..x_K] as the constrained target would rank them: masked
        by the grammar (row j after x_1..x_j), biased, then penalized with row j counting the output and
        x_1..x_j."""
        if s.grammar is not None:
            logits = masked_rows(logits, s.grammar.row_masks(s.speculation, logits.shape[0]))
        if s.sampling.biased:
            logits = logits + self._bias_row(s).to(logits.device)
        if not s.sampling.penalized:
            return logits
        p = s.sampling
        return penalize_positions(logits, s.committed[:s.prompt_len], s.committed[s.prompt_len:], s.speculation,
                                  p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
