"""vLLM's request fields that were refused and are honoured now, as vLLM honours them: prompt_logprobs,
return_tokens_as_token_ids, stream_options.continuous_usage_stats, add_special_tokens and request_id. Over
real HTTP to the serving app (uvicorn) on an engine over a tiny Llama written by transformers, whose
tokenizer adds BOS, as most do (the shared fixtures' does not)."""
from __future__ import annotations

import json

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist.serve.api import ServerOptions, create_app
from test_serve_fixtures import make_tokenizer, write_llama

PROMPT = "the cat sat on the mat"
TEMPLATE = "{% for m in messages %}{{ m.role }} : {{ m.content }}\n{% endfor %}assistant :"  # writes no BOS
HI = [{"role": "user", "content": "the cat sat on"}]
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _bos_tokenizer():
    """The fixtures' word-level tokenizer, with a post-processor that puts <s> first (as Llama's does)."""
    from tokenizers import processors
    tokenizer = make_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert tokenizer.encode("the cat")[0] == bos and tokenizer.encode("the cat", add_special_tokens=False)[0] != bos
    return tokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return write_llama(tmp_path_factory.mktemp("bos_target"), _bos_tokenizer(), hidden=64, layers=2, seed=3)


@pytest.fixture(scope="module")
def urls(target):
    """Base URLs (with /v1) of two apps on one engine: the plain transcript, and a chat template."""
    from saguaro_dist import LLM
    llm = LLM(model=target, mode="ar", max_model_len=256)
    plain, templated = create_app(llm, ServerOptions("tiny")), create_app(llm, ServerOptions("tiny", chat_template=TEMPLATE))
    with serve_on_loopback(plain) as plain_url, serve_on_loopback(templated) as templated_url:
        yield {"plain": plain_url, "templated": templated_url}
    llm.shutdown()


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    r = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _ids(url: str, text: str, special: bool) -> list[int]:
    return _post(url.removesuffix("/v1"), "/tokenize", {"prompt": text, "add_special_tokens": special})["tokens"]


def _reference_logprobs(target: str, ids: list[int]):
    """transformers' log_softmax over the prompt: row i scores token i + 1."""
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_prompt_logprobs(target: str, ids: list[int], got: list, top: int, tokenizer) -> None:
    """vLLM's shape: None first, then {"<id>": {logprob, rank, decoded_token}}, the prompt token first."""
    want = _reference_logprobs(target, ids)
    assert got[0] is None and len(got) == len(ids)
    for position, (token, entry) in enumerate(zip(ids[1:], got[1:])):
        row = want[position]
        assert next(iter(entry)) == str(token)
        best = row.topk(top).indices.tolist() if top else []
        assert {str(t) for t in best} <= set(entry) and len(entry) <= top + 1
        for key, value in entry.items():
            assert abs(value["logprob"] - float(row[int(key)])) < 1e-4
            assert value["decoded_token"] == tokenizer.decode([int(key)])
        for rank, t in enumerate(best, start=1):
            assert entry[str(t)]["rank"] == rank
        if str(token) not in {str(t) for t in best}:  # listed apart: vLLM's rank, the tokens at least as likely
            assert entry[str(token)]["rank"] == int((row >= row[token]).sum())


