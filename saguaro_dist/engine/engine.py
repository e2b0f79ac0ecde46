"""The engine: continuous batching over one round loop (AR, SD or SSD). Driven by one thread."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from saguaro_dist.config import Config, SchedulingPolicy
from saguaro_dist.engine.committing import Committing, Update
from saguaro_dist.engine.detokenizer import Detokenizer
from saguaro_dist.engine.lora_slots import AdapterLoadError
from saguaro_dist.engine.metrics import EngineLoad, EngineMetrics
from saguaro_dist.engine.rounds import build_loop
from saguaro_dist.engine.sequence import FinishReason, Sequence, SeqStatus
from saguaro_dist.engine.structured import GrammarCompiler
from saguaro_dist.engine.target import TargetScorer
from saguaro_dist.model.prefix_cache import MIN_REUSE, common_prefix_len, reusable_len

log = logging.getLogger(__name__)


def check_prompt_ids(prompt: list[int], vocab_size: int) -> None:
    """A prompt the model can read: not empty, every id inside the vocabulary."""
    if not prompt:
        raise ValueError("empty prompt")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")


class ReleaseError(RuntimeError):
    """Freeing finished sequences' state failed (its __cause__) after a step had finished them: `updates` are
    due to their callers before the engine recovers (a request that completed is not failed by it)."""

    def __init__(self, updates: list[Update], cause: Exception):
        super().__init__(f"releasing finished sequences failed: {cause!r}")
        self.updates = updates


class Engine(Committing):
    def __init__(self, config: Config, target_runner, draft_backend, tokenizer, eos_token_ids: set[int]):
        self.config = config
        self.metrics = EngineMetrics()
        self.target = TargetScorer(target_runner, frozenset(eos_token_ids), config.enable_prefix_caching,
                                   config.max_cpu_loras)
        self.vocab_size, self.max_model_len = target_runner.vocab_size, target_runner.max_model_len
        # Where a sequence ends at "length", in every mode: a speculative round at the end scores positions past
        # it in the target's position slack (engine/build.py), and Committing cuts their tokens.
        self.context_len = self.max_model_len
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
        self._retire()  # (failing, a failed step's case: no request here completed)
        self._free_removed_adapters()
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
        self._free_finished(updates)
        self.metrics.step_s += time.perf_counter() - start
        return updates

    def close(self) -> None:
        self.loop.close()

    def reset_prefix_cache(self) -> None:
        """Forget every kept prefix, target and draft (vLLM's reset_prefix_cache): later prompts compute
        theirs afresh. Running sequences keep their rows; only finished ones' kept rows go."""
        self.loop.reset_prefix_cache()

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's remove_lora (a runtime unload): its slot is free for another adapter once no running sequence
        runs it (those finish on its weights); whether the engine held anything of it."""
        if self.target.loras is None:
            return False
        return self.target.loras.remove(lora_int_id, self._named_adapters())

    def _named_adapters(self) -> set[int]:
        """The adapters of every sequence here, queued ones too: a removed one's host copy stays while a request
        waiting for a slot still names it (its folder may be gone: an RL loop deletes the checkpoint it replaced)."""
        seqs = [*self.waiting, *self.prefilling, *self.running]
        return {s.lora_request.lora_int_id for s in seqs if s.lora_request is not None}

    def _free_removed_adapters(self) -> None:
        """Removed adapters' slots, once the sequences that ran them were released (cheap: most steps none)."""
        if self.target.loras is not None and self.target.loras.removed:
            self.target.loras.free_removed(self._named_adapters())

    def reset(self) -> None:
        """After a failed step: drop every request (their callers were told) and free what each holds, each once and
        on its own (one failed release keeps no other's rows), then the kept prefixes (maybe half written) anyway."""
        for s in list(self.waiting) + self.prefilling + self.running:
            self._finish(s, FinishReason.ABORT)
        prefilling, running = self.prefilling, self.running
        self.waiting.clear()
        self.prefilling, self.running = [], []
        self._emitted.clear()
        release_each(prefilling, self.target.release)  # (the draft has none of a prefilling sequence yet)
        release_each(running, lambda s: self.loop.release([s]))
        attempt(self.target.prefixes.clear, "clear the prefix cache")
        attempt(self._free_removed_adapters, "free removed LoRA adapters' slots")

    # ---- steps ------------------------------------------------------------------------------
    def _admit(self) -> list[Update]:
        failed = self._start_waiting()
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

    def _start_waiting(self) -> list[Update]:
        """Waiting requests take the free batch slots; the updates of those that failed alone. A start that raises
        holds nothing (TargetScorer.start): it and those deferred before it wait again, in their places."""
        free = self.config.max_batch_size - len(self.running) - len(self.prefilling)
        deferred, failed = [], []
        try:
            while self.waiting and free > 0:
                s = self.waiting.popleft()
                # Deferred until it has started: whatever raises below (can_start, _prefix_coming, _start),
                # it goes back in its place rather than out of every list, its request never answered.
                deferred.append(s)
                if not self.target.can_start(s, self.running + self.prefilling):
                    continue  # its LoRA adapter has no slot free (max_loras): it waits, in its place
                # A deferred one keeps its slot too: else a later request took it (first come, first served
                # broken), and held it for its whole generation while the deferred one waited.
                free -= 1
                if self._prefix_coming(s):
                    continue
                failed += self._start(s)
                deferred.pop()  # started (or failed alone, its update in `failed`)
        finally:
            self.waiting.extendleft(reversed(deferred))
        return failed

    def _prefix_coming(self, s: Sequence) -> bool:
        """Whether a sequence admitted before s, still prefilling, is about to compute a prefix of s's
        prompt (n samples of one prompt, a batch sharing a system prompt): s then waits a step and
        copies it (prefix caching's live sources) instead of computing it alongside."""
        if not self.config.enable_prefix_caching or s.params.prompt_logprobs is not None:
            return False
        # Worth waiting for: what s could copy once x's prefill ends (start()'s rule: reusable_len) beyond what x
        # holds now. Lengths first: a step admitting a batch of short prompts would else compare every pair of them.
        # A prompt too short to copy MIN_REUSE tokens of waits for none: O(1), not a scan of the prefill queue
        # per start (n samples of a short prompt scanned every slot's sequence, ~9% of such a run's engine CPU).
        n = len(s.prompt_token_ids)
        if reusable_len(n, n) < MIN_REUSE:
            return False
        namespace = s.cache_namespace
        return any(reusable_len(min(n, len(x.prompt_token_ids)), n) - x.prefilled >= MIN_REUSE
                   and x.cache_namespace == namespace
                   and reusable_len(common_prefix_len(x.prompt_token_ids, s.prompt_token_ids), n)
                   - x.prefilled >= MIN_REUSE
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
        except BaseException:
            s.status = SeqStatus.WAITING  # it holds nothing (TargetScorer.start)
            raise
        self.prefilling.append(s)
        self.metrics.prompt_tokens += len(s.prompt_token_ids)
        # Queries: prompts that looked the cache up (vLLM's record_prefix_cache_stats; not off, not prompt_logprobs)
        if self.config.enable_prefix_caching and s.params.prompt_logprobs is None:
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

    def _free_finished(self, updates: list[Update]) -> None:
        """Finished sequences leave the prefill queue and the batch, and their state is freed; where that fails,
        ReleaseError carries the step's `updates` (due to their callers first)."""
        try:
            self._drop_prefilling()
            self._retire()
            self._free_removed_adapters()
        except Exception as err:
            raise ReleaseError(updates, err) from err

    def _drop_prefilling(self) -> None:
        """Finished (aborted) sequences leave the prefill queue, then the target frees each one's rows."""
        gone = [s for s in self.prefilling if s.finished]
        if gone:
            self.prefilling = [s for s in self.prefilling if not s.finished]
            failure = release_each(gone, self.target.release)
            if failure is not None:
                raise failure

    def _retire(self) -> None:
        """Finished sequences leave the batch, then their state is freed (the draft's in one message): reset() must
        not free again what a release that failed part way did free (the runner refused it, and the rest leaked)."""
        done = [s for s in self.running if s.finished]
        if not done:
            return
        self.running = [s for s in self.running if not s.finished]
        for s in done:
            self._emitted.pop(s.seq_id, None)
        try:
            self.loop.release(done)
        except Exception:
            # Part way (the target's side goes first, one by one): those it still holds, one at a time
            # (the loop released every draft side already: the target's rows alone, not the draft's twice)
            release_each([s for s in done if self.target.holds(s)], self.target.release)
            raise


def attempt(action: Callable[[], object], what: str) -> Exception | None:
    """action(); what it raised, logged (None if nothing): recovery goes on past one failure."""
    try:
        action()
        return None
    except Exception as err:  # noqa: BLE001 - the caller goes on, and may raise it after the rest
        log.exception("could not %s", what)
        return err


def release_each(seqs: list[Sequence], release: Callable[[Sequence], object]) -> Exception | None:
    """release(s) for each of seqs, whatever the others' do; the first failure (each is logged), None if none."""
    failures = [attempt(lambda s=s: release(s), f"release sequence {s.seq_id} ({s.request_id!r})") for s in seqs]
    return next((f for f in failures if f is not None), None)


def adapter_names(seqs) -> tuple[str, ...]:
    """The LoRA adapters (lora_name) the sequences run, once each, in order of first appearance."""
    return tuple(dict.fromkeys(s.lora_request.lora_name for s in seqs if s.lora_request is not None))
