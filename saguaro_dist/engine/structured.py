"""Structured outputs: the target's distribution masked to what a grammar allows, with llguidance.

A JSON schema, a regex, a choice or a Lark grammar is compiled to an llguidance matcher per request.
Like the penalties it changes the target's distribution, so the target side applies it to every row it
samples or verifies: verify row t gets the mask after the output and x_1..x_t (the matcher consumes the
speculated tokens, then rolls them back), and a speculated token the grammar forbids has probability 0
there, so it is rejected whatever the draft's q. Every path (AR, SD, SSD hit, miss, fallback) samples
the constrained target exactly; the draft is not told (a forbidden proposal costs acceptance only).
"""
from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import torch

from saguaro_dist.sampling_params import SamplingParams, StructuredOutputsParams


# JSON without free whitespace between tokens (", " and ": " separate): with it a small model can pad
# forever before the first key. A schema's "x-guidance" options override this (llguidance's order).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a request's structured_outputs."""
    import llguidance

    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def allowed_tokens(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (bit j of little-endian 32-bit word j // 32: token j allowed) -> [V] bool."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(bool))


class GrammarState:
    """One request's matcher, advanced by the tokens the engine commits."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def row_masks(self, drafted: list[int], rows: int) -> torch.Tensor:
        """[rows, V] bool: row t allows what the grammar allows after the output and drafted[:t]. Rows after
        a forbidden drafted token repeat the last mask: that token is rejected, so they are never used."""
        consumed = self.matcher.try_consume_tokens(list(drafted[:rows - 1])) if rows > 1 else 0
        masks = [None] * (consumed + 1)
        for t in range(consumed, -1, -1):  # the deepest state first, then roll back one token at a time
            masks[t] = allowed_tokens(self.matcher.compute_bitmask(), self.vocab_size)
            if t:
                self.matcher.rollback(1)
        return torch.stack(masks + [masks[-1]] * (rows - consumed - 1))

    def commit(self, token: int) -> None:
        if not self.matcher.consume_token(token):  # only a bug can get here: the target never samples it
            first_line = (self.matcher.get_error() or "").splitlines()[:1]
            raise RuntimeError(f"token {token} does not satisfy the requested grammar: {' '.join(first_line)}")


class GrammarCompiler:
    """Checks requests' structured outputs and makes their matchers, for one model's tokenizer. Requests
    with the same grammar (a served schema, say) copy one compiled matcher: a copy is ~100x cheaper."""

    CACHED_GRAMMARS = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._compiled: OrderedDict[StructuredOutputsParams, object] = OrderedDict()  # least recently used first

    def check(self, params: SamplingParams) -> None:
        """A clear ValueError for a grammar the tokenizer cannot follow (bad regex, bad schema, ...)."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            grammar = grammar_of(spec)
        except ValueError as err:
            raise ValueError(f"structured_outputs is not valid: {err}") from None
        if params.ignore_eos:  # a finished grammar allows only EOS: past it nothing is allowed
            raise ValueError("structured_outputs cannot be combined with ignore_eos")
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
        if error:
            raise ValueError(f"structured_outputs is not valid: {error.strip()}")

    def state(self, params: SamplingParams) -> GrammarState:
        return GrammarState(self._compile(params.structured_outputs).deep_copy(), self.vocab_size)

    def _compile(self, spec: StructuredOutputsParams):
        if spec in self._compiled:
            self._compiled.move_to_end(spec)
            return self._compiled[spec]
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_of(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs is not valid: {matcher.get_error()}")
        self._compiled[spec] = matcher
        if len(self._compiled) > self.CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher

    def _tokenizer(self):
        """llguidance's view of the tokenizer (built once: ~1 s for a large vocabulary)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
        if self._ll_tokenizer is None:
            import llguidance.hf

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_ids or None)
            except ValueError as err:  # say a WordPiece decoder: llguidance cannot map tokens to bytes
                raise ValueError(f"structured_outputs needs a tokenizer llguidance can read; this one: {err}") from None
        return self._ll_tokenizer
