"""The engine: continuous batching over one round loop (AR, SD or SSD). Driven by one thread."""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

from saguaro_dist.config import Config, Mode, SchedulingPolicy
from saguaro_dist.engine.detokenizer import DecodeState, Detokenizer, find_stop, stable_prefix
from saguaro_dist.engine.lora_slots import AdapterLoadError
from saguaro_dist.engine.metrics import EngineLoad, EngineMetrics
from saguaro_dist.engine.rounds import build_loop
from saguaro_dist.engine.sequence import FinishReason, OutputKind, Sequence, SeqStatus
from saguaro_dist.engine.structured import GrammarCompiler, GrammarError
from saguaro_dist.engine.target import TargetScorer
from saguaro_dist.model.prefix_cache import MIN_REUSE, common_prefix_len

log = logging.getLogger(__name__)


def usable_context(max_model_len: int, config: Config) -> int:
    """The positions a sequence may fill: a speculative round scores K+1 positions past the last token,
    which must stay inside the model (LLM.max_model_len is the same length)."""
    return max_model_len - (0 if config.mode is Mode.AR else config.k + 1)


def check_prompt_ids(prompt: list[int], vocab_size: int) -> None:
    """A prompt the model can read: not empty, every id inside the vocabulary."""
    if not prompt:
        raise ValueError("empty prompt")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")


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


