"""The last vLLM fields that were refused and are honoured now, as vLLM honours them: /v1/responses'
`truncation: "auto"`, `include_reasoning: false` (chat and responses), and the rank of a prompt token outside
the top N in `prompt_logprobs`. Over real HTTP to the serving app (uvicorn) on engines over tiny Llamas
written by transformers: a random one with a short context, and one whose greedy reply is scripted,
Qwen3-style, "<think> add them</think> 4" (test_serve_reasoning_tokens.py)."""
from __future__ import annotations

import json

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from test_serve_fixtures import make_tokenizer, write_llama
from test_serve_reasoning_tokens import CONTENT, REASONING, write_scripted_checkpoint

MAX_MODEL_LEN = 32
LONG = " ".join(["the cat sat on the mat"] * 8)  # 48 words: past the context
QUESTION = [{"role": "user", "content": "2 + 2?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base URL, checkpoint) of a server on a random tiny Llama with a 32-token context."""
    path = write_llama(tmp_path_factory.mktemp("tiny"), make_tokenizer(), hidden=64, layers=2, seed=5)
    llm = LLM(model=path, mode="ar", max_model_len=MAX_MODEL_LEN)
    with serve_on_loopback(create_app(llm, ServerOptions("tiny"))) as url:
        yield url, path
    llm.shutdown()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """Base URL of a qwen3-parsing server on the scripted thinking model."""
    path = tmp_path_factory.mktemp("scripted")
    write_scripted_checkpoint(path)
    llm = LLM(model=str(path), mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("scripted", reasoning_parser="qwen3"))) as url:
        yield url
    llm.shutdown()


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _message_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


# ---- truncation: "auto" -------------------------------------------------------------------------
def _chat_prompt(url: str, text: str) -> list[int]:
    ids = _post(url.removesuffix("/v1"), "/tokenize", {"messages": [{"role": "user", "content": text}]})["tokens"]
    assert len(ids) > MAX_MODEL_LEN
    return ids


def test_truncation_auto_keeps_the_inputs_end_that_leaves_room_for_the_reply(tiny):
    """Old: a 400 naming truncation. vLLM keeps the input's last max_model_len - max_output_tokens tokens;
    the reply is the one the truncated prompt gets (greedy)."""
    url, _ = tiny
    ids, greedy = _chat_prompt(url, LONG), {"temperature": 0, "ignore_eos": True}
    response = _post(url, "/responses", {"input": LONG, "truncation": "auto", "max_output_tokens": 4, **greedy})
    kept = MAX_MODEL_LEN - 4
    assert response["truncation"] == "auto" and response["usage"]["input_tokens"] == kept
    reference = _post(url, "/completions", {"prompt": ids[-kept:], "max_tokens": 4, **greedy})
    assert _message_text(response) == reference["choices"][0]["text"] and response["usage"]["output_tokens"] == 4
    streamed = _events(url, "/responses", {"input": LONG, "truncation": "auto", "max_output_tokens": 4, **greedy})
    assert _message_text(streamed[-1]["response"]) == _message_text(response)


def test_truncation_auto_without_max_output_tokens_leaves_one_tokens_room(tiny):
    """vLLM keeps max_model_len tokens there (no room: its request fails); here the reply gets one token."""
    url, _ = tiny
    response = _post(url, "/responses", {"input": LONG, "truncation": "auto", "temperature": 0, "ignore_eos": True})
    assert response["usage"]["input_tokens"] == MAX_MODEL_LEN - 1 and response["usage"]["output_tokens"] == 1


@pytest.mark.parametrize("truncation", [None, "disabled"])
def test_without_truncation_a_long_input_is_still_a_400(tiny, truncation):
    url, _ = tiny
    body = {"input": LONG, "max_output_tokens": 4, **({"truncation": truncation} if truncation else {})}
    r = httpx.post(url + "/responses", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


# ---- include_reasoning: false -------------------------------------------------------------------
def test_chat_include_reasoning_false_leaves_the_reasoning_out(scripted):
    """Old: a 400. vLLM drops the reasoning (no `reasoning` field or delta); the content is what follows
    </think>, streamed or not."""
    body = {"model": "scripted", "messages": QUESTION, "temperature": 0, "include_reasoning": False}
    message = _post(scripted, "/chat/completions", body)["choices"][0]["message"]
    assert message["content"] == CONTENT and "reasoning" not in message and "reasoning_content" not in message
    chunks = _events(scripted, "/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == CONTENT
    shown = _post(scripted, "/chat/completions", {**body, "include_reasoning": True})["choices"][0]["message"]
    assert (shown["reasoning"], shown["content"]) == (REASONING, CONTENT)  # the default, unchanged


def test_chat_include_reasoning_false_constrains_from_the_first_token(scripted):
    """As vLLM's (reasoning_ended): with the reasoning left out, a constrained reply is held to its constraint
    from the start, not let to reason first."""
    body = {"model": "scripted", "messages": QUESTION, "temperature": 0, "include_reasoning": False,
            "structured_outputs": {"choice": ["yes", "no"]}}
    message = _post(scripted, "/chat/completions", body)["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and "reasoning" not in message


def test_responses_include_reasoning_false_has_no_reasoning_item(scripted):
    """Old: a 400. The response has no reasoning item (nor its stream any reasoning event); usage still
    counts the reasoning tokens generated."""
    body = {"model": "scripted", "input": "2 + 2?", "temperature": 0, "include_reasoning": False}
    response = _post(scripted, "/responses", body)
    assert [item["type"] for item in response["output"]] == ["message"] and _message_text(response) == CONTENT
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    events = _events(scripted, "/responses", body)
    assert not any("reasoning" in e["type"] or e.get("item", {}).get("type") == "reasoning" for e in events)
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["message"]
    assert _message_text(events[-1]["response"]) == CONTENT


# ---- prompt_logprobs: the rank of a token outside the top N --------------------------------------
def _reference_logprobs(path: str, ids: list[int]):
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("top", [0, 1])
def test_a_prompt_token_outside_the_top_n_has_vllms_rank(tiny, top):
    """Old: rank null. vLLM's rank: how many tokens are at least as likely as the prompt token, from
    transformers' log_softmax over the prompt."""
    url, path = tiny
    prompt = "a dog ran in the park and the cat sat on the mat"
    got = _post(url, "/completions", {"prompt": prompt, "prompt_logprobs": top, "max_tokens": 1})["choices"][0]
    ids = _post(url.removesuffix("/v1"), "/tokenize", {"prompt": prompt})["tokens"]
    rows, outside = _reference_logprobs(path, ids), 0
    for token, entry, row in zip(ids[1:], got["prompt_logprobs"][1:], rows):
        want = int((row >= row[token]).sum())
        if want > top:
            outside += 1
            assert entry[str(token)]["rank"] == want
    assert outside > 0 and len(rows) == len(ids)
