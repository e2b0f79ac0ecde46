"""Structured outputs: the target's distribution masked to what a grammar allows, with llguidance.

A JSON schema, a regex, a choice or a grammar (Lark or GBNF) is compiled to an llguidance matcher per request.
Like the penalties it changes the target's distribution, so the target side applies it to every row it
samples or verifies: verify row t gets the mask after the output and x_1..x_t (the matcher consumes the
speculated tokens, then rolls them back), and a speculated token the grammar forbids has probability 0
there, so it is rejected whatever the draft's q. Every path (AR, SD, SSD hit, miss, fallback) samples
the constrained target exactly. The draft is told the grammar (its llguidance text, in DraftSampling)
and masks its own draws with it, each row on its own copy of the matcher: that is acceptance only.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from saguaro_dist.sampling_params import SamplingParams, StructuredOutputsParams
from saguaro_dist.spec.sampling import greedy_tokens


# JSON without free whitespace between tokens (", " and ": " separate): with it a small model can pad
# forever before the first key. A schema's "x-guidance" options override this (llguidance's order).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a request's structured_outputs."""
    import llguidance

    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else '{"type": "object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(compact_if_asked(schema, spec), defaults=JSON_DEFAULTS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to it (as vLLM's guidance backend)


def compact_if_asked(schema: str, spec: StructuredOutputsParams) -> str:
    """The schema, with its x-guidance's whitespace_flexible turned off where the request's disable_any_whitespace
    asks (x-guidance overrides JSON_DEFAULTS, which are compact already); else the very text (one cached grammar)."""
    if not spec.disable_any_whitespace:
        return schema
    parsed = json.loads(schema)  # (a JSONDecodeError is the ValueError that checked_grammar_of reports)
    options = parsed.get("x-guidance") if isinstance(parsed, dict) else None
    if not isinstance(options, dict) or not options.get("whitespace_flexible"):
        return schema
    return json.dumps({**parsed, "x-guidance": {**options, "whitespace_flexible": False}})


def checked_grammar_of(spec: StructuredOutputsParams) -> str:
    """grammar_of(spec); a spec it cannot read (a schema that is not JSON, or not an object) as a request's
    ValueError. Compiling for the tokenizer (GrammarCompiler.check) finds the rest."""
    try:
        return grammar_of(spec)
    except ValueError as err:
        raise ValueError(f"structured_outputs is not valid: {err}") from None


def json_schema_of(spec: StructuredOutputsParams) -> dict:
    """A JSON spec's schema with the options llguidance applies to it (JSON_DEFAULTS under the schema's own
    x-guidance), for a grammar that nests it (%json): read back from grammar_of's text, so it is the same."""
    return json.loads(checked_grammar_of(spec))["grammars"][0]["json_schema"]


