"""LLM.generate's progress bar (vLLM's use_tqdm): shown on a terminal, never elsewhere, same outputs."""
from __future__ import annotations

import io
import sys

from engine_helpers import Terminal
from saguaro_dist import LLM, SamplingParams


def test_the_bar_counts_prompts_on_a_terminal_and_changes_nothing(tiny_checkpoint, monkeypatch):
    prompts, params = [[3, 4, 5], [6, 7, 8, 9], [10, 11]], SamplingParams(temperature=0, max_tokens=5)
    terminal = Terminal()
    with LLM(model=tiny_checkpoint("llama"), mode="ar") as llm:
        monkeypatch.setattr(sys, "stderr", terminal)
        shown = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        bar = terminal.getvalue()
        hidden = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar by default
        piped = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert sys.stderr.getvalue() == ""
    assert "Processed prompts" in bar and "3/3" in bar and "toks/s" in bar
    assert terminal.getvalue() == bar  # use_tqdm=False wrote nothing
    assert [o.token_ids for o in shown] == [o.token_ids for o in hidden] == [o.token_ids for o in piped]
