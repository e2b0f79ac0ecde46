"""Request edges of the OpenAI-compatible server, each as vLLM answers it: an assistant turn's reasoning in the
history reaches the chat template, the legacy completions' top_logprobs always hold the sampled token, any failure
of the chat template is a 400, return_token_ids and truncation_side, a seed near 2**63 - 1 with n > 1, and the
text part types vLLM reads as text. Over real HTTP (uvicorn) on an engine over a tiny Llama written by
transformers, with a real tokenizer."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist.serve.api import ServerOptions, create_app
from test_serve_fixtures import make_tokenizer, write_llama

# Reads a past turn's reasoning by both names, as Qwen3's (reasoning_content) and newer templates (reasoning) do
TEMPLATE = ("{% for m in messages %}{{ m.role }} : {% if m.reasoning %}why {{ m.reasoning }} {% endif %}"
            "{% if m.reasoning_content %}think {{ m.reasoning_content }} {% endif %}{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
USER = {"role": "user", "content": "the cat"}
PROMPT = "the cat sat on the mat"
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from saguaro_dist import LLM
    path = write_llama(tmp_path_factory.mktemp("edges"), make_tokenizer(), hidden=32, layers=1, seed=7)
    engine = LLM(model=path, mode="ar", max_model_len=64, max_batch_size=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(llm):
    """The base URL (with /v1) of the serving app, with TEMPLATE as its chat template."""
    with serve_on_loopback(create_app(llm, ServerOptions("m", chat_template=TEMPLATE))) as base:
        yield base


@pytest.fixture(scope="module")
def reasoning_url(llm):
    """The same with deepseek_r1's reasoning parser (a reply without </think> is all reasoning)."""
    with serve_on_loopback(create_app(llm, ServerOptions("m", chat_template=TEMPLATE,
                                                         reasoning_parser="deepseek_r1"))) as base:
        yield base


