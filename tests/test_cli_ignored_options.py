"""Flags the rest of a `saguaro` command line leaves unused are errors (exit 2, one line, before any model
loads), never silently dropped; and `saguaro generate` takes the model's generation config, as the server does."""
from __future__ import annotations

import json
import logging

import pytest
import yaml

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.serve import engine_args
from saguaro_dist.config import Config
from test_generation_config import with_generation_config

pytest_plugins = ["test_serve_fixtures"]

NO_MODEL = "/no/such/model"  # had a flag gone unchecked, loading it would fail with another message
ENGINE = [("ar", ["--draft", "/d"], "--draft applies only to --mode sd / ssd; the mode is ar"),
          ("ar", ["--draft-revision", "v1"], "--draft-revision applies only to --mode sd / ssd"),
          ("ar", ["--prompt-lookup-max", "4"], "--prompt-lookup-max applies only to --mode sd / ssd / ngram"),
          ("ngram", ["--draft-device", "cpu"], "--draft-device applies only to --mode sd / ssd; the mode is ngram"),
          ("ngram", ["--draft-executor", "thread"], "--draft-executor applies only"),
          ("ngram", ["--draft-workers", "2"], "--draft-workers applies only"),
          ("ngram", ["--proposal-top-k", "0"], "--proposal-top-k applies only"),  # 0 is a value too
          ("sd", ["--fan-out", "8"], "--fan-out applies only to --mode ssd; the mode is sd"),
          ("sd", ["--saguaro-c", "0.5", "--fallback", "fast"], "--saguaro-c applies only to --mode ssd; --fallback"),
          ("sd", ["--tree-policy", "always"], "--tree-policy applies only"),
          ("sd", ["--bonus-draw", "top_f"], "--bonus-draw applies only"),
          ("ngram", ["--no-ngram-rounds"], "--no-ngram-rounds applies only to --mode ssd"),
          ("ngram", ["--adaptive-fan-out"], "--adaptive-fan-out applies only")]