class Engine:
    def __init__(self, config: Config, target_runner, draft_backend, tokenizer, eos_token_ids: set[int]):
        self.config = config
        self.metrics = EngineMetrics()
        self.target = TargetScorer(target_runner, frozenset(eos_token_ids), config.enable_prefix_caching,
                                   config.max_cpu_loras)
        self.vocab_size, self.max_model_len = target_runner.vocab_size, target_runner.max_model_len
        self.context_len = usable_context(self.max_model_len, config)  # where a sequence ends at "length"
        self.loop = build_loop(config, self.target, draft_backend, self.metrics)
        self.draft = draft_backend
        self.detok = Detokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids  # every id that ends generation (the generation config's, the tokenizer's)
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None  # vLLM's EOS: no stop_reason
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # hold batch slots; their prompts run part by part (_prefill_in_budget)
        self.running: list[Sequence] = []
        self._emitted: dict[int, tuple[str, int]] = {}  # seq_id -> (text, tokens) already streamed

    def add(self, seq: Sequence) -> None:
        """Queue seq; a prompt the engine cannot run is refused here (ValueError: its caller alone fails)."""
        self._check_prompt(seq.prompt_token_ids)
        self.target.check_lora(seq.lora_request)
        if seq.params.structured_outputs is not None:
            seq.grammar = self.grammars.state(seq.params)
        if self.config.scheduling_policy is SchedulingPolicy.PRIORITY:
            # behind every waiting request of the same or a more urgent priority: stable, so FCFS within one
            place = next((i for i, w in enumerate(self.waiting) if w.priority > seq.priority), len(self.waiting))
            self.waiting.insert(place, seq)
        else:
            self.waiting.append(seq)

    def _check_prompt(self, prompt: list[int]) -> None:
        """vLLM's edge: a prompt with no room left in the context is refused with the lengths. Unchecked, its
        prefill failed the whole step, and every request in flight with it. A prompt that fits with a
        max_tokens (or None) past the context's end runs to that end (finish "length", as vLLM caps it)."""
        check_prompt_ids(prompt, self.vocab_size)
        if len(prompt) >= self.context_len:
            raise ValueError(f"The prompt (length {len(prompt)}) leaves no room to generate in the maximum model "
                             f"length of {self.context_len}: shorten it, or raise max_model_len")

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def load(self) -> EngineLoad:
        """Requests by state, and the target KV they hold (a running request's: all its tokens but the
        pending last one; a prefilling one's: what of its prompt has run)."""
        held = sum(s.num_tokens - 1 for s in self.running) + sum(s.prefilled for s in self.prefilling)
        live, drafts = self.draft.workers() if self.draft is not None else (0, 0)
        max_lora = self.config.max_loras if self.target.loras is not None else 0
        running, waiting = ((adapter_names(self.running + self.prefilling), adapter_names(self.waiting)) if max_lora
                            else ((), ()))  # (a snapshot a step: no walk of the waiting queue without LoRA)
        return EngineLoad(len(self.running) + len(self.prefilling), len(self.waiting), held,
                          self.config.max_batch_size * self.max_model_len, live, drafts, running, waiting, max_lora)

    def abort(self, request_id: str) -> list[Update]:
        """Drop a request wherever it is; its slot is free at once."""
        gone = [s for s in list(self.waiting) + self.prefilling + self.running if s.request_id == request_id]
        for s in gone:
            self._finish(s, FinishReason.ABORT)
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self._drop_prefilling()
        self._retire()
        return [Update(s, "", [], True) for s in gone]

    def step(self) -> list[Update]:
        """Admit waiting requests, then one round for every running sequence."""
        start = time.perf_counter()
        updates = self._admit()
        running = [s for s in self.running if not s.finished]
        if running:
            self.loop.prepare(running)
            gained = self.loop.verify(running)
            now = time.perf_counter()
            for s, tokens in zip(running, gained):
                self._append(s, tokens, now)
            updates += self._updates(running, now)
            self.metrics.rounds += 1
        self._retire()
        self.metrics.step_s += time.perf_counter() - start
        return updates

    def close(self) -> None:
        self.loop.close()

    def reset_prefix_cache(self) -> None:
        """Forget every kept prefix, target and draft (vLLM's reset_prefix_cache): later prompts compute
        theirs afresh. Running sequences keep their rows; only finished ones' kept rows go."""
        self.loop.reset_prefix_cache()

    def reset(self) -> None:
        """After a failed step: drop every request (their callers were told) and free their state."""
        for s in list(self.waiting) + self.prefilling + self.running:
            self._finish(s, FinishReason.ABORT)
        self.waiting.clear()
        try:
            self._drop_prefilling()
            self._retire()
            self.target.prefixes.clear()  # a failed forward may have left rows half written
        except Exception:  # noqa: BLE001 - the failure may have taken the model with it
            log.exception("could not release state after a failed step")
            self.prefilling, self.running = [], []

    # ---- steps ------------------------------------------------------------------------------
    def _admit(self) -> list[Update]:
        free = self.config.max_batch_size - len(self.running) - len(self.prefilling)
        deferred, failed = [], []
        while self.waiting and free > 0:
            s = self.waiting.popleft()
            if not self.target.can_start(s, self.running + self.prefilling):
                deferred.append(s)  # its LoRA adapter has no slot free (max_loras): it waits, in its place
                continue
            # A deferred one keeps its slot too: else a later request took it (first come, first served
            # broken), and held it for its whole generation while the deferred one waited.
            free -= 1
            if self._prefix_coming(s):
                deferred.append(s)
                continue
            failed += self._start(s)
        self.waiting.extendleft(reversed(deferred))
        start = time.perf_counter()
        new = self._prefill_in_budget()
        try:
            first = self.loop.admit(new) if new else []
        except BaseException:
            # Back in the prefill queue, where reset() frees their KV rows: in neither list (as they were),
            # reset() missed them and a failed prefill's rows stayed taken for good.
            self.prefilling[:0] = new
            raise
        self.metrics.prefill_s += time.perf_counter() - start
        if not new:
            return failed
        for s in new:
            s.status = SeqStatus.RUNNING
        self.running += new
        now = time.perf_counter()
        for s, t in zip(new, first):
            self._append(s, [t], now)
        return failed + self._updates(new, now)

    def _prefix_coming(self, s: Sequence) -> bool:
        """Whether a sequence admitted before s, still prefilling, is about to compute a prefix of s's
        prompt (n samples of one prompt, a batch sharing a system prompt): s then waits a step and
        copies it (prefix caching's live sources) instead of computing it alongside."""
        if not self.config.enable_prefix_caching or s.params.prompt_logprobs is not None:
            return False
        # Lengths first: a step admitting a batch of short prompts would else compare every pair of them.
        n = len(s.prompt_token_ids)
        return any(x.cache_namespace == s.cache_namespace and min(n, len(x.prompt_token_ids)) - x.prefilled >= MIN_REUSE
                   and common_prefix_len(x.prompt_token_ids, s.prompt_token_ids) - x.prefilled >= MIN_REUSE
                   for x in self.prefilling)

    def _start(self, s: Sequence) -> list[Update]:
        """s takes a batch slot and its KV row, with whatever prompt prefix the cache holds; [] or, where its
        LoRA adapter failed to load, its last update (it fails alone)."""
        s.status = SeqStatus.PREFILLING
        try:
            self.target.start(s, self.running + self.prefilling)
        except AdapterLoadError as err:
            log.warning("request %s failed alone: %s", s.request_id, err)
            s.error = err
            self._finish(s, FinishReason.ABORT)
            return [Update(s, "", [], True, error=err)]
        self.prefilling.append(s)
        self.metrics.prefix_cache_queries += len(s.prompt_token_ids)
        self.metrics.prefix_cache_hits += s.prefilled
        return []

    def _prefill_in_budget(self) -> list[Sequence]:
        """The sequences whose prompts finish this step, first come first served, within
        max_num_batched_tokens prompt tokens a step. A prompt longer than what is left runs that much
        now (its last token always waits for the final prefill) and goes on next step: a long prompt
        costs the running sequences' rounds a bounded pause a step, not its whole prefill (vLLM's
        chunked prefill). Their first tokens come from loop.admit, which also prefills the draft."""
        budget, ready, now = self.config.max_num_batched_tokens, [], time.perf_counter()
        for s in self.prefilling:
            left = len(s.prompt_token_ids) - s.prefilled
            if left > budget:
                if budget > 0:
                    s.metrics.record_scheduled(now - s.arrival_time)
                    self.target.prefill_part(s, budget)
                break
            s.metrics.record_scheduled(now - s.arrival_time)
            ready.append(s)
            budget -= left
        self.prefilling = self.prefilling[len(ready):]
        return ready

    def _drop_prefilling(self) -> None:
        """Finished (aborted) sequences leave the prefill queue; the target frees what they had run."""
        for s in self.prefilling:
            if s.finished:
                self.target.release(s)
        self.prefilling = [s for s in self.prefilling if not s.finished]

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
        grammar llguidance could not follow (s.error: while scoring, or committing here) ends there alone."""
        if not s.output_token_ids:
            s.metrics.record_first_token(time.perf_counter() - s.arrival_time)
        logprobs, before = s.round_logprobs, len(s.output_token_ids)  # the target's, for these tokens (if asked)
        if logprobs:
            s.round_logprobs = []
        for i, t in enumerate(tokens):
            if s.grammar is not None and not self._committed(s, t):
                break
            s.output_token_ids.append(t)
            self.metrics.generated_tokens += 1
            if logprobs:
                s.output_logprobs.append(logprobs[i])
            self._check_stop(s, t)
            if s.finished:
                break
        self._update_text(s, now, len(s.output_token_ids) - before)

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
        if s.error is None:
            try:
                s.grammar.commit(token)
                return True
            except GrammarError as err:
                s.error = err
        log.warning("request %s failed alone: %s", s.request_id, s.error)
        self.grammars.forget(s.grammar.grammar)
        self._finish(s, FinishReason.ABORT)
        return False

    def _update_text(self, s: Sequence, now: float, new: int) -> None:
        """Decode what the last `new` tokens add to s.text; with stop strings, end s at one."""
        # Text nobody reads this round is decoded later, with the next update's (a decode in the round
        # loop costs 40-100 us a sequence: the tokenizer's tables are cold after a forward). Stop
        # strings need it every round.
        if not s.params.stop:
            if self._due(s, now):
                s.text += self._decode_more(s, self._text_ids(s), s.decode_state, s.finished)
            return
        # The round's text at once, then token by token only when it holds a stop string (once a request)
        state = replace(s.decode_state)  # (a whole copy: the prompt's end the first piece is read after too)
        text = s.text + self._decode_more(s, self._text_ids(s), state, s.finished)
        if find_stop(text, s.params.stop, after=s.stop_after) is None:
            s.text, s.decode_state = text, state
            if len(s.output_token_ids) <= s.params.min_tokens:
                s.stop_after = len(s.text)
            return
        self._stop_token_by_token(s, new)

    def _stop_token_by_token(self, s: Sequence, new: int) -> None:
        """Decode the round's tokens one at a time and end s at the one that completes a stop string past
        the first min_tokens tokens' text: the tokens of a speculative round after it are dropped, so that
        SD / SSD give AR's tokens (and logprobs), which stop there."""
        ids, first = self._text_ids(s), len(s.output_token_ids) - new
        for n in range(min(first + 1, len(ids)), len(ids) + 1):  # (an EOS alone: a final decode of what waited)
            s.text += self._decode_more(s, ids[:n], s.decode_state, s.finished and n == len(ids))
            if n <= s.params.min_tokens:
                s.stop_after = len(s.text)
                continue
            stop = find_stop(s.text, s.params.stop, keep=s.params.include_stop_str_in_output, after=s.stop_after)
            if stop is not None:
                s.text, s.stop_reason = s.text[:stop[0]], stop[1]
                self.metrics.generated_tokens -= len(s.output_token_ids) - n  # counted by _append
                del s.output_token_ids[n:], s.output_logprobs[n:]
                s.finish_reason = FinishReason.STOP  # also where max_tokens or EOS came later in the round
                s.error = None  # a grammar failure later in the round (at a token never appended) came after it
                self._finish(s, FinishReason.STOP)
                s.metrics.num_generated_tokens = len(s.output_token_ids)
                return

    def _text_ids(self, s: Sequence) -> list[int]:
        if s.finish_reason is FinishReason.STOP and not s.params.include_stop_str_in_output:
            return s.output_token_ids[:-1]  # the token that ended it (EOS, a stop_token_id) is not text, as in vLLM
        return s.output_token_ids

    def _decode_more(self, s: Sequence, ids: list[int], state: DecodeState, final: bool) -> str:
        return self.detok.decode_more(ids, state, final=final, skip_special_tokens=s.params.skip_special_tokens)

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

    def _retire(self) -> None:
        done = [s for s in self.running if s.finished]
        if done:
            self.loop.release(done)
            self.running = [s for s in self.running if not s.finished]
        for s in done:
            self._emitted.pop(s.seq_id, None)


def adapter_names(seqs) -> tuple[str, ...]:
    """The LoRA adapters (lora_name) the sequences run, once each, in order of first appearance."""
    return tuple(dict.fromkeys(s.lora_request.lora_name for s in seqs if s.lora_request is not None))