def test_completions_prompt_logprobs_are_the_targets_per_choice(urls, target):
    """Old: a 400. vLLM returns them on each choice (the prompt's, for each of its n samples)."""
    url = urls["plain"]
    body = _post(url, "/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "n": 2, **GREEDY})
    ids = _ids(url, PROMPT, True)
    for choice in body["choices"]:
        _check_prompt_logprobs(target, ids, choice["prompt_logprobs"], 2, _bos_tokenizer())
    plain = _post(url, "/completions", {"prompt": PROMPT, **GREEDY})
    assert [c["text"] for c in body["choices"]] == [plain["choices"][0]["text"]] * 2  # nothing else changes
    assert plain["choices"][0]["prompt_logprobs"] is None  # vLLM's null when not asked
    zero = _post(url, "/completions", {"prompt": PROMPT, "prompt_logprobs": 0, **GREEDY})["choices"][0]["prompt_logprobs"]
    assert all(len(entry) == 1 for entry in zero[1:])
    echoed = _post(url, "/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, **GREEDY})["choices"][0]
    _check_prompt_logprobs(target, ids, echoed["prompt_logprobs"], 1, _bos_tokenizer())  # vLLM's: echo's too


def test_chat_prompt_logprobs_are_the_responses_and_echo_brings_them(urls, target):
    """vLLM's chat: one top-level prompt_logprobs for the one prompt; echo asks for them (top_logprobs each)."""
    url = urls["templated"]
    body = _post(url, "/chat/completions", {"messages": HI, "prompt_logprobs": 1, **GREEDY})
    ids = _post(url.removesuffix("/v1"), "/tokenize", {"messages": HI})["tokens"]
    _check_prompt_logprobs(target, ids, body["prompt_logprobs"], 1, _bos_tokenizer())
    assert _post(url, "/chat/completions", {"messages": HI, **GREEDY})["prompt_logprobs"] is None
    echoed = _post(url, "/chat/completions", {"messages": HI, "echo": True, **GREEDY})
    _check_prompt_logprobs(target, ids, echoed["prompt_logprobs"], 0, _bos_tokenizer())


@pytest.mark.parametrize("path, body", [("/completions", {"prompt": PROMPT}), ("/chat/completions", {"messages": HI})])
def test_prompt_logprobs_are_refused_with_stream(urls, path, body):
    """vLLM's rule (it lets 0 through and sends nothing: here no field is dropped), and range checks."""
    for extra in ({"stream": True, "prompt_logprobs": 0}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
        r = httpx.post(urls["plain"] + path, json={**body, **extra, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_return_tokens_as_token_ids_names_completion_tokens_by_id(urls):
    """Old: a 400. vLLM's "token_id:<id>" for each token and top token (echoed prompt tokens too), streamed or not."""
    url = urls["plain"]
    plain = _post(url, "/completions", {"prompt": PROMPT, "logprobs": 2, "echo": True, **GREEDY})["choices"][0]
    named = _post(url, "/completions", {"prompt": PROMPT, "logprobs": 2, "echo": True, "return_tokens_as_token_ids": True,
                                        **GREEDY})["choices"][0]
    ids = _ids(url, PROMPT, True) + [_ids(url, t, False)[0] for t in plain["logprobs"]["tokens"][len(_ids(url, PROMPT, True)):]]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"] and named["text"] == plain["text"]
    for mine, theirs in zip(named["logprobs"]["top_logprobs"][1:], plain["logprobs"]["top_logprobs"][1:]):
        assert sorted(mine.values()) == sorted(theirs.values()) and all(k.startswith("token_id:") for k in mine)
    chunks = _chunks(url, "/completions", {"prompt": PROMPT, "logprobs": 0, "stream": True,
                                           "return_tokens_as_token_ids": True, **GREEDY})
    streamed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == [f"token_id:{t}" for t in ids[-4:]]


def test_return_tokens_as_token_ids_names_chat_tokens_by_id(urls):
    """Chat's: token named by id, bytes still the token's text's; a top token's bytes are its name's (vLLM's)."""
    url = urls["templated"]
    ask = {"messages": HI, "logprobs": True, "top_logprobs": 2, **GREEDY}
    plain = _post(url, "/chat/completions", ask)["choices"][0]["logprobs"]["content"]
    named = _post(url, "/chat/completions", {**ask, "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]["content"]
    for mine, theirs in zip(named, plain, strict=True):
        token_id = _ids(url, theirs["token"], False)[0]
        assert mine["token"] == f"token_id:{token_id}" and mine["bytes"] == theirs["bytes"]
        assert mine["logprob"] == theirs["logprob"]
        for top in mine["top_logprobs"]:
            assert top["token"].startswith("token_id:") and top["bytes"] == list(top["token"].encode())


def test_streamed_text_offsets_are_the_whole_replys(urls):
    """A chunk brings the log-probabilities of every token whose text has started, though a stop string's
    length of it waits (it may be one): its text_offset counts the tokens' own texts, as the whole reply's.
    Old: each chunk's offsets went on from the text streamed so far, behind: they overlapped the last ones."""
    body = {"prompt": PROMPT, "logprobs": 0, "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 16,
            "ignore_eos": True, "stop": ["a stop string never seen"]}
    whole = _post(urls["plain"], "/completions", body)["choices"]
    chunks = _chunks(urls["plain"], "/completions", {**body, "stream": True})
    for choice in whole:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert offsets == choice["logprobs"]["text_offset"] == sorted(offsets)


@pytest.mark.parametrize("path, body", [("/completions", {"prompt": PROMPT}), ("/chat/completions", {"messages": HI})])
def test_continuous_usage_stats_put_usage_on_every_chunk(urls, path, body):
    """Old: a 400. vLLM's: with include_usage, each chunk carries its choice's usage so far; the last chunk
    the request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(urls["plain"], path, {**body, **GREEDY, "n": 2, "stream": True, "stream_options": options})
    *per_choice, final = chunks
    prompt_tokens = final["usage"]["prompt_tokens"] // 1
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    for index in (0, 1):
        usages = [c["usage"] for c in per_choice if c["choices"][0]["index"] == index]
        counts = [u["completion_tokens"] for u in usages]
        # (>= 1 chunk: a speculative round, or the stream's coalescing on a loaded box, may carry all 4 tokens
        # of a choice in its first chunk; every chunk carries its choice's usage so far either way)
        assert counts == sorted(counts) and counts[-1] == 4 and len(usages) >= 1
        assert all(u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
                   for u in usages)
    # vLLM's rule: continuous_usage_stats without include_usage adds nothing
    quiet = _chunks(urls["plain"], path, {**body, **GREEDY, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in quiet[:-1])


def test_add_special_tokens_false_drops_the_bos_of_a_completions_prompt(urls):
    """Old: a 400. vLLM's add_special_tokens (true by default on completions)."""
    url = urls["plain"]
    with_bos, without = _ids(url, PROMPT, True), _ids(url, PROMPT, False)
    assert with_bos == [with_bos[0]] + without
    dropped = _post(url, "/completions", {"prompt": PROMPT, "add_special_tokens": False, **GREEDY})
    as_ids = _post(url, "/completions", {"prompt": without, **GREEDY})
    assert dropped["choices"][0]["text"] == as_ids["choices"][0]["text"]
    assert dropped["usage"]["prompt_tokens"] == len(without)
    assert _post(url, "/completions", {"prompt": PROMPT, **GREEDY})["usage"]["prompt_tokens"] == len(with_bos)


def test_add_special_tokens_true_puts_bos_before_a_chat_templates_text(urls):
    """Old: a 400. vLLM's add_special_tokens (false by default on chat: the template writes them); /tokenize
    counts what chat runs, with the flag or without."""
    url = urls["templated"]
    root = url.removesuffix("/v1")
    bare = _post(root, "/tokenize", {"messages": HI})["tokens"]
    with_bos = _post(root, "/tokenize", {"messages": HI, "add_special_tokens": True})["tokens"]
    assert with_bos[1:] == bare and with_bos[0] == _ids(url, "the", True)[0]
    for flag, ids in ((False, bare), (True, with_bos)):
        chat = _post(url, "/chat/completions", {"messages": HI, "add_special_tokens": flag, **GREEDY})
        completion = _post(url, "/completions", {"prompt": ids, **GREEDY})
        assert chat["usage"]["prompt_tokens"] == len(ids)
        assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


@pytest.mark.parametrize("path, body, prefix", [("/completions", {"prompt": PROMPT}, "cmpl"),
                                                ("/chat/completions", {"messages": HI}, "chatcmpl")])
def test_request_id_names_the_request_unless_a_header_does(urls, path, body, prefix):
    """Old: a 400. vLLM's order: the X-Request-Id header, else the body's request_id, else a fresh one."""
    url = urls["plain"]
    ask = {**body, "max_tokens": 2}
    assert _post(url, path, {**ask, "request_id": "job-1"})["id"] == f"{prefix}-job-1"
    streamed = _chunks(url, path, {**ask, "request_id": "job-2", "stream": True})
    assert {c["id"] for c in streamed} == {f"{prefix}-job-2"}
    assert _post(url, path, {**ask, "request_id": "job-3"}, {"X-Request-Id": "hdr-3"})["id"] == f"{prefix}-hdr-3"
    r = httpx.post(url + path, json={**ask, "request_id": "no spaces"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text


@pytest.mark.parametrize("extra, param", [({"prompt_logprobs": 1}, "prompt_logprobs"),
                                          ({"request_id": "r-1"}, "request_id"),
                                          ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
                                          ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
                                           "stream_options")])
def test_responses_still_refuses_what_it_does_not_honour(urls, extra, param):
    """/v1/responses shares the sampling fields; it honours none of these, so they stay a 400 there."""
    r = httpx.post(urls["plain"] + "/responses", json={"input": "the cat", "max_output_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
