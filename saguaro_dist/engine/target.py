"""The target side's model work: prefill, plain decode and batched verification of speculations."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from saguaro_dist.engine.logprobs import token_logprobs
from saguaro_dist.engine.lora_slots import AdapterSlots
from saguaro_dist.engine.messages import Proposal
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.engine.structured import GrammarError
from saguaro_dist.model.prefix_cache import PrefixCache, reusable_len
from saguaro_dist.spec.bad_words import bad_words_mask
from saguaro_dist.spec.coupled import Coupling
from saguaro_dist.spec import (
    bias_row, greedy_tokens, greedy_verify, penalize_batch, prompt_mask, sample, target_probs, verify,
)


@dataclass(frozen=True)
class RowSampling:
    """Each row's temperature / top-k / top-p / min-p as tensors: built once, reused by every draw over those rows."""
    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_k: torch.Tensor        # [N] int64, 0 = off
    top_p: torch.Tensor        # [N] float32
    min_p: torch.Tensor        # [N] float32, 0 = off
    tempered_only: bool = False  # every row T > 0 and unfiltered (no min-p, top-k or top-p): p = softmax(logits / T)

    @staticmethod
    def of(settings: list, device: torch.device | str = "cpu", rows_per_seq: int = 1) -> RowSampling:
        """settings: SamplingParams or DraftSampling, one per sequence, each repeated for rows_per_seq rows;
        on `device`, the logits' (the tempered-only draw divides by them without target_probs' moves)."""
        columns = [(s.temperature, s.top_k, s.top_p, s.min_p) for s in settings]
        dtypes = (torch.float32, torch.int64, torch.float32, torch.float32)
        n = len(columns) * rows_per_seq
        if columns and all(c == columns[0] for c in columns):  # one setting for all (n samples of a request): no lists
            made = [torch.full((n,), x, dtype=d, device=device) for x, d in zip(columns[0], dtypes)]
        else:  # one tensor per setting built where it is used (half repeat_interleave's cost)
            made = [torch.tensor([c[j] for c in columns for _ in range(rows_per_seq)], dtype=d, device=device)
                    for j, d in enumerate(dtypes)]
        tempered_only = all(t > 0 and m == 0 and k <= 0 and p >= 1.0 for t, k, p, m in set(columns))
        return RowSampling(*made, tempered_only)


def sampling_probs(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Each row's own sampling distribution over logits [N, V] (spec.sampling.target_probs).

    Rows that are only tempered skip target_probs' per-call checks of which filters apply (four host
    reads of [N] tensors, ~90 us of a 12-row draw at V = 2048; a T > 0 tree draws K times): the same
    division and softmax, so the same bits."""
    if rows.tempered_only:
        return torch.softmax(logits.float() / rows.temperature[:, None], dim=-1)
    return target_probs(logits.float(), rows.temperature, rows.top_k, rows.top_p, rows.min_p)


def stack_proposals(proposals: list[Proposal], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens [B, K] and q [B, K, V]; q is None when every proposal is one-hot (greedy, n-gram)."""
    tokens = torch.stack([p.tokens for p in proposals])
    if all(p.probs is None for p in proposals):
        return tokens, None
    one_hot = lambda p: torch.nn.functional.one_hot(p.tokens, vocab_size).float()  # noqa: E731
    return tokens, torch.stack([p.probs if p.probs is not None else one_hot(p) for p in proposals])


class NoTokenAllowed(ValueError):
    """A request whose constraints bar every token at an output position it reached: it fails alone there, in
    AR, SD and SSD alike (committing.Committing._append); a ValueError, so over HTTP that request's 400."""


PROMPT_LOGPROBS_ROWS = 512  # logit rows alive at once while scoring a prompt (512 x 128k vocab x 4 B = 256 MB)