def bitmask_to_bool(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (bit j of little-endian 32-bit word j // 32: token j allowed) -> [V] bool."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(bool))


def masked_rows(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [R, V] at -inf where masks [R, V] is False; a row whose mask allows nothing (a grammar that
    has ended) is left as it is, so a draft never samples from an empty distribution."""
    masks = masks | ~masks.any(-1, keepdim=True)
    return logits.masked_fill(~masks.to(logits.device), float("-inf"))


def grammar_masked(logits: torch.Tensor, grammars: list) -> torch.Tensor:
    """logits [R, V], row r masked by grammars[r] (a GrammarState, or None: unconstrained)."""
    allow_all = torch.ones(logits.shape[-1], dtype=torch.bool)
    return masked_rows(logits, torch.stack([g.mask() if g is not None else allow_all for g in grammars]))


def greedy_in_grammar(logits: torch.Tensor, grammars: list) -> torch.Tensor:
    """[R] argmax of each row of logits [R, V] among what grammars[r] allows (None: unconstrained). The
    unmasked argmax where the grammar allows it (one token checked, no [V] mask built), else the masked
    one: the same token either way."""
    drawn = greedy_tokens(logits)
    refused = [r for r, (g, t) in enumerate(zip(grammars, drawn.tolist())) if g is not None and not g.allows(t)]
    if refused:  # one masked argmax over the rows whose grammar refused their argmax
        drawn[refused] = greedy_tokens(masked_rows(logits[refused], torch.stack([grammars[r].mask() for r in refused])))
    return drawn


class GrammarError(ValueError):
    """llguidance could not follow a request's grammar past some token: its lexer or parser hit a limit that
    compiling did not (a regex like a{3000000} compiles, then fails on its first token). The request fails
    alone, with the output it had (engine/engine.py); the engine goes on serving the others."""


class GrammarState:
    """One request's matcher, advanced by the tokens the engine commits. `grammar`: its llguidance text
    (what GrammarCompiler compiled it from); fresh: () -> a new matcher of it whose lexer no other shares
    (GrammarCompiler.fresh), or None. Why: copies of a compiled matcher share its lexer, and once llguidance
    failed in one (a limit of its lexer), the others fail too, other requests' included."""

    MAX_RENEWALS = 16

    def __init__(self, matcher, vocab_size: int, grammar: str = "", fresh: Callable[[], object] | None = None):
        self.matcher, self.vocab_size, self.grammar, self.fresh = matcher, vocab_size, grammar, fresh
        self.consumed: list[int] = []  # the output this matcher followed, for a fresh one to replay
        self.renewals = 0
        self._exact_rows, self._failure, self._round_commits = 0, None, 0  # of the last row_masks (see commit)

    def row_masks(self, drafted: list[int], rows: int) -> torch.Tensor:
        """[rows, V] bool: row t allows what the grammar allows after the output and drafted[:t]. Rows after
        a forbidden drafted token repeat the last mask: that token is rejected, so they are never used.
        Where llguidance fails on the drafted tokens, the rows from there repeat the last mask too, and the
        round's commit of a token they decided raises that failure (commit): a request that ends earlier in
        the round (EOS, a stop token, max_tokens) ends as in AR (it failed at its first token). Raises
        GrammarError where row 0 fails (the request has reached what llguidance cannot follow)."""
        self._round_commits, self._failure = 0, None
        masks = [self._healthy(lambda: self._checked_mask(self.matcher))]
        if rows > 1:
            masks += self._drafted_masks(drafted[:rows - 1])
        self._exact_rows = len(masks) if self._failure is not None else rows
        return torch.stack(masks + [masks[-1]] * (rows - len(masks)))

    def _drafted_masks(self, drafted: list[int]) -> list[torch.Tensor]:
        """The masks after drafted[:1], drafted[:2], ... up to a forbidden token or to where llguidance fails
        (kept in self._failure), on a copy: this matcher consumes only committed tokens. A failure spoils the
        lexer the copy shares with this matcher (and other requests' copies): this one is renewed, and the
        probe tried once more on it (the first failure may have come of another request's spoiling)."""
        masks, failure = self._probe(drafted)
        if failure is not None and self._renew():
            masks, failure = self._probe(drafted)
            if failure is not None:
                self._renew()
        self._failure = failure
        return masks

    def _probe(self, drafted: list[int]) -> tuple[list[torch.Tensor], GrammarError | None]:
        probe, masks = self.matcher.deep_copy(), []
        try:
            for t in drafted:
                if probe.try_consume_tokens([t]) != 1:
                    if probe.is_error():
                        raise self._failed(probe)
                    break
                masks.append(self._checked_mask(probe))
        except GrammarError as err:
            return masks, err
        return masks, None

    def _checked_mask(self, matcher) -> torch.Tensor:
        """matcher's mask; GrammarError where llguidance failed (its mask would allow just EOS)."""
        mask = bitmask_to_bool(matcher.compute_bitmask(), self.vocab_size)
        if matcher.is_error():
            raise self._failed(matcher)
        return mask

    def _healthy(self, op: Callable[[], object]):
        """op(); where llguidance fails, once more on a fresh matcher (another request's failure on this
        grammar, or a probe's, may have spoiled the lexer this one shares)."""
        try:
            return op()
        except GrammarError:
            if not self._renew():
                raise
            return op()

    def _renew(self) -> bool:
        """Follow the output on a fresh matcher; False where none can be made or it fails on the output. At
        most MAX_RENEWALS a request: each compiles the grammar, and a grammar that keeps failing fails."""
        if self.fresh is None or self.renewals >= self.MAX_RENEWALS:
            return False
        self.renewals += 1
        matcher = self.fresh()
        if matcher.try_consume_tokens(list(self.consumed)) != len(self.consumed) or matcher.is_error():
            return False
        self.matcher = matcher
        return True

    def copy(self) -> GrammarState:
        """An independent copy, for a draft's row: it neither keeps the output nor renews its matcher."""
        return GrammarState(self.matcher.deep_copy(), self.vocab_size, self.grammar)

    def mask(self) -> torch.Tensor:
        """[V] bool: what the grammar allows next."""
        return bitmask_to_bool(self.matcher.compute_bitmask(), self.vocab_size)

    def allows(self, token: int) -> bool:
        return self.matcher.validate_tokens([token]) == 1

    def advance(self, tokens: list[int]) -> bool:
        """Consume tokens as far as the grammar allows them; whether all were (the draft's paths)."""
        n = self.matcher.try_consume_tokens(list(tokens))
        if self.fresh is not None:
            self.consumed += tokens[:n]
        return n == len(tokens)

    def commit(self, token: int) -> None:
        """Advance past a token the target sampled under this grammar's mask; GrammarError where the matcher
        cannot (its limits: the mask allowed the token), or where a row whose mask llguidance could not
        compute decided the token (row_masks: the request reached a state it cannot follow)."""
        row, self._round_commits = self._round_commits, self._round_commits + 1
        if self._failure is not None and row >= self._exact_rows:
            raise self._failure
        self._healthy(lambda: self._consume(token))

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"structured_outputs: the grammar engine cannot follow this grammar past token "
                               f"{token}, which its own mask allowed ({self._error(self.matcher)})")
        self.consumed.append(token)

    def _failed(self, matcher) -> GrammarError:
        return GrammarError(f"structured_outputs: the grammar engine cannot follow this grammar ({self._error(matcher)})")

    @staticmethod
    def _error(matcher) -> str:
        return " ".join((matcher.get_error() or "").splitlines()[:1])


class GrammarCompiler:
    """Checks requests' structured outputs and makes their matchers, for one model's tokenizer. Requests
    with the same grammar (a served schema, say) copy one compiled matcher: a copy is ~100x cheaper."""

    CACHED_GRAMMARS = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar text -> matcher, least recently used first
        self._lock = threading.Lock()

    def check(self, params: SamplingParams) -> None:
        """A clear ValueError for a grammar the tokenizer cannot follow (bad regex, bad schema, ...)."""
        spec = params.structured_outputs
        if spec is None:
            return
        if not self.eos_token_ids:  # llguidance would end the grammar with token 0, which ends nothing here
            raise ValueError("structured_outputs needs the model's end-of-sequence token, and this model has none "
                             "(config.json / generation_config.json eos_token_id)")
        grammar = checked_grammar_of(spec)
        # Each of these can leave a row where nothing is allowed: a finished grammar allows only EOS (which
        # ignore_eos would pass and min_tokens holds back), and allowed_token_ids may miss what it needs.
        for clash, name in ((params.ignore_eos, "ignore_eos"), (params.min_tokens, "min_tokens"),
                            (params.allowed_token_ids is not None, "allowed_token_ids")):
            if clash:
                raise ValueError(f"structured_outputs cannot be combined with {name}")
        self._compile(grammar)  # compiling is the check; kept, a served schema is checked once

    def state(self, params: SamplingParams) -> GrammarState:
        return self.state_of(grammar_of(params.structured_outputs))

    def state_of(self, grammar: str) -> GrammarState:
        """A fresh matcher of llguidance grammar text (a copy of the compiled one)."""
        return GrammarState(self._compile(grammar).deep_copy(), self.vocab_size, grammar, lambda: self.fresh(grammar))

    def fresh(self, grammar: str):
        """A matcher of grammar text compiled anew (its lexer shared with no running request's): where
        llguidance failed on a copy, the lexer the copies share is spoiled for all of them."""
        self.forget(grammar)
        return self._compile(grammar).deep_copy()

    def forget(self, grammar: str) -> None:
        """Drop grammar text's compiled matcher: copies share its lexer, and once one copy failed
        (GrammarError) every later copy allowed only EOS, an empty output that looked finished."""
        with self._lock:
            self._compiled.pop(grammar, None)

    def _compile(self, grammar: str):
        """The compiled matcher of grammar text (callers copy it). Thread-safe: LLM checks requests on its
        callers' threads."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            import llguidance

            matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs is not valid: {matcher.get_error().strip()}")
            self._compiled[grammar] = matcher
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
