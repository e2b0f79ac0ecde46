"""The bench's judge of greedy departures from ar: where one is, the target's top-2 gap there, near tie or not."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from saguaro_dist.bench.departures import (NEAR_TIE, RELATIVE_NEAR_TIE, Departure, first_difference, judge, judge_cells,
                                           summary, tie_threshold)

PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.mark.parametrize("got, want, at", [([1, 2, 3], [1, 2, 3], None), ([1, 9, 3], [1, 2, 3], 1),
                                           ([1, 2], [1, 2, 3], 2), ([], [], None)])
def test_first_difference(got, want, at):
    assert first_difference(got, want) == at


def test_a_tie_widens_with_the_dtypes_rounding():
    assert tie_threshold(10.0, "float32") == NEAR_TIE
    assert tie_threshold(-10.0, "bfloat16") == pytest.approx(NEAR_TIE + 10 * 4 * 2.0 ** -8)
    assert RELATIVE_NEAR_TIE["float16"] < RELATIVE_NEAR_TIE["bfloat16"]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def target(tiny_llama_pair):
    path = tiny_llama_pair[0]
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_judge_reports_each_rows_first_departure_with_the_targets_gap(target):
    _, model = target
    want = [greedy(model, p, 6) for p in PROMPTS]
    got = [list(want[0]), want[1][:3] + [(want[1][3] + 1) % 64] + want[1][4:]]
    [d] = judge(model, PROMPTS, got, want, "float32")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1] + want[1][:3]])).logits[0, -1]
    top = logits.topk(2).values
    assert (d.row, d.position, d.token, d.ar_token) == (1, 3, got[1][3], want[1][3])
    assert d.gap == pytest.approx(float(top[0] - top[1]), abs=1e-5) and d.near_tie == (d.gap < NEAR_TIE)


def test_judge_cells_marks_every_greedy_cell_and_logs_a_departure_where_the_target_is_sure(target, caplog):
    path, model = target
    want = [greedy(model, p, 6) for p in PROMPTS]
    wrong = [want[0][:2] + [(want[0][2] + 1) % 64] + want[0][3:], want[1]]
    cell = lambda system, outputs, t=0.0: dict(system=system, setting="paper", batch=1, temperature=t, outputs=outputs)  # noqa: E731
    cells = [cell("ar", want), cell("sd", want), cell("ssd", wrong), cell("ar", want, 0.7), cell("ssd", wrong, 0.7)]
    caplog.set_level(logging.ERROR)
    judge_cells(cells, PROMPTS, path, "float32", "cpu")
    assert cells[1]["greedy_departures"] == [] and "greedy_departures" not in cells[4] | cells[0]
    [d] = cells[2]["greedy_departures"]
    assert (d["row"], d["position"]) == (0, 2) and d["near_tie"] == (d["gap"] < d["tie"])
    # the tiny target's sharpened head is sure almost everywhere: this departure is a broken verifier's
    assert not d["near_tie"] and "where the target is sure" in caplog.text
    assert "1 NOT at a near tie" in summary(cells)


def test_serving_cells_are_judged_per_rate_over_every_repeat(target):
    """A serving cell's outputs are one list per repeat, request i from prompt i in each: a departure in the
    second repeat is row len(prompts) + i."""
    path, model = target
    want = [greedy(model, p, 4) for p in PROMPTS]
    wrong = [want[0], [(want[1][0] + 1) % 64] + want[1][1:]]
    cell = lambda system, runs, rate="inf": dict(system=system, setting="equal", temperature=0.0, rate=rate, outputs=runs)  # noqa: E731
    cells = [cell("ar", [want, want]), cell("ssd", [want, wrong]), cell("ssd", [want, wrong], rate="2.0")]
    judge_cells(cells, PROMPTS * 2, path, "float32", "cpu", group=("setting", "rate"),
                rows=lambda c: [out for run in c["outputs"] for out in run])
    [d] = cells[1]["greedy_departures"]
    assert (d["row"], d["position"], d["ar_token"]) == (3, 0, want[1][0])
    assert "greedy_departures" not in cells[2]  # no ar cell at that rate


def test_summary_lines():
    tie = Departure(0, 1, 2, 3, top_logit=4.0, gap=0.01, tie=0.05).to_dict()
    assert summary([{"system": "ar"}]) is None
    assert summary([{"greedy_departures": []}]) == "greedy: every row token-identical to ar"
    assert summary([{"greedy_departures": [tie]}, {"greedy_departures": []}]) == (
        "greedy: 1 row(s) departed from ar, all at near ties of the target's top two logits; largest gap / tie 0.20")