class TargetScorer:
    """Owns the target's ModelRunner; every call is batched over sequences."""

    def __init__(self, runner, eos_token_ids: frozenset[int] = frozenset(), prefix_caching: bool = True,
                 max_cpu_loras: int | None = None):
        self.runner = runner
        self.prefixes = PrefixCache(runner, enabled=prefix_caching)  # add / free of whole sequences go through it
        lora = getattr(runner, "lora", None)  # the runner's LoRA slot table (None: LoRA off)
        self.loras = AdapterSlots(runner, self.prefixes, lora.max_loras, max_cpu_loras) if lora is not None else None
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = eos_token_ids  # with stop_token_ids, what min_tokens holds back

    @staticmethod
    def _grammar_masked(logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]] | None = None
                        ) -> torch.Tensor:
        """logits [B, T, V] with each structured-output grammar's masks (row t: after the output and
        drafted[b][:t]); a copy only when a request has a grammar. What log-probabilities are read from: vLLM
        applies the grammar's bitmask to the logits before its sampler takes their raw log-softmax."""
        constrained = [b for b, s in enumerate(seqs) if s.grammar is not None]
        if not constrained:
            return logits
        logits = logits.clone()
        TargetScorer._mask_grammars(logits, seqs, constrained, drafted)
        return logits

    def _scored(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]] | None = None) -> torch.Tensor:
        """The target's distribution as the request constrains it: logits [B, T, V] already grammar-masked
        (_grammar_masked), row t deciding output token len(output) + t + 1, after drafted[b][:t] (the speculation
        a verify scores). vLLM's order after the grammar: logit bias and allowed tokens (spec/logit_bias.py),
        bad words (spec/bad_words.py: a mask, so its place changes nothing), penalties (spec/penalties.py), then
        EOS and stop_token_ids at -inf where that is <= min_tokens; a copy only when a request asks for any.
        Sampling and verification both use these, so every path samples the same distribution;
        log-probabilities are read before these (vLLM's raw default)."""
        biased = [b for b, s in enumerate(seqs) if s.params.biased]
        penalized = [b for b, s in enumerate(seqs) if s.params.penalized]
        banning = [b for b, s in enumerate(seqs) if s.params.banned_words]
        early = [(b, s.params.min_tokens - len(s.output_token_ids)) for b, s in enumerate(seqs) if s.params.min_tokens]
        early = [(b, n) for b, n in early if n > 0]
        if not early and not penalized and not biased and not banning:
            return logits  # the common round: no copy, no further call
        logits = logits.clone()
        self._mask_bad_words(logits, seqs, banning, drafted)
        for b in biased:  # one row, added to every position of the sequence
            logits[b] += self._bias_row(seqs[b], logits.device)
        if penalized:
            logits[penalized] = self._penalized(logits[penalized], [seqs[b] for b in penalized],
                                                [drafted[b] for b in penalized] if drafted else [[]] * len(penalized))
        self._hold_back_ends(logits, seqs, early)
        return logits

    @staticmethod
    def _first_empty_rows(scored: torch.Tensor, seqs: list[Sequence]) -> dict[int, int]:
        """{b: the first row of scored [B, T, V] whose every logit is -inf} for the sequences that have one: their
        allowed_token_ids, bad_words and min_tokens leave no token there (a finite logit_bias cannot; a grammar
        with min_tokens or allowed_token_ids is refused up front)."""
        masking = [b for b, s in enumerate(seqs) if s.params.biased or s.params.banned_words
                   or s.params.min_tokens > len(s.output_token_ids)]
        if not masking:
            return {}
        # a row's max is -inf iff all of it is (NaN stays not empty): one pass over scored, no [R, T, V] copy,
        # and one small [R, T] transfer (one sync)
        empty = (scored.amax(dim=-1)[masking] == float("-inf")).tolist()
        return {b: row.index(True) for b, row in zip(masking, empty) if True in row}

    @staticmethod
    def _without_empty_rows(scored: torch.Tensor, empty: dict[int, int]) -> torch.Tensor:
        """scored with each empty row, and the rows after it, at 0 (uniform): what is drawn there is never
        committed (_fail_at_empty_rows), and a row of NaN probabilities is no input to sample or verify from."""
        if not empty:
            return scored
        scored = scored.clone()
        for b, f in empty.items():
            scored[b, f:] = 0.0
        return scored

    @staticmethod
    def _fail_at_empty_rows(seqs: list[Sequence], empty: dict[int, int], accepted: list[int]) -> None:
        """A sequence whose verification reached its empty row f (every drafted token before it accepted) keeps
        x_1..x_f, the round's last token (drawn from row f) then failing it with seq.error; an empty row past a
        rejection decides nothing. accepted (k* per sequence; 0 for a plain draw) is clamped in place."""
        for b, f in empty.items():
            if accepted[b] >= f:
                accepted[b], s = f, seqs[b]
                grammar = " with its structured outputs grammar" if s.grammar is not None else ""
                s.error = s.error or NoTokenAllowed(  # (a grammar that failed while scoring fails it first)
                    f"no token is allowed at output position {len(s.output_token_ids) + f} (counting from 0): this "
                    f"request's allowed_token_ids, bad_words and min_tokens{grammar} together exclude every token "
                    "there")

    @staticmethod
    def _mask_grammars(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                       drafted: list[list[int]] | None) -> None:
        """In place: row t of each of `rows` keeps what its grammar allows after the output and drafted[b][:t].
        A grammar that fails marks its sequence (seq.error) and leaves its row unmasked: that request fails
        alone after this round (Engine._append), not the batch."""
        for b in rows:
            try:
                masks = seqs[b].grammar.row_masks(drafted[b] if drafted else [], logits.shape[1])
            except GrammarError as err:
                seqs[b].error = err
                continue
            logits[b].masked_fill_(~masks.to(logits.device), float("-inf"))

    @staticmethod
    def _mask_bad_words(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                        drafted: list[list[int]] | None) -> None:
        """In place: row t of each of `rows` bars the bad words the output and drafted[b][:t] would complete."""
        for b in rows:
            masks = bad_words_mask(seqs[b].output_token_ids, drafted[b] if drafted else [], logits.shape[1],
                                   seqs[b].params.banned_words, logits.shape[2])
            logits[b].masked_fill_(masks.to(logits.device), float("-inf"))

    def _hold_back_ends(self, logits: torch.Tensor, seqs: list[Sequence], early: list[tuple[int, int]]) -> None:
        """In place: every eos id and stop_token_ids at -inf in the first n rows of each (b, n) of `early`, the
        positions still short of min_tokens; ids past the vocabulary have no logit to bar. Under ignore_eos too:
        vLLM's min_tokens bars its all_stop_token_ids, which keep the eos ids whatever ignore_eos says."""
        for b, n in early:
            ends = sorted(self.eos_token_ids | set(seqs[b].params.stop_token_ids))
            logits[b, :n, [t for t in ends if t < self.vocab_size]] = float("-inf")

    def _penalized(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]]) -> torch.Tensor:
        """logits [R, T, V] of penalized sequences with their penalties, all rows in one pass."""
        for s in seqs:  # the prompt's tokens never change: one scan per request
            if s.prompt_mask_row is None:
                s.prompt_mask_row = prompt_mask(s.prompt_token_ids, self.vocab_size).to(logits.device)
        settings = [(s.params.presence_penalty, s.params.frequency_penalty, s.params.repetition_penalty) for s in seqs]
        return penalize_batch(logits, torch.stack([s.prompt_mask_row for s in seqs]),
                              [s.output_token_ids for s in seqs], drafted, settings)

    def _bias_row(self, s: Sequence, device) -> torch.Tensor:
        """The request's logit bias and allowed tokens as one [V] row, built at its first use."""
        if s.logit_bias_row is None:
            s.logit_bias_row = bias_row(s.params.logit_bias, s.params.allowed_token_ids, self.vocab_size).to(device)
        return s.logit_bias_row

    def check_lora(self, request) -> None:
        """A request's LoRARequest as it enters the engine: refused (ValueError) without enable_lora, or when its
        lora_int_id named another lora_path before."""
        if request is not None and self.loras is None:
            raise ValueError("lora_request given, but LoRA is off for this engine: start it with enable_lora=True")
        if self.loras is not None:
            self.loras.note(request)

    def can_start(self, s: Sequence, live: list[Sequence]) -> bool:
        """Whether s's adapter has a slot or can get one now (live: the sequences holding rows)."""
        return self.loras is None or self.loras.can_start(s.lora_request, _adapters(live))

    def start(self, s: Sequence, live: list[Sequence]) -> None:
        """Give s its KV row (through its adapter's slot, loaded now if need be), holding what the prefix cache
        or a live sequence (running or prefilling) has of its prompt (s.prefilled tokens), in its cache
        namespace (its cache_salt and adapter). A request for prompt log-probabilities needs every prompt row's
        logits: it reuses nothing. A start that raises (its adapter failed to load, the copy failed) leaves s
        without a row."""
        slot = self.loras.acquire(s.lora_request, _adapters(live)) if self.loras is not None else None
        wanted = s.prompt_token_ids if s.params.prompt_logprobs is None else ()
        # Live sequences' tokens only for a prompt long enough to copy from one (PrefixCache._lookup's rule): the
        # dict costs a list per live sequence a start, O(batch) for nothing under short prompts (n samples of one).
        sources = {x.seq_id: x.tokens for x in live} if self._may_reuse(wanted) else {}
        fresh = not holds(self.runner, s.seq_id)
        try:
            s.prefilled = s.metrics.num_cached_tokens = self.prefixes.start(s.seq_id, wanted, sources,
                                                                            s.cache_namespace, slot)
        except BaseException:
            # A failed start holds nothing (the prefix cache may have added the row before its copy failed): the
            # engine keeps s in none of its lists, so nothing else would ever free it.
            if fresh and holds(self.runner, s.seq_id):
                self.prefixes.namespaces.pop(s.seq_id, None)
                self.runner.free(s.seq_id)
            raise

    def _may_reuse(self, wanted) -> bool:
        return self.prefixes.enabled and reusable_len(len(wanted), len(wanted), self.prefixes.min_reuse) > 0

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """Run the rest of the (started) prompts; sample each sequence's first token (its KV then holds the prompt)."""
        plain = [s for s in seqs if s.params.prompt_logprobs is None]
        last = dict(zip((s.seq_id for s in plain), self.runner.extend(
            [s.seq_id for s in plain], [s.prompt_token_ids[s.prefilled:] for s in plain], [1] * len(plain)))) if plain else {}
        for s in seqs:
            if s.params.prompt_logprobs is not None:
                last[s.seq_id] = self._score_prompt(s, len(s.prompt_token_ids))
            s.prefilled = len(s.prompt_token_ids)
        return self._sample(torch.cat([last[s.seq_id] for s in seqs]), seqs)

    def prefill_part(self, s: Sequence, n: int) -> None:
        """Run the next n prompt tokens of s, never its last one (prefill samples the first token from it),
        so that a long prompt takes several engine steps and the running sequences' rounds go on between."""
        if not 0 < n < len(s.prompt_token_ids) - s.prefilled:
            raise ValueError(f"prefill_part: {n} tokens of the {len(s.prompt_token_ids) - s.prefilled} left")
        if s.params.prompt_logprobs is not None:
            self._score_prompt(s, s.prefilled + n)
        else:
            self.runner.extend([s.seq_id], [s.prompt_token_ids[s.prefilled:s.prefilled + n]], [1])
        s.prefilled += n

    def _score_prompt(self, s: Sequence, end: int) -> torch.Tensor:
        """Run prompt tokens s.prefilled..end-1 in pieces of PROMPT_LOGPROBS_ROWS, each piece's logits
        reduced to log-probabilities at once: [P, V] logits would not fit for a long prompt on a large
        vocabulary. Row i scores prompt token i + 1 (the first has none). Returns the last row's logits [1, V]."""
        prompt = s.prompt_token_ids
        if s.prefilled == 0:
            s.prompt_logprobs = [None]
        for lo in range(s.prefilled, end, PROMPT_LOGPROBS_ROWS):
            piece = prompt[lo:min(lo + PROMPT_LOGPROBS_ROWS, end)]
            [logits] = self.runner.extend([s.seq_id], [piece], [len(piece)])
            following = prompt[lo + 1:lo + 1 + len(piece)]  # the prompt's last row scores no prompt token
            s.prompt_logprobs += token_logprobs(logits[:len(following)], following, s.params.prompt_logprobs)
        return logits[-1:]

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """Plain autoregressive step: run each sequence's last token, sample the next."""
        logits = self.runner.extend([s.seq_id for s in seqs], [[s.last_token] for s in seqs], [1] * len(seqs))
        return self._sample(torch.cat(logits), seqs)

    def verify(self, seqs: list[Sequence], coupling: Callable[[], Coupling | None] | None = None
               ) -> tuple[list[int], list[int]]:
        """Score [b, x_1..x_K] in one forward, then lossless rejection sampling; coupling(), asked after
        the forward (the draft's plans come while it runs), gives sampled rows' candidates to draw the bonus
        against (spec/coupled.py).

        Returns (accepted k, bonus token) per sequence; the target KV keeps P + x_1..x_k.
        """
        k = len(seqs[0].speculation.tokens)
        ids = [s.seq_id for s in seqs]
        inputs = [[s.last_token] + s.speculation.tokens.tolist() for s in seqs]
        drafted = [x[1:] for x in inputs]
        logits = self._grammar_masked(torch.stack(self.runner.extend(ids, inputs, [k + 1] * len(seqs))), seqs, drafted)
        scored = self._scored(logits, seqs, drafted)  # [B, K+1, V]
        empty = self._first_empty_rows(scored, seqs)
        scored = self._without_empty_rows(scored, empty)
        if _all_greedy(seqs):  # one argmax instead of [B, K+1, V] probabilities: the same tokens
            result = greedy_verify(scored, torch.stack([s.speculation.tokens for s in seqs]).to(logits.device))
        else:
            rows = RowSampling.of([s.params for s in seqs], scored.device, rows_per_seq=k + 1)
            p = sampling_probs(scored.flatten(0, 1), rows).view(len(seqs), k + 1, -1)
            tokens, q = stack_proposals([s.speculation for s in seqs], self.vocab_size)  # on the CPU, as they came
            q = None if q is None else q.to(p.device)
            result = verify(p, tokens.to(p.device), q, [s.generator for s in seqs], coupling() if coupling else None)
        accepted, bonus = result.accepted.tolist(), result.bonus.tolist()
        self._fail_at_empty_rows(seqs, empty, accepted)
        for i, (s, n, t) in enumerate(zip(seqs, accepted, bonus)):
            self.runner.truncate(s.seq_id, s.num_tokens + n)
            if s.params.logprobs is not None:  # positions 0..k scored x_1..x_k and then t*
                s.round_logprobs = token_logprobs(logits[i, :n + 1], inputs[i][1:n + 1] + [t], s.params.logprobs)
        return accepted, bonus

    def release(self, seq: Sequence) -> None:
        self.prefixes.finish(seq.seq_id, seq.tokens)

    def holds(self, seq: Sequence) -> bool:
        """Whether seq still has its KV row (started, not yet released)."""
        return holds(self.runner, seq.seq_id)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per sequence from its row of logits [B, V]."""
        masked = self._grammar_masked(logits[:, None], seqs)  # (what the logprobs are read from)
        scored = self._scored(masked, seqs)
        empty = self._first_empty_rows(scored, seqs)
        scored, logits = self._without_empty_rows(scored, empty)[:, 0], masked[:, 0]
        self._fail_at_empty_rows(seqs, empty, [0] * len(seqs))
        if _all_greedy(seqs):
            tokens = greedy_tokens(scored).tolist()
        else:
            probs = sampling_probs(scored, RowSampling.of([s.params for s in seqs], scored.device))
            tokens = sample(probs, [s.generator for s in seqs]).tolist()
        for i, (s, t) in enumerate(zip(seqs, tokens)):
            if s.params.logprobs is not None:
                s.round_logprobs = token_logprobs(logits[i:i + 1], [t], s.params.logprobs)
        return tokens


def holds(runner, seq_id) -> bool:
    """Whether the runner has a row for seq_id (its length() refuses an unknown one)."""
    try:
        runner.length(seq_id)
        return True
    except ValueError:
        return False


def _adapters(seqs: list[Sequence]) -> set[int]:
    return {s.lora_request.lora_int_id for s in seqs if s.lora_request is not None}


def _all_greedy(seqs: list[Sequence]) -> bool:
    return all(s.params.temperature == 0 for s in seqs)