def _post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(url + path, json={"model": "m", **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={"model": "m", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _tokens(url: str, body: dict) -> list[int]:
    return _post(url.removesuffix("/v1"), "/tokenize", body)["tokens"]


# ---- 1. an assistant turn's reasoning in the history ----------------------------------------------------------
@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_past_reasoning_reaches_the_template_by_both_names(url, field):
    """Old: dropped by ChatMessage.for_template, so a template showing past reasoning never saw it. vLLM passes an
    assistant turn's reasoning as both `reasoning` and `reasoning_content`."""
    history = [USER, {"role": "assistant", "content": "a dog", field: "the mat"}, USER]
    want = ("user : the cat\nassistant : why the mat think the mat a dog\nuser : the cat\nassistant :")
    assert _tokens(url, {"messages": history}) == _tokens(url, {"prompt": want, "add_special_tokens": False})


def test_reasoning_on_a_turn_not_the_assistants_is_refused(url):
    error = _post(url, "/chat/completions", {"messages": [{**USER, "reasoning": "why"}], **GREEDY}, 400)["error"]
    assert "only assistant messages carry reasoning" in error["message"]


# ---- 2. the legacy completions' top_logprobs --------------------------------------------------------------------
def _check_holds_sampled(logprobs: dict, top_n: int) -> int:
    """Every position's top_logprobs: the sampled token with its logprob, and at most top_n others. Returns how
    many positions sampled a token outside the top top_n (their lists have top_n + 1 entries)."""
    outside = 0
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top[token] == value and len(top) <= top_n + 1
        outside += len(top) == top_n + 1
    return outside


def test_completion_top_logprobs_hold_the_sampled_token(url):
    """Old: exactly the top N by value, so a sampled token outside them was missing from its own top_logprobs.
    OpenAI's and vLLM's: the sampled token and the top N (up to logprobs + 1 entries)."""
    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 1.5, "seed": 1, "logprobs": 1, "ignore_eos": True}
    whole = _post(url, "/completions", body)["choices"][0]["logprobs"]
    assert _check_holds_sampled(whole, 1) > 0  # (temperature 1.5: some tokens sampled outside the top one)
    streamed = [c["choices"][0]["logprobs"] for c in _chunks(url, "/completions", body) if c["choices"]]
    assert [top for lp in streamed if lp for top in lp["top_logprobs"]] == whole["top_logprobs"]


def test_completion_logprobs_zero_gives_the_sampled_token(url):
    """Old: logprobs 0 gave {} at every position; OpenAI's and vLLM's: the sampled token alone."""
    lp = _post(url, "/completions", {"prompt": "the cat", "logprobs": 0, **GREEDY})["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


def test_echoed_prompt_tokens_hold_theirs(url):
    """vLLM's echo: each prompt token's top_logprobs hold it too (the first token's are null)."""
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    lp = _post(url, "/completions", body)["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None and lp["token_logprobs"][0] is None
    for token, value, top in list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))[1:]:
        assert top[token] == value and len(top) <= 2


def test_minus_infinity_is_sent_as_vllms_floor():
    """-inf is not JSON: vLLM sends -9999.0 for it, as the token's and in top_logprobs (chat's too)."""
    from saguaro_dist.serve import responses
    tokenizer = make_tokenizer()
    entries = [{5: -math.inf, 6: -0.1}, {6: -0.1, 5: -math.inf}]  # the chosen token's first, then the top ones
    legacy = responses.COMPLETION.logprobs(tokenizer, [5, 6], entries, 2)
    assert legacy["token_logprobs"] == [-9999.0, -0.1]
    assert [sorted(top.values()) for top in legacy["top_logprobs"]] == [[-9999.0, -0.1]] * 2
    chat = responses.CHAT.logprobs(tokenizer, [5, 6], entries, 2)["content"]
    assert [c["logprob"] for c in chat] == [-9999.0, -0.1]
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in chat] == [[-0.1, -9999.0]] * 2
    json.dumps([legacy, chat], allow_nan=False)


# ---- 3. a chat template that fails ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/chat/completions", "/tokenize"])
def test_a_template_failure_is_a_400(url, path):
    """Old: only Jinja's TemplateError was a 400; chat_template_kwargs {"messages": []} (a TypeError in the
    template's render) was a 500. vLLM's safe_apply_chat_template: any failure is a 400."""
    base = url.removesuffix("/v1") if path == "/tokenize" else url
    body = {"messages": [USER], "chat_template_kwargs": {"messages": []}, "max_tokens": 2}
    if path == "/tokenize":
        body.pop("max_tokens")
    error = _post(base, path, body, 400)["error"]
    assert "chat template" in error["message"] and "messages" in error["message"]


# ---- 4. return_token_ids and truncation_side ---------------------------------------------------------------
def test_completion_return_token_ids(url):
    """Old: ignored (logged as an unknown field). vLLM's: each choice's prompt_token_ids and token_ids; streamed,
    the prompt's in a choice's first chunk only, each chunk its own tokens'."""
    prompt_ids = _tokens(url, {"prompt": PROMPT})
    plain = _post(url, "/completions", {"prompt": PROMPT, **GREEDY})["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    whole = _post(url, "/completions", {"prompt": PROMPT, "return_token_ids": True, "n": 2, **GREEDY})
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 4
    chunks = [c["choices"][0] for c in _chunks(url, "/completions", {"prompt": PROMPT, "return_token_ids": True,
                                                                      **GREEDY}) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["choices"][0]["token_ids"]


def test_chat_return_token_ids(url):
    """vLLM's chat: prompt_token_ids beside the choices (streamed: on the role chunk), token_ids on each choice."""
    prompt_ids = _tokens(url, {"messages": [USER]})
    body = {"messages": [USER], "return_token_ids": True, **GREEDY}
    whole = _post(url, "/chat/completions", body)
    assert whole["prompt_token_ids"] == prompt_ids and len(whole["choices"][0]["token_ids"]) == 4
    chunks = _chunks(url, "/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids = [t for c in chunks[1:] if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert ids == whole["choices"][0]["token_ids"]


def test_chat_token_ids_are_hidden_with_the_reasoning(reasoning_url):
    """vLLM's rule: with include_reasoning false, chat's token_ids are left out where a reasoning parser reads the
    reply (they would show the reasoning hidden); the prompt's still come."""
    body = {"messages": [USER], "return_token_ids": True, "include_reasoning": False, **GREEDY}
    whole = _post(reasoning_url, "/chat/completions", body)
    assert "token_ids" not in whole["choices"][0] and "prompt_token_ids" in whole
    chunks = _chunks(reasoning_url, "/chat/completions", body)
    assert not any("token_ids" in choice for c in chunks for choice in c["choices"])
    shown = _post(reasoning_url, "/chat/completions", {**body, "include_reasoning": True})
    assert len(shown["choices"][0]["token_ids"]) == 4


def test_truncation_side_right_keeps_the_first_tokens(url):
    """Old: truncation_side ignored, the prompt cut from the left whatever it said. vLLM's completions: "right"
    keeps the first truncate_prompt_tokens, "left" (the default) the last."""
    ids = _tokens(url, {"prompt": PROMPT})
    body = {"prompt": PROMPT, "truncate_prompt_tokens": 3, "return_token_ids": True, **GREEDY}
    for side, kept in (("right", ids[:3]), ("left", ids[-3:]), (None, ids[-3:])):
        assert _post(url, "/completions", {**body, "truncation_side": side})["choices"][0]["prompt_token_ids"] == kept


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"messages": [USER], "truncation_side": "right"}),
    ("/responses", {"input": "the cat", "truncation_side": "right"}),
    ("/responses", {"input": "the cat", "return_token_ids": True}),
])
def test_fields_a_route_cannot_honour_are_refused(url, path, body):
    error = _post(url, path, {**body, "max_tokens": 2} if path != "/responses" else body, 400)["error"]
    assert next(iter(k for k in body if k not in ("messages", "input"))) in error["message"]


