"""A forked child of the user's process (a DataLoader worker, a fork Pool) that outlives the LLM: it holds
copies of the draft process's pipe, and shutdown() must still end the draft promptly (it took 10 s, the
grace wait, and then a SIGKILL, while the draft waited for an EOF that the forked copy kept from coming)."""
from __future__ import annotations

import os
import signal
import time

from engine_helpers import close_pair
from saguaro_dist import LLM, SamplingParams

PROMPT_BOUND_S = 5.0  # shutdown takes well under a second; the bug's grace wait took 10 s


def fork_sleeper() -> int:
    """A forked child that never touches the LLM and lives on (it is killed by the caller)."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(30)
        finally:
            os._exit(0)
    return pid


def test_shutdown_is_prompt_while_a_forked_child_lives(tmp_path):
    pair = close_pair(tmp_path)
    llm = LLM(model=pair["target"], draft=pair["close"], mode="ssd", k=3, draft_executor="process",
              target_threads=1, draft_threads=1)
    sleeper = None
    try:
        out = llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False,
                           sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 8
        sleeper = fork_sleeper()
        start = time.monotonic()
        llm.shutdown()
        took = time.monotonic() - start
        assert took < PROMPT_BOUND_S, f"shutdown took {took:.1f} s beside a forked child"
    finally:
        llm.shutdown()  # idempotent; a failed assertion above must not leave the draft process behind
        if sleeper is not None:
            os.kill(sleeper, signal.SIGKILL)
            os.waitpid(sleeper, 0)