def _run(argv: list[str], capsys) -> str:
    """main's exit code must be 2; its stderr, one line and no trace."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def _batch_files(tmp_path) -> list[str]:
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    return ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]


@pytest.mark.parametrize("mode, flags, message", ENGINE)
@pytest.mark.parametrize("command", ["generate", "serve", "run-batch"])
def test_an_engine_flag_the_mode_leaves_unused_is_an_error(command, mode, flags, message, tmp_path, capsys):
    extra = _batch_files(tmp_path) if command == "run-batch" else ["--prompt", "x"] if command == "generate" else []
    draft = ["--draft", "/d"] if mode in ("sd", "ssd") else []
    assert message in _run([command, NO_MODEL, "--mode", mode, *draft, *flags, *extra], capsys)


def test_a_model_without_a_draft_runs_ar_so_speculation_flags_ask_for_one(capsys):
    err = _run(["generate", NO_MODEL, "--k", "3", "--prompt", "x"], capsys)
    assert "--k applies only to --mode sd / ssd / ngram; the mode is ar (a model without --draft" in err


def test_a_config_files_mode_counts(tmp_path, capsys):
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({"model": NO_MODEL, "mode": "ar"}))
    assert "--draft applies only" in _run(["serve", "--config", str(tmp_path / "serve.yaml"), "--draft", "/d"], capsys)


def test_flags_the_mode_uses_and_defaults_pass(caplog):
    parse = build_parser().parse_args
    ssd = engine_args(parse(["generate", NO_MODEL, "--draft", "/d", "--mode", "ssd", "--k", "2", "--fan-out", "6",
                             "--saguaro-c", "0.5", "--no-ngram-rounds", "--proposal-top-k", "4", "--draft-device", "cpu"]))
    assert Config(**ssd).fan_out == 6 and not Config(**ssd).ngram_rounds
    ngram = engine_args(parse(["generate", NO_MODEL, "--mode", "ngram", "--k", "3", "--prompt-lookup-max", "4"]))
    assert Config(**ngram).prompt_lookup_max == 4
    assert engine_args(parse(["generate", NO_MODEL]))["mode"] == "ar"  # argparse's defaults never count as given
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.cli.flag_checks"):
        assert engine_args(parse(["generate", NO_MODEL, "--mode", "ar", "--k", "3"]))["k"] == 3
    assert "--k is unused by --mode ar" in caplog.text  # one K for a comparison of modes: said, not refused


@pytest.mark.parametrize("argv, message", [
    (["--k", "3"], "--k: unused with --url"),
    (["--draft", "/d", "--mode", "sd", "--generation-config", "vllm"], "--draft, --mode, --generation-config: unused"),
    (["--disable-log-stats", "--no-enable-prefix-caching"], "--no-enable-prefix-caching, --disable-log-stats: unused"),
])
def test_generate_refuses_engine_flags_with_url(argv, message, capsys):
    assert message in _run(["generate", "--url", "http://127.0.0.1:1", "--prompt", "x", *argv], capsys)


def test_generate_checks_url_and_key_before_anything(capsys):
    assert "--api-key only applies with --url" in _run(["generate", NO_MODEL, "--api-key", "k", "--prompt", "x"], capsys)
    assert "--url must be a server's address" in _run(["generate", "--url", "localhost:8000", "--prompt", "x"], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--mode", "sd"], "--mode: unused with --url"),
    ([NO_MODEL, "--chat-template", "x", "--tool-call-parser", "hermes"], "MODEL, --tool-call-parser, --chat-template"),
    (["--served-model-name", "m"], "--served-model-name: unused with --url"),
])
def test_run_batch_refuses_local_flags_with_url(argv, message, tmp_path, capsys):
    assert message in _run(["run-batch", *_batch_files(tmp_path), "--url", "http://127.0.0.1:1", *argv], capsys)


def test_run_batch_checks_key_and_names_before_the_model_loads(tmp_path, capsys):
    files = _batch_files(tmp_path)
    assert "--api-key only applies with --url" in _run(["run-batch", *files, NO_MODEL, "--api-key", "k"], capsys)
    assert "served_model_name must be" in _run(["run-batch", *files, NO_MODEL, "--served-model-name", ""], capsys)


def test_serve_refuses_num_cpus_with_an_address(capsys):
    err = _run(["serve", NO_MODEL, "--address", "ray://127.0.0.1:1", "--num-cpus", "2"], capsys)
    assert "--num-cpus sizes the embedded cluster: unused with --address" in err


@pytest.mark.parametrize("command", ["generate", "serve", "run-batch"])
def test_a_bad_generation_config_folder_is_named_before_anything_starts(command, serving_pair, tmp_path, capsys):
    """serve found it in the replica, after Ray had started; generate and run-batch called it a model path."""
    extra = _batch_files(tmp_path) if command == "run-batch" else ["--prompt", "x"] if command == "generate" else []
    err = _run([command, serving_pair[0], "--generation-config", str(tmp_path / "none"), *extra], capsys)
    assert f"--generation-config {str(tmp_path / 'none')!r}" in err


@pytest.fixture(scope="module")
def configured(serving_pair, tmp_path_factory) -> str:
    """The serving target with a generation config: top_k 1 makes its default sampling greedy in effect."""
    return with_generation_config(serving_pair[0], tmp_path_factory.mktemp("gen"), temperature=0.6, top_k=1,
                                  do_sample=True, max_new_tokens=3)


def _generated(argv: list[str], capsys) -> dict:
    assert main(["generate", "--prompt", "the cat sat", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _reference(model: str, **params) -> str:
    with LLM(model=model, mode="ar", generation_config="vllm") as llm:
        return llm.generate(["the cat sat"], SamplingParams(**params), use_tqdm=False)[0].text


def test_generate_takes_the_models_generation_config(configured, capsys):
    """The flags left out come from generation_config.json (they were 64 tokens, greedy, whatever it said)."""
    assert _generated([configured, "--mode", "ar"], capsys)["text"] == _reference(configured, temperature=0, max_tokens=3)
    assert _generated([configured, "--mode", "ar", "--max-tokens", "5", "--top-k", "0", "--temperature", "0"],
                      capsys)["text"] == _reference(configured, temperature=0, max_tokens=5)  # the flags win
    ignored = _generated([configured, "--mode", "ar", "--generation-config", "vllm"], capsys)  # generate's own defaults
    assert ignored["text"] == _reference(configured, temperature=0, max_tokens=64)


def test_generate_leaves_what_it_was_not_given_to_the_server(configured, capsys):
    from saguaro_dist.serve.api import ServerOptions, create_app
    with LLM(model=configured, mode="ar") as llm, serve_on_loopback(create_app(llm, ServerOptions("m"))) as url:
        result = _generated(["--url", url], capsys)
    assert result["text"] == _reference(configured, temperature=0, max_tokens=3)  # the server's generation config


@pytest.mark.parametrize("argv, message", [
    (["--sweep-ks", "2,4"], "--sweep-ks: unused by the grid"),
    (["--num-requests", "3"], "--num-requests: unused by the grid"),
    (["--api-key", "k", "--model", "m"], "--api-key, --model: unused by the grid"),
    (["--sweep", "--systems", "ar", "--batch", "2"], "--systems, --batch: unused by --sweep"),
    (["--request-rates", "inf", "--num-prompts", "4", "--sweep-cs", "1"], "--num-prompts, --sweep-cs: unused by --request-rates"),
    (["--url", "http://127.0.0.1:1", "--request-rates", "inf", "--k", "2", "--no-ngram-rounds"], "--k, --no-ngram-rounds: unused by --url"),
    (["--systems", "ar,hf", "--draft", "/d"], "--draft applies only to systems sd, ssd"),
    (["--systems", "ar,ngram", "--k", "2", "--saguaro-c", "0.5"], "--saguaro-c applies only to systems ssd"),
    (["--request-rates", "inf", "--systems", "ar,sd", "--fallback", "fast"], "--fallback applies only to systems ssd"),
])
def test_bench_refuses_options_its_run_leaves_unused(argv, message, tmp_path, capsys):
    # a folder that passes the bench's path check (it holds a config.json) but loads no model: a flag gone
    # unchecked would fail with another message
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    argv = [str(tmp_path / "model") if arg == "/d" else arg for arg in argv]
    target = [] if "--url" in argv else ["--target", str(tmp_path / "model")]  # (--url refuses it too)
    assert message in _run(["bench", *target, "--out", str(tmp_path / "out"), "--no-progress", *argv], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--mode", "ar", "--draft", "d"], "--draft applies only to --mode sd / ssd; the mode is ar"),
    (["--mode", "ngram", "--fan-out", "8", "--draft-workers", "2"], "--fan-out applies only to --mode ssd"),
    (["--mode", "ar", "--draft-cpu", "4"], "--draft-cpu applies only"),
    (["--batch-pvc", "data"], "--batch-pvc only applies with --kind batch-job"),
    (["--mode", "ar", "--draft-max-workers", "1"], "--draft-max-workers applies only"),
])
def test_deploy_refuses_options_its_manifests_leave_out(argv, message, capsys):
    assert message in _run(["deploy", "k8s", *argv], capsys)


def test_deploy_defaults_still_apply(capsys):
    from saguaro_dist.deploy import k8s
    assert main(["deploy", "k8s", "--kind", "serve-config", "--mode", "ngram"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == k8s.serve_config(k8s.K8sSettings(mode="ngram"))
    assert main(["deploy", "k8s", "--kind", "batch-job", "--batch-pvc", "data"]) == 0
    assert "/data/requests.jsonl" in capsys.readouterr().out