# ---- 5. seeds near 2**63 - 1 with n > 1 ------------------------------------------------------------------------
def test_the_last_seed_with_n_samples(url):
    """Old: sample i's seed + i past 2**63 - 1 made a valid request a 400. Now it wraps into int64: sample 1 of
    seed 2**63 - 1 draws as seed -2**63 does, and small seeds are as before (sample 1 of seed 5 is seed 6)."""
    def texts(seed: int, n: int) -> list[str]:
        body = {"prompt": "the cat", "max_tokens": 6, "temperature": 1.5, "seed": seed, "n": n, "ignore_eos": True}
        return [c["text"] for c in _post(url, "/completions", body)["choices"]]
    assert texts(2 ** 63 - 1, 2) == texts(2 ** 63 - 1, 1) + texts(-2 ** 63, 1)
    assert texts(5, 2)[1] == texts(6, 1)[0]


def test_sample_seed_wraps_into_int64():
    from saguaro_dist.engine.llm_inputs import sample_seed
    assert [sample_seed(2 ** 63 - 2, i) for i in range(3)] == [2 ** 63 - 2, 2 ** 63 - 1, -2 ** 63]
    assert sample_seed(None, 3) is None and sample_seed(-7, 2) == -5


# ---- 6. text part types ----------------------------------------------------------------------------------------
def test_refusal_input_text_output_text_and_thinking_parts_are_text(url):
    """Old: a 400 ("reads text parts only"). vLLM reads them as text (TEXT_PART_TYPES), joined one a line."""
    parts = [{"type": "refusal", "refusal": "the"}, {"type": "input_text", "text": "cat"},
             {"type": "output_text", "text": "sat"}, {"type": "thinking", "thinking": "on"}]
    as_parts = _tokens(url, {"messages": [{"role": "assistant", "content": parts}, USER]})
    assert as_parts == _tokens(url, {"messages": [{"role": "assistant", "content": "the\ncat\nsat\non"}, USER]})
    error = _post(url, "/chat/completions", {"messages": [{"role": "user", "content": [{"type": "refusal",
                                                                                          "text": "x"}]}]}, 400)
    assert "'refusal'" in error["error"]["message"]
