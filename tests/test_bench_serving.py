"""`saguaro bench --request-rates`: our systems serving request streams (continuous batching, Poisson
arrivals) in a tiny configuration: arrivals, the summary's figures, schema, exactness, table, plot, CLI."""
from __future__ import annotations

import json
import math

import pytest

from saguaro_dist.bench import BenchConfig, ServingConfig, run_serving
from saguaro_dist.bench.plots import write_plots
from saguaro_dist.bench.report import render, write_json
from saguaro_dist.bench.serving import Served, arrival_offsets, summarize
from saguaro_dist.cli import main
from saguaro_dist.engine.metrics import RequestMetrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Every serving cell's keys, in process and of a server (--url, test_bench_remote_review): one `kind: serving` schema
# (greedy_departures besides on the greedy cells judged against ar, in process)
CELL_KEYS = {"system", "setting", "temperature", "rate", "requests", "output_tokens", "seconds", "output_tokens_per_s",
             "requests_per_s", *(f"{name}_ms_{q}" for name in ("ttft", "tpot", "itl", "e2e") for q in ("mean", "p50", "p99")),
             "acceptance_rate", "cache_hit_rate", "speedup_vs_sd", "paired_vs_sd", "greedy_same_as_ar", "repeats",
             "repeat_output_tokens_per_s", "placement", "cores", "failed_requests", "requests_without_usage", "error"}


def test_arrivals_are_a_seeded_poisson_stream_or_all_at_once():
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4000, 20.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets == arrival_offsets(4000, 20.0, seed=1)
    assert offsets != arrival_offsets(4000, 20.0, seed=2)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.06)  # exponential gaps of mean 1 / rate
    assert sum(g > 2 / 20.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-2), abs=0.03)  # P(gap > 2 / rate)


def served(tokens: int, ttft: float, total: float, drafted: int = 0, accepted: int = 0, hits: int = 0, misses: int = 0):
    return Served(list(range(tokens)), RequestMetrics(num_generated_tokens=tokens, time_to_first_token_s=ttft,
                                                      total_time_s=total, drafted_tokens=drafted,
                                                      accepted_tokens=accepted, cache_hits=hits, cache_misses=misses))


def test_summary_figures():
    s = summarize([served(5, 0.010, 0.050, 8, 6, 1, 1), served(1, 0.020, 0.020, 4, 2, 0, 2)], seconds=0.5)
    assert (s["requests"], s["output_tokens"]) == (2, 6)
    assert s["output_tokens_per_s"] == pytest.approx(12.0) and s["requests_per_s"] == pytest.approx(4.0)
    assert s["ttft_ms_mean"] == pytest.approx(15.0) and s["ttft_ms_p50"] == pytest.approx(15.0)
    assert s["tpot_ms_p50"] == pytest.approx(10.0)  # (50 - 10) ms over the 4 tokens after the first; one-token outputs have none
    assert s["e2e_ms_p99"] == pytest.approx(49.7)  # numpy's linear percentile between 20 and 50 ms
    assert s["acceptance_rate"] == pytest.approx(8 / 12) and s["cache_hit_rate"] == pytest.approx(1 / 4)
    ar = summarize([served(1, 0.01, 0.01)], seconds=1.0)
    assert ar["acceptance_rate"] is None and ar["cache_hit_rate"] is None and ar["tpot_ms_p50"] is None


def tiny_serving(pair, tmp_path, base: dict | None = None, **kw) -> ServingConfig:
    """Four requests through two slots, greedy and sampled, all at once and at 200 a second, two repeats."""
    defaults = dict(target=pair[0], draft=pair[1], systems=("ar", "sd", "ngram", "ssd"), settings=("paper",), batch_sizes=(2,),
                    temperatures=(0.0, 0.7), max_new_tokens=8, prompt_len=6, k=2, fan_out=6, repeats=2, out_dir=str(tmp_path))
    return ServingConfig(base=BenchConfig(**{**defaults, **(base or {})}), **{"rates": (math.inf, 200.0), "num_requests": 4, **kw})


@pytest.fixture(scope="module")
def serving(tiny_llama_pair, tmp_path_factory):
    return run_serving(tiny_serving(tiny_llama_pair, tmp_path_factory.mktemp("serving")), progress=False)


