"""vLLM's --response-role: the role a chat reply carries when the request opens a new turn (add_generation_prompt
true, the default); otherwise the last message's role (vLLM's get_chat_request_role), which `echo` compares the
last message's role with too. Real HTTP to the app under plain uvicorn over a tiny real engine; the flag and
the app arg through the real command line and app builder."""
from __future__ import annotations

import json

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.cli import build_parser, main
from saguaro_dist.cli.frontend_flags import frontend_app_args
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.app import build_app, server_options
from saguaro_dist.serve.args import config_from_args
from test_serve_fixtures import make_tokenizer, write_llama

QUESTION = [{"role": "user", "content": "def f(x):"}]
PREFILL = "    return"
PREFILLED = QUESTION + [{"role": "assistant", "content": PREFILL}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("role"), make_tokenizer(), hidden=32, layers=1, seed=7)


@pytest.fixture(scope="module")
def llm(model_path):
    with LLM(model=model_path, mode="ar", max_model_len=128, max_batch_size=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def default_url(llm):
    with serve_on_loopback(create_app(llm, ServerOptions("m"))) as url:
        yield url


@pytest.fixture(scope="module")
def narrator_url(llm, model_path):
    """The app as a replica builds it from its app args (`saguaro serve --response-role narrator`)."""
    options = server_options({"response_role": "narrator", "served_model_name": "m"}, model_path)
    with serve_on_loopback(create_app(llm, options)) as url:
        yield url


def _chat(url: str, messages: list, **extra) -> dict:
    reply = httpx.post(f"{url}/chat/completions", timeout=60,
                       json={"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _streamed_deltas(url: str, messages: list, **extra) -> list[dict]:
    """Every choice delta of a streamed reply, in order."""
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True, **extra}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    return [choice["delta"] for chunk in chunks for choice in chunk["choices"]]


def test_replies_are_the_assistants_by_default(default_url):
    assert _chat(default_url, QUESTION)["choices"][0]["message"]["role"] == "assistant"
    assert _streamed_deltas(default_url, QUESTION)[0]["role"] == "assistant"


def test_a_custom_response_role_names_whole_and_streamed_replies(narrator_url, default_url):
    """Old: ServerOptions had no response_role; every reply was the assistant's."""
    whole = _chat(narrator_url, QUESTION)["choices"][0]
    assert whole["message"]["role"] == "narrator"
    assert whole["message"]["content"] == _chat(default_url, QUESTION)["choices"][0]["message"]["content"]
    deltas = _streamed_deltas(narrator_url, QUESTION)
    assert deltas[0]["role"] == "narrator" and all("role" not in d for d in deltas[1:])  # the first delta's only
    assert "".join(d.get("content") or "" for d in deltas) == whole["message"]["content"]
    both = _streamed_deltas(narrator_url, QUESTION, n=2)
    assert [d["role"] for d in both if "role" in d] == ["narrator", "narrator"]  # each choice's first delta


def test_without_a_generation_prompt_the_reply_takes_the_last_messages_role(narrator_url):
    """vLLM's get_chat_request_role: no new turn is opened, so the reply is of the last message's role."""
    closed = {"add_generation_prompt": False}
    assert _chat(narrator_url, QUESTION, **closed)["choices"][0]["message"]["role"] == "user"
    assert _streamed_deltas(narrator_url, QUESTION, **closed)[0]["role"] == "user"
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert _chat(narrator_url, PREFILLED, **continued)["choices"][0]["message"]["role"] == "assistant"


def test_echo_compares_the_last_message_with_the_replys_role(narrator_url, default_url):
    """vLLM's echo repeats the last message when it is of the reply's role: a new turn's (the server's
    --response-role), else the last message's own, so a closed conversation's last message is always echoed."""
    opened = _chat(narrator_url, PREFILLED, echo=True)["choices"][0]["message"]["content"]
    assert opened == _chat(narrator_url, PREFILLED)["choices"][0]["message"]["content"]  # assistant: not narrator
    assert _chat(default_url, PREFILLED, echo=True)["choices"][0]["message"]["content"].startswith(PREFILL)
    closed = {"add_generation_prompt": False, "echo": True}
    plain = _chat(narrator_url, QUESTION, add_generation_prompt=False)["choices"][0]["message"]["content"]
    assert _chat(narrator_url, QUESTION, **closed)["choices"][0]["message"]["content"] == "def f(x):" + plain
    deltas = _streamed_deltas(narrator_url, QUESTION, **closed)
    assert deltas[0]["role"] == "user" and deltas[1]["content"] == "def f(x):"


@pytest.mark.parametrize("bad", ["", "   ", 5])
def test_a_blank_or_non_text_role_is_refused_when_the_app_is_built(bad, model_path):
    with pytest.raises(ValueError, match="response_role must be a non-empty role name"):
        build_app({"model": model_path, "mode": "ar", "response_role": bad})


def test_the_flag_is_an_app_arg_and_a_blank_one_a_usage_error(model_path, capsys):
    config_from_args({"model": model_path, "mode": "ar", "response_role": "narrator"})  # a known app arg
    with pytest.raises(SystemExit) as exit_:
        main(["serve", model_path, "--response-role", ""])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--response-role: must be a non-empty role name" in err
    ns = build_parser().parse_args(["serve", model_path, "--response-role", "narrator"])
    assert frontend_app_args(ns)["response_role"] == "narrator"


def test_a_config_files_blank_response_role_is_refused_before_ray_starts(tmp_path, capsys):
    """A --config file's response_role was checked only by build_app, after Ray had started."""
    from saguaro_dist.cli import main
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n- name: app\n  import_path: saguaro_dist.serve.app:build_app\n"
                      "  args:\n    model: /nonexistent-checked-later\n    mode: ar\n    response_role: ''\n")
    assert main(["serve", "--config", str(config), "--port", "1"]) == 2
    assert "response_role" in capsys.readouterr().err
