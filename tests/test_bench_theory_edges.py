"""Theorem 7 for runs it cannot predict: no rounds (null, not {}), no verify time (null, not a ZeroDivisionError in
the best case or the report's T_p / T_b)."""
from __future__ import annotations

import json

import pytest

from saguaro_dist.bench.report import theorem7_lines, write_json
from saguaro_dist.bench.runner import annotate
from saguaro_dist.bench.systems import Measurement
from saguaro_dist.bench.theory import predict_from_run

CALIB = {"tree_s": 0.02, "jit_s": 0.005}


def run(**engine) -> Measurement:
    return Measurement(tokens=31, seconds=1.0, outputs=[], cache_hits=6, cache_misses=0, engine=engine)


def test_a_run_without_rounds_has_no_prediction():
    """{} was falsy to the runner's checks but written to the JSON as an empty object, where every other cell
    without a prediction has null."""
    assert predict_from_run(run(rounds=0, verify_s=0.0), 1, CALIB) is None
    assert predict_from_run(Measurement(tokens=1, seconds=1.0, outputs=[]), 1, CALIB) is None


@pytest.mark.parametrize("engine", [{"rounds": 10, "verify_s": 0.0, "fast_rounds": 4, "fast_round_tokens": 12},
                                    {"rounds": 10, "verify_s": 0.0}, {"rounds": 10}])
def test_a_run_without_a_verify_time_has_no_prediction(engine, caplog):
    """The best case's n-gram rounds alone (fast_tokens / verify_s) divided by zero; without fast rounds the
    prediction read 0 tok/s and 'measured = 0% of predicted'; without the counter, a KeyError."""
    assert predict_from_run(run(**engine), 1, CALIB) is None
    assert "timed no verify" in caplog.text


def test_the_report_line_survives_a_verify_time_of_zero():
    """A result whose verify_s is 0 (another producer's, an edited file) ended render() in a ZeroDivisionError."""
    t = predict_from_run(run(rounds=10, verify_s=0.1, fast_rounds=4, fast_round_tokens=12), 1, CALIB)
    [line] = theorem7_lines([{"system": "ssd", "batch": 1, "temperature": 0.0, "theorem7": {**t, "verify_s": 0.0}}])
    assert "T_p -, T_b -" in line and "draft alone: T_p -" in line
    [line] = theorem7_lines([{"system": "ssd", "batch": 1, "temperature": 0.0, "theorem7": t}])
    assert "T_p 2.00, T_b 0.50" in line  # tree 20 ms, backup 5 ms over a 10 ms verify, as before


def test_a_grid_cell_without_rounds_writes_theorem7_as_null(tmp_path):
    """What the runner makes of it: no best-case ratio, the JSON's null, the report's line left out."""
    cells = [{"system": s, "setting": "demo", "batch": 1, "temperature": 0.0, "tokens_per_s": 30.0,
              "repeat_tokens_per_s": [30.0], "outputs": [[1]], "_measurement": run(rounds=0)} for s in ("sd", "ssd")]
    annotate(cells, {(1, 0.0): CALIB})
    ssd = next(c for c in cells if c["system"] == "ssd")
    assert ssd["theorem7"] is None and theorem7_lines(cells) == []
    path = write_json({"kind": "grid", "cells": cells}, tmp_path / "grid.json")
    assert [c["theorem7"] for c in json.loads(path.read_text())["cells"]] == [None, None]