def test_every_system_serves_every_stream_and_greedy_tokens_stay_ar_s(serving):
    assert serving["kind"] == "serving" and serving["serving"] == {"rates": ["inf", 200.0], "num_requests": 4,
                                                                     "max_batch_size": 2}
    assert len(serving["cells"]) == 4 * 2 * 2
    for cell in serving["cells"]:
        assert set(cell) - {"greedy_departures"} == CELL_KEYS, set(cell) ^ CELL_KEYS
        assert cell["requests"] == 4 and cell["output_tokens"] == 4 * 8 and len(cell["repeats"]) == 2
        counts = ("requests", "output_tokens", "failed_requests", "requests_without_usage")  # ints, not 2 repeats' 4.0
        assert [type(cell[k]) for k in counts] == [int] * 4 and (cell["failed_requests"], cell["error"]) == (0, None)
        assert 0 < cell["ttft_ms_p50"] <= cell["e2e_ms_p50"] and cell["output_tokens_per_s"] > 0
        assert cell["repeats"][0]["engine"]["rounds"] > 0  # the engine's counters of each stream are kept
        if cell["temperature"] == 0:
            assert cell["greedy_same_as_ar"] == 1.0, (cell["system"], cell["rate"])
            assert cell["system"] == "ar" or cell["greedy_departures"] == [], (cell["system"], cell["rate"])
        if cell["system"] == "sd":
            assert cell["speedup_vs_sd"] == pytest.approx(1.0) and cell["paired_vs_sd"]["median"] == pytest.approx(1.0)
    ssd = [c for c in serving["cells"] if c["system"] == "ssd"]
    assert all(c["acceptance_rate"] is not None for c in ssd)


def test_serving_json_table_and_plot(serving, tmp_path):
    path = write_json(serving, tmp_path / "serving.json")
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    text = render(serving)
    assert "| setting | system | T | req/s in |" in text and "| paper | ssd | 0.0 | inf |" in text
    assert "at most 2 running" in text
    (png,) = write_plots(serving, tmp_path)
    assert png.name == "serving_vs_rate.png" and png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("kw, match", [({"rates": (0.0,)}, "rates must be > 0"), ({"rates": (float("nan"),)}, "rates"),
                                       ({"rates": ()}, "rates"), ({"num_requests": 0}, "num_requests")])
def test_bad_serving_settings_are_value_errors(tiny_llama_pair, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_serving(tiny_llama_pair, tmp_path, **kw)


def test_transformers_systems_cannot_serve_a_stream():
    with pytest.raises(ValueError, match="no continuous batching"):
        ServingConfig(base=BenchConfig(systems=("sd", "hf-assisted")))


def test_cli_serving_run_writes_serving_json(tiny_llama_pair, tmp_path, capsys):
    args = ["bench", "--target", str(tiny_llama_pair[0]), "--draft", str(tiny_llama_pair[1]), "--out", str(tmp_path),
            "--no-progress", "--no-plots", "--settings", "paper", "--temperatures", "0", "--batch", "2", "--k", "2",
            "--fan-out", "6", "--prompt-len", "4", "--max-new-tokens", "4", "--num-requests", "3"]
    assert main(args + ["--request-rates", "inf"]) == 0
    results = json.loads((tmp_path / "serving.json").read_text())
    assert [c["system"] for c in results["cells"]] == ["ar", "sd", "ngram", "ssd"]  # the serving default
    assert "| paper | ssd | 0.0 | inf |" in capsys.readouterr().out
    assert main(args + ["--request-rates", "0"]) == 2
    with pytest.raises(SystemExit) as exit_:  # argparse's own error, naming the option
        main(args + ["--request-rates", "fast"])
    assert exit_.value.code == 2 and "request rates are requests a second" in capsys.readouterr().err
    assert main(args + ["--request-rates", "inf", "--sweep"]) == 2
    assert main(args + ["--request-rates", "inf", "--systems", "sd,hf"]) == 2


def test_ssd_on_ray_serves_a_stream(tiny_llama_pair, tmp_path, ray_cluster):
    """The Ray engine (target actor, draft actor, gRPC) serves the stream as the one-host engines do."""
    config = tiny_serving(tiny_llama_pair, tmp_path, {"systems": ("ar", "ssd-ray"), "temperatures": (0.0,), "repeats": 1},
                          rates=(100.0,), num_requests=3)
    cells = {c["system"]: c for c in run_serving(config, progress=False)["cells"]}
    assert cells["ssd-ray"]["greedy_same_as_ar"] == 1.0 and cells["ssd-ray"]["output_tokens"] == 3 * 8
    assert cells["ssd-ray"]["cores"] == 2 and cells["ssd-ray"]["repeats"][0]["engine"]["rounds"] > 0


def test_a_stream_is_served_from_inside_a_running_event_loop(tiny_llama_pair, tmp_path):
    """A notebook cell runs inside an event loop, where asyncio.run refuses: the stream runs on a loop of
    its own, every request is served, and greedy tokens stay ar's."""
    import asyncio

    config = tiny_serving(tiny_llama_pair, tmp_path, base=dict(systems=("ar", "sd"), temperatures=(0.0,), repeats=1),
                          rates=(math.inf,), num_requests=2)

    async def inside_a_loop():
        return run_serving(config, progress=False)
    cells = asyncio.run(inside_a_loop())["cells"]
    assert [c["system"] for c in cells] == ["ar", "sd"]
    assert all(c["requests"] == 2 and c["output_tokens"] == 2 * 8 and c["greedy_same_as_ar"] == 1.0 for c in cells)
