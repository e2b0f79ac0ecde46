"""Every OpenAI and vLLM request field is honoured, accepted because it changes nothing in the output, or
refused with a 400 naming it; none that would change the output or its shape is silently dropped. Over
real HTTP to the serving app on an SSD engine (a tiny Llama pair written by transformers)."""
from __future__ import annotations

import logging

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import SamplingParams
from saguaro_dist.serve.api import ServerOptions, create_app

pytest_plugins = ["test_serve_fixtures"]
HI = [{"role": "user", "content": "the cat sat on"}]
GREEDY = {"prompt": "the cat sat on", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
GREEDY_CHAT = {"messages": HI, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
# A chat template that reads both template-variable fields, and one that reads only documents
READS_BOTH = ("{% for m in messages %}{{ m.role }} : {{ m.content }}\n{% endfor %}"
              "{% for d in documents or [] %}doc : {{ d.text }}\n{% endfor %}"
              "{% if reasoning_effort %}effort : {{ reasoning_effort }}\n{% endif %}assistant :")
READS_DOCUMENTS = ("{% for m in messages %}{{ m.content }}\n{% endfor %}"
                   "{% for d in documents or [] %}{{ d.text }}{% endfor %}")
DOCS = [{"title": "one", "text": "the dog ran in the park"}]


@pytest.fixture(scope="module")
def bases(reference_llm):
    """Base URLs (no /v1) of three apps on one engine: no chat template, one reading documents and
    reasoning_effort, one reading documents only."""
    apps = {name: create_app(reference_llm, ServerOptions("tiny", chat_template=template))
            for name, template in (("plain", None), ("both", READS_BOTH), ("documents", READS_DOCUMENTS))}
    with serve_on_loopback(apps["plain"]) as plain, serve_on_loopback(apps["both"]) as both, \
            serve_on_loopback(apps["documents"]) as documents:
        yield {name: url.removesuffix("/v1") for name, url in
               (("plain", plain), ("both", both), ("documents", documents))}


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def _route(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


CHAT = {"messages": HI, "max_tokens": 2}
COMPLETION = {"prompt": "the cat", "max_tokens": 2}


@pytest.mark.parametrize("body, param", [
    ({**COMPLETION, "spaces_between_special_tokens": False, "skip_special_tokens": False},
     "spaces_between_special_tokens"),
    ({**CHAT, "logits_processors": ["my.module.Processor"]}, "logits_processors"),
    ({**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({**COMPLETION, "vllm_xargs": {"k": 1}}, "vllm_xargs"),
    ({**CHAT, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({**CHAT, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({**CHAT, "structural_tag": "{}"}, "structural_tag"),
    ({**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ({**CHAT, "web_search_options": {}}, "web_search_options"),
    ({**CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({**CHAT, "function_call": {"name": "f"}}, "function_call"),
    ({**CHAT, "service_tier": "flex"}, "service_tier"),
    ({**CHAT, "verbosity": "low"}, "verbosity"),
    ({**COMPLETION, "suffix": " the end"}, "suffix"),
    ({**COMPLETION, "best_of": 1, "n": 2}, "best_of"),  # vLLM's and OpenAI's rule: best_of >= n
    ({**COMPLETION, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream: no usage chunk to send
    ({**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
    # (prompt_logprobs, return_tokens_as_token_ids, request_id, add_special_tokens and continuous_usage_stats are
    # honoured, as vLLM honours them: test_serve_vllm_fields.py; include_reasoning: test_serve_leftover_fields.py)
])
def test_fields_that_would_change_the_output_are_a_400_naming_them(bases, body, param):
    """Each was accepted and dropped: the reply came back as if the field had not been sent."""
    r = _post(bases["plain"], _route(body), body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "the cat", "return_token_strs": True}, "return_token_strs"),
    ({"messages": HI, "chat_template": "{{ messages }}"}, "chat_template"),
])
def test_tokenize_refuses_what_it_cannot_return(bases, body, param):
    r = _post(bases["plain"], "/tokenize", body)
    assert r.status_code == 400 and param in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("extra", [
    {"user": "u-1", "metadata": {"team": "a"}, "store": False, "prompt_cache_key": "k", "safety_identifier": "s"},
    {"store": True, "service_tier": "auto", "modalities": ["text"], "verbosity": "medium", "function_call": "none"},
    {"prediction": {"type": "content", "content": "the cat"}, "length_penalty": 0.5, "mm_processor_kwargs": {}},
    {"best_of": 1, "bad_words": [], "use_beam_search": False, "guided_decoding_backend": "auto", "vllm_xargs": {}},
])
def test_fields_that_only_annotate_are_accepted_and_change_nothing(bases, extra):
    plain = _post(bases["plain"], "/v1/chat/completions", GREEDY_CHAT).json()["choices"][0]["message"]["content"]
    r = _post(bases["plain"], "/v1/chat/completions", {**GREEDY_CHAT, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain


def test_completions_max_tokens_defaults_to_16_as_openai_and_vllm(bases):
    """Left out, OpenAI's and vLLM's completions generate 16 tokens (chat's default is the rest of the
    context); we generated to the end of the context. An explicit null still asks for the rest."""
    base = bases["plain"]
    r = _post(base, "/v1/completions", {"prompt": "the cat", "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    max_model_len = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    long_prompt = " ".join(["cat"] * (max_model_len - 5))  # 5 tokens of room ("cat" is one token)
    r = _post(base, "/v1/completions", {"prompt": long_prompt, "ignore_eos": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = _post(base, "/v1/completions", {"prompt": long_prompt, "ignore_eos": True, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text


def test_unknown_fields_are_logged_with_the_field_a_typo_meant(bases, caplog):
    """vLLM logs the fields it ignores; a typo (max_token) was lost without a word."""
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.serve.protocol"):
        r = _post(bases["plain"], "/v1/completions", {"prompt": "the cat", "max_token": 3, "temperature": 0})
    assert r.status_code == 200
    warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert warned and "'max_token' (did you mean 'max_tokens'?)" in warned[0], warned


def _prompt_tokens(base: str, body: dict) -> int:
    r = _post(base, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _tokenized(base: str, variables: dict) -> int:
    r = _post(base, "/tokenize", {"messages": HI, "chat_template_kwargs": variables})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_documents_and_reasoning_effort_reach_the_chat_template(bases):
    """vLLM passes both to the chat template; they were dropped (documents could not even be given as a
    chat_template_kwargs key)."""
    base = bases["both"]
    bare = _prompt_tokens(base, GREEDY_CHAT)
    with_docs = _prompt_tokens(base, {**GREEDY_CHAT, "documents": DOCS})
    assert with_docs == _tokenized(base, {"documents": DOCS}) > bare
    with_effort = _prompt_tokens(base, {**GREEDY_CHAT, "reasoning_effort": "low"})
    assert with_effort == _tokenized(base, {"reasoning_effort": "low"}) > bare
    twice = _post(base, "/v1/chat/completions", {**GREEDY_CHAT, "documents": DOCS,
                                                 "chat_template_kwargs": {"documents": DOCS}})
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "documents"


def test_documents_a_template_ignores_are_a_400(bases):
    """The plain transcript reads no template variables: documents would be dropped without a word."""
    r = _post(bases["plain"], "/v1/chat/completions", {**GREEDY_CHAT, "documents": DOCS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text


@pytest.mark.parametrize("server_name", ["plain", "documents"])  # (the documents template reads documents only)
def test_a_reasoning_effort_the_template_ignores_is_logged_not_refused(bases, server_name, caplog):
    """A hint OpenAI clients send by habit: vLLM ignores it where the template reads none, and so do we (logged)."""
    with caplog.at_level(logging.WARNING, logger="saguaro_dist.serve.prompts"):
        r = _post(bases[server_name], "/v1/chat/completions", {**GREEDY_CHAT, "reasoning_effort": "high"})
    assert r.status_code == 200, r.text
    assert any("reasoning_effort is not read" in rec.getMessage() for rec in caplog.records)


def test_max_completion_tokens_wins_over_max_tokens_on_chat(bases):
    """OpenAI's newer name wins where both are given (vLLM's `max_completion_tokens or max_tokens`)."""
    body = {**GREEDY_CHAT, "max_tokens": 2, "max_completion_tokens": 5}
    r = _post(bases["plain"], "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text


def test_bad_words_are_vllms_on_the_server_too(bases, reference_llm):
    """bad_words (vLLM's): the words the greedy reply would have written are banned there, and the reply is the
    offline LLM's with the same words (the target's logits masked on every row, exact)."""
    free = _post(bases["plain"], "/v1/completions", GREEDY).json()["choices"][0]["text"].split()
    banned = free[:1]
    r = _post(bases["plain"], "/v1/completions", {**GREEDY, "bad_words": banned})
    assert r.status_code == 200, r.text
    want = reference_llm.generate([GREEDY["prompt"]], SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"],
                                                                      ignore_eos=True, bad_words=banned))[0].text
    assert r.json()["choices"][0]["text"] == want and banned[0] not in want.split()
