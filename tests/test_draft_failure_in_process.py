"""A draft in the engine's own process (the thread executor) that raises something no transport maps (a bug,
out of memory) costs its sequences a fast-backup round and a fresh prefill, as a draft server's error status
does: it used to fail the engine step, every request in flight. Greedy output stays plain decoding's."""
from __future__ import annotations

import pytest
from engine_helpers import PROMPTS, assert_greedy_equal, close_pair, hf_greedy

from saguaro_dist.config import Config
from saguaro_dist.engine.build import build_draft_worker, make_runner
from saguaro_dist.engine.draft_backend import LocalDraftBackend
from saguaro_dist.engine.engine import Engine
from saguaro_dist.engine.sequence import Sequence
from saguaro_dist.sampling_params import SamplingParams

TOKENS = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return close_pair(tmp_path_factory.mktemp("draft_failure_pair"))


class FailingOnce:
    """worker.<name> raises `error` at its `at`-th call, then works again."""

    def __init__(self, worker, name: str, at: int, error: Exception):
        self.calls, self.at, self.error = 0, at, error
        self._real = getattr(worker, name)
        setattr(worker, name, self)

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self._real(*args)


def run(config: Config, fail) -> tuple[list[list[int]], FailingOnce]:
    worker = build_draft_worker(config)
    failing = fail(worker)
    engine = Engine(config, make_runner(config.model, config), LocalDraftBackend(worker), None, set())
    try:
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.add(Sequence(i, str(i), list(prompt), params))
        done = {}
        while engine.has_work():
            for u in engine.step():
                assert u.error is None, u.error
                if u.finished:
                    done[u.seq.seq_id] = u.seq.output_token_ids
        return [done[i] for i in range(2)], failing
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("call, at", [("jit_draft", 3), ("prefill", 1)])
def test_a_draft_error_in_process_costs_speed_not_the_requests(pair, mode, call, at):
    """Old: the RuntimeError left the engine step, and the engine loop failed every request in flight."""
    config = Config(model=pair["target"], draft=pair["close"], mode=mode, k=3, fan_out=6, fallback="neural",
                    tree_policy="never" if mode == "ssd" else "auto", draft_executor="thread", draft_threads=1)
    outputs, failing = run(config, lambda w: FailingOnce(w, call, at, RuntimeError("a draft that failed once")))
    assert failing.calls > at  # it failed, and was asked again (a fresh prefill, then drafts)
    model = pair["model"]
    for got, prompt in zip(outputs, PROMPTS[:2]):
        assert_greedy_equal(got, hf_greedy(model, prompt, TOKENS), prompt, model)
