"""Scheduling policies (vLLM's --scheduling-policy): which waiting request takes a free batch slot."""
from __future__ import annotations

import pytest

from saguaro_dist import LLM, SamplingParams

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def admission_order(outs) -> list[int]:
    """Prompt indices in the order their first tokens came (one batch slot: one request at a time).
    By the clock, not by time to first token: requests arrive microseconds to milliseconds apart, and
    on a busy machine a later arrival's wait can be shorter than an earlier one's (CI saw [0, 2, 1, 3])."""
    return sorted(range(len(outs)), key=lambda i: outs[i].metrics.first_token_time)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_priority_admits_the_most_urgent_first_and_fcfs_within_a_priority(tiny_llama_pair, mode):
    target, draft = tiny_llama_pair
    kwargs = dict(model=target, draft=draft if mode == "ssd" else None, mode=mode, k=2, fan_out=6, max_batch_size=1)
    with LLM(scheduling_policy="fcfs", **kwargs) as fcfs:
        plain = fcfs.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    with LLM(scheduling_policy="priority", **kwargs) as llm:
        ranked = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, priority=[5, 0, -1, 0])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]  # the order never changes what is generated
    assert admission_order(plain) == [0, 1, 2, 3]
    assert admission_order(ranked) == [2, 1, 3, 0]


def test_a_priority_server_takes_the_requests_priority():
    """Over HTTP: vLLM's `priority` field reaches the engine (a FCFS server refuses it: test_serve_app)."""
    import httpx

    from http_helpers import serve_on_loopback
    from saguaro_dist.demo import demo_pair
    from saguaro_dist.serve.api import ServerOptions, create_app
    target, _ = demo_pair()
    with LLM(model=target, mode="ar", scheduling_policy="priority") as llm, \
            serve_on_loopback(create_app(llm, ServerOptions("demo"))) as url:
        body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "priority": -3}
        r = httpx.post(url + "/completions", json=body, timeout=60)
        want = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=8))[0].text
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
