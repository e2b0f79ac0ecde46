"""The `saguaro` command's edges, and LLM's text ones: a bad flag or input is a clear error (exit 2, one line),
never a stack trace or a run that loads a model only to fail."""
from __future__ import annotations

import io
import json
import re

import pytest

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.serve import engine_args
from saguaro_dist.config import Config
from saguaro_dist.demo import demo_pair


@pytest.fixture(scope="module")
def demo_ar():
    target, _ = demo_pair()
    with LLM(model=target, mode="ar", max_model_len=64) as llm:
        yield llm


def test_an_unknown_log_level_is_a_usage_error(capsys):
    # logging.basicConfig raised its ValueError before main's handler, as a stack trace
    with pytest.raises(SystemExit) as exit_:
        main(["--log-level", "verbose", "generate", "--prompt", "x"])
    assert exit_.value.code == 2 and "unknown logging level 'verbose'" in capsys.readouterr().err


@pytest.mark.parametrize("mode, draft", [("ar", None), ("ngram", None), ("sd", "draft"), ("ssd", "draft"), (None, "draft")])
def test_the_demo_pair_brings_its_draft_only_to_the_modes_that_run_one(mode, draft):
    """No model given: the demo pair; `--mode ngram` failed, refused the demo draft it never asked for."""
    flags = ["--mode", mode] if mode else []
    args = engine_args(build_parser().parse_args(["generate", *flags]))
    assert args["draft"] == (demo_pair()[1] if draft else None)
    Config(**args)


def test_generate_runs_ngram_on_the_demo_pair(capsys):
    code = main(["generate", "--mode", "ngram", "--prompt", "def add(a, b):", "--max-tokens", "4", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["metrics"]["num_generated_tokens"] == 4


def test_generate_refuses_stdin_that_is_not_utf8(monkeypatch, capsys):
    """Under the C locale stdin reads bytes that are not UTF-8 as lone surrogates (surrogateescape): the
    tokenizer failed on them with a TypeError."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"def f():\n\xff\xfe x\n"), errors="surrogateescape"))
    code = main(["generate", "--mode", "ar", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "prompt 1 is not valid Unicode text" in err and "Traceback" not in err


def test_llm_refuses_text_that_is_not_unicode_and_serves_on(demo_ar):
    with pytest.raises(ValueError, match=r"prompt 1 is not valid Unicode text: it holds a lone surrogate '\\udcff'"):
        demo_ar.generate(["ok", "\udcff x"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(demo_ar.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids) == 2


@pytest.mark.parametrize("messages", ["hi", ["hi"], [{"role": "user", "content": "hi"}, "hi"], 5])
def test_chat_names_what_a_conversation_is(demo_ar, messages):
    with pytest.raises(ValueError, match="list of {'role'"):
        demo_ar.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)


def test_chat_takes_one_conversation_or_several(demo_ar):
    hi = {"role": "user", "content": "hi"}
    greedy = SamplingParams(temperature=0, max_tokens=3)
    one = demo_ar.chat((hi,), greedy, use_tqdm=False)
    two = demo_ar.chat([[hi], [hi]], greedy, use_tqdm=False)
    assert [o.token_ids for o in two] == [one[0].token_ids] * 2


@pytest.mark.parametrize("flags, message", [(["--port", "70000"], "--port: a port is an integer in 1..65535"),
                                            (["--port", "0"], "--port: a port is an integer in 1..65535"),
                                            (["--port", "-1"], "--port: a port is an integer in 1..65535"),
                                            (["--max-request-bytes", "0"], "--max-request-bytes: expected an integer >= 1"),
                                            (["--num-cpus", "0"], "--num-cpus: expected an integer >= 1")])
def test_serve_checks_its_numbers_before_anything_starts(capsys, flags, message):
    # --port 70000 raised OverflowError from socket.bind; --port 0 quietly served on 8000
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_help_calls_only_list_options_comma_separated(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert re.search(r"--systems SYSTEMS\s+comma-separated list", text)
    assert not re.search(r"--max-new-tokens MAX_NEW_TOKENS\s+comma-separated", text)  # one int


def test_a_port_that_cannot_be_bound_names_the_flag_to_fix():
    """A host that is no address of this machine used to say "choose another --port"."""
    import socket

    from saguaro_dist.serve.ingress import check_port_free

    with pytest.raises(ValueError, match=r"check --host"):
        check_port_free("999.1.1.1", 8123)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match=r"Address already in use \(choose another --port\)"):
            check_port_free("127.0.0.1", taken.getsockname()[1])


@pytest.mark.parametrize("argv", [["generate", "--url", "http://127.0.0.1:9"],
                                  ["run-batch", "-i", "-", "-o", "{out}", "--url", "http://127.0.0.1:9"]])
def test_a_closed_stdin_is_a_clear_error(monkeypatch, capsys, tmp_path, argv):
    """Started with stdin closed (`<&-`), Python sets sys.stdin to None: generate died with a TypeError, run-batch
    with an AttributeError after it had emptied its output file."""
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    monkeypatch.setattr("sys.stdin", None)
    assert main([a.format(out=out) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "stdin" in err and "closed" in err and "Traceback" not in err and out.read_text() == "kept\n"


def test_generate_reads_crlf_stdin_lines_without_the_cr(monkeypatch, capsys):
    """A prompt file with Windows line ends: the '\\r' stayed on each prompt, and the model continued another text."""
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\r\nimport os\r\n"))
    assert main(["generate", "--mode", "ar", "--max-tokens", "1", "--json"]) == 0
    prompts = [json.loads(line)["prompt"] for line in capsys.readouterr().out.splitlines()]
    assert prompts == ["def add(a, b):", "import os"]
