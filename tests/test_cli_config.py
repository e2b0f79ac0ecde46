"""The `saguaro` command's config edges (review h16), through the real CLI in-process: a value the flags cannot
take is a one-line error naming the flag (exit 2), before any model loads; a valid one runs."""
from __future__ import annotations

import json

import pytest

from saguaro_dist.cli import main


@pytest.mark.parametrize("flag, text, expected", [
    ("--k", "x", "an integer"), ("--batch", "1,x", "comma-separated integers"),
    ("--fan-out", "4,3,2,1,1", "an integer"), ("--temperatures", "a", "comma-separated numbers"),
    ("--saguaro-c", "half", "a number"), ("--sweep-ks", "2,four", "comma-separated integers"),
])
def test_bench_names_the_option_a_value_does_not_parse_for(flag, text, expected, tmp_path, capsys):
    """It printed int()'s "invalid literal for int() with base 10: 'x'": which of the twenty options?"""
    sweep = ["--sweep"] if flag.startswith("--sweep") else []
    code = main(["bench", "--preset", "quick", "--no-plots", "--no-progress", "--out", str(tmp_path), *sweep, flag, text])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} expects {expected}, got {text!r}" in err, err
    assert not list(tmp_path.iterdir())  # nothing ran


def test_generate_runs_ngram_with_k_past_the_default_fan_out(capsys):
    """`--mode ngram --k 12` was refused for the default fan-out budget (12 < k+1), and the --fan-out that would
    lift it is refused with ngram: no way to run it."""
    code = main(["generate", "--mode", "ngram", "--k", "12", "--prompt", "def add(a, b):", "--max-tokens", "3",
                 "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["metrics"]["num_generated_tokens"] == 3


def test_deploy_writes_an_ngram_manifest_with_k_past_the_default_fan_out(capsys):
    code = main(["deploy", "k8s", "--mode", "ngram", "--k", "12", "--kind", "serve-config"])
    out = capsys.readouterr().out
    assert code == 0 and "k: 12" in out and "mode: ngram" in out


@pytest.mark.parametrize("flags, message", [
    (["--mode", "ssd", "--draft", "/nonexistent/draft", "--k", "12"], "fan_out budget must be an int >= k+1 = 13"),
])
def test_generate_refuses_what_cannot_run_before_any_model_loads(flags, message, capsys):
    code = main(["generate", "--model", "/nonexistent/model", *flags, "--prompt", "x"])
    assert code == 2 and message in capsys.readouterr().err


def test_a_serve_config_file_s_pool_sizes_may_be_strings(tmp_path):
    """Old: `tensor_parallel_size: "2"` in a --config file raised a TypeError (str > int) in engine_args."""
    from saguaro_dist.cli import build_parser
    from saguaro_dist.cli.serve import engine_args
    from saguaro_dist.serve.args import config_from_args
    args = engine_args(build_parser().parse_args(["serve", "/m", "--mode", "ar"]),
                       {"tensor_parallel_size": "2", "num_draft_workers": "1"})
    assert config_from_args(args).cluster == "auto"
