"""--chat-template (vLLM's): a Jinja template, inline or in a file, used instead of the tokenizer's."""
from __future__ import annotations

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM, SamplingParams
from saguaro_dist.cli import main
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.prompts import load_chat_template, render_chat
from saguaro_dist.serve.protocol import ChatMessage
from test_serve_fixtures import make_tokenizer

pytest_plugins = ["test_serve_fixtures"]

# words the test tokenizer knows, so the rendered prompt is real tokens
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}the{% endif %}"
STRICT = "{% if messages[0].role != 'user' %}{{ raise_exception('a user turn must come first') }}{% endif %}" + TEMPLATE
HELLO = [{"role": "user", "content": "hello world"}]


def test_inline_or_from_a_file(tmp_path):
    assert load_chat_template(TEMPLATE) == TEMPLATE
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "chat.jinja")) == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}{{ m.content }")
    from saguaro_dist.serve.app import server_options
    assert server_options({"chat_template": TEMPLATE}, "m").chat_template == TEMPLATE  # a replica's, from app args


def test_it_replaces_the_plain_transcript():
    tokenizer = make_tokenizer()  # ships no template: the plain transcript otherwise
    messages = [ChatMessage(**m) for m in HELLO]
    assert render_chat(tokenizer, messages) == ("User: hello world\nAssistant:", False)
    assert render_chat(tokenizer, messages, chat_template=TEMPLATE) == ("hello world the", True)
    with pytest.raises(ValueError, match="chat template refused them: a user turn must come first"):
        render_chat(tokenizer, [ChatMessage(role="assistant", content="hi")], chat_template=STRICT)


def test_served_and_in_process_alike(serving_pair):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    with LLM(model=serving_pair[0], mode="ar") as llm, \
            serve_on_loopback(create_app(llm, ServerOptions("m", chat_template=STRICT))) as url:
        tokens = httpx.post(f"{url.removesuffix('/v1')}/tokenize", json={"messages": HELLO}).json()["tokens"]
        assert tokens == llm.tokenizer.encode("hello world the", add_special_tokens=False)
        reply = httpx.post(f"{url}/chat/completions", json={"messages": HELLO, "max_tokens": 6, "temperature": 0})
        expected = llm.chat(HELLO, greedy, chat_template=STRICT)[0]
        assert expected.prompt_token_ids == tokens  # LLM.chat renders it the same way
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == expected.text
        closed = httpx.post(f"{url.removesuffix('/v1')}/tokenize",
                            json={"messages": HELLO, "add_generation_prompt": False}).json()["tokens"]
        assert llm.chat(HELLO, greedy, chat_template=STRICT, add_generation_prompt=False)[0].prompt_token_ids == closed
        assert closed == llm.tokenizer.encode("hello world ", add_special_tokens=False)  # no "the" opened
        refused = httpx.post(f"{url}/chat/completions", json={"messages": [{"role": "assistant", "content": "hi"}]})
        assert refused.status_code == 400 and "a user turn must come first" in refused.json()["error"]["message"]


def test_a_bad_template_stops_the_server_before_ray(serving_pair, capsys):
    assert main(["serve", serving_pair[0], "--chat-template", "/no/such/template.jinja"]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err
