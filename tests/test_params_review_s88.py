"""Review of request validation (session 88): chat's echo with use_beam_search asks for no prompt scores, beam
search takes (and ignores) seed as vLLM's, a 400 names the request's own field (length_penalty, /detokenize's
tokens, min_tokens against the route's length field and the client's value), and offline SamplingParams takes
numpy / torch scalars, stored as plain Python numbers. Over real HTTP (uvicorn) on an engine over a tiny Llama
written by transformers."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from http_helpers import serve_on_loopback
from saguaro_dist import SamplingParams
from saguaro_dist.serve.api import ServerOptions, create_app
from test_serve_fixtures import make_tokenizer, write_llama

MAX_MODEL_LEN = 128
# temperature 0: at the served default (1.0) each step's sampled token joins its top candidates, as in vLLM, so
# a sampled EOS (about 1 search in 60 here) completes a short beam that outranks the others: runs then differ
BEAM = {"model": "m", "max_tokens": 2, "use_beam_search": True, "n": 2, "temperature": 0}
CONTINUED = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}],
             "add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from saguaro_dist import LLM
    path = write_llama(tmp_path_factory.mktemp("s88"), make_tokenizer(), hidden=32, layers=1, seed=3)
    with LLM(model=path, mode="ar", max_model_len=MAX_MODEL_LEN, max_batch_size=4) as llm, \
            serve_on_loopback(create_app(llm, ServerOptions("m"))) as base:
        yield base


def _post(url: str, path: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):  # raw JSON (NaN)
        return httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=120)
    return httpx.post(url + path, json=body, timeout=120)


def _contents(reply: httpx.Response) -> list[str]:
    assert reply.status_code == 200, reply.text
    return [c["message"]["content"] for c in reply.json()["choices"]]


@pytest.mark.slow
def test_chat_echo_runs_with_beam_search_when_no_logprobs_are_asked(url):
    """vLLM's: echo alone asks for no prompt scores, so the search runs (a new turn: nothing echoed; a continued
    prefill: its text before each beam's), streamed or not; echo with logprobs stays a 400 naming echo."""
    fresh = {**BEAM, "messages": [{"role": "user", "content": "the cat"}]}
    assert _contents(_post(url, "/chat/completions", {**fresh, "echo": True})) == \
        _contents(_post(url, "/chat/completions", fresh))
    plain = _contents(_post(url, "/chat/completions", {**BEAM, **CONTINUED}))
    echoed = _contents(_post(url, "/chat/completions", {**BEAM, **CONTINUED, "echo": True}))
    assert echoed == ["sat" + text for text in plain]
    scored = _post(url, "/chat/completions", {**fresh, "echo": True, "logprobs": True})
    assert scored.status_code == 400 and scored.json()["error"]["param"] == "echo", scored.text


@pytest.mark.slow
def test_beam_search_takes_seed_and_ignores_it(url):
    """vLLM's to_beam_search_params leaves seed unread (OpenAI SDK users send one): the same beams."""
    body = {**BEAM, "prompt": "the cat", "temperature": 0}
    without = _post(url, "/completions", body)
    seeded = _post(url, "/completions", {**body, "seed": 7})
    assert seeded.status_code == 200, seeded.text
    assert [c["text"] for c in seeded.json()["choices"]] == [c["text"] for c in without.json()["choices"]]


@pytest.mark.slow
@pytest.mark.parametrize("path, prompt", [("/completions", '"prompt": "the cat"'),
                                          ("/chat/completions", '"messages": [{"role": "user", "content": "x"}]')])
def test_a_nan_length_penalty_names_the_request_field(url, path, prompt):
    reply = _post(url, path, '{"model": "m", %s, "max_tokens": 2, "use_beam_search": true, "n": 2, '
                             '"length_penalty": NaN}' % prompt)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "length_penalty" and "BeamSearchParams" not in error["message"], error


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [[-1], [10 ** 6]])
def test_detokenize_names_tokens(url, tokens):
    reply = _post(url.removesuffix("/v1"), "/detokenize", {"model": "m", "tokens": tokens})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens", reply.text


@pytest.mark.slow
@pytest.mark.parametrize("path, body, named, unnamed", [
    ("/completions", {"prompt": "the cat", "max_tokens": 0, "echo": True, "min_tokens": 2}, "max_tokens (0)", "(1)"),
    ("/completions", {"prompt": "the cat", "max_tokens": 3, "min_tokens": 4}, "max_tokens (3)", None),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2,
                           "min_tokens": 3}, "max_completion_tokens (2)", "max_tokens"),
    ("/responses", {"input": "the cat", "max_output_tokens": 3, "min_tokens": 4}, "max_output_tokens (3)",
     "max_tokens"),
    ("/responses", {"input": "the cat", "min_tokens": 500}, "max_output_tokens left out", "max_tokens")])
def test_min_tokens_names_the_routes_length_field_and_the_clients_value(url, path, body, named, unnamed):
    reply = _post(url, path, {"model": "m", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "min_tokens" and named in error["message"], error
    assert unnamed is None or unnamed not in error["message"], error


@pytest.mark.parametrize("name, value, plain", [
    ("temperature", np.float32(0.5), 0.5), ("temperature", torch.tensor(0.5), 0.5), ("top_p", np.float32(0.25), 0.25),
    ("min_p", np.float64(0.1), 0.1), ("presence_penalty", np.float16(1.0), 1.0), ("repetition_penalty", np.int64(2), 2),
    ("seed", np.int64(5), 5), ("seed", torch.tensor(5), 5), ("n", np.int32(2), 2), ("max_tokens", np.int64(8), 8),
    ("min_tokens", np.uint8(1), 1), ("top_k", np.int64(3), 3), ("logprobs", np.int64(2), 2)])
def test_numpy_and_torch_scalars_are_plain_numbers(name, value, plain):
    """numbers as numpy and torch hold them (np.float32 was refused, np.float64 passed), stored as the Python
    int / float they are: msgpack, protobuf and Ray see only those downstream."""
    got = getattr(SamplingParams(**{name: value}), name)
    assert got == plain and type(got) is type(plain)


def test_numpy_token_ids_and_biases_are_plain_numbers():
    params = SamplingParams(stop_token_ids=np.array([3, 4]), allowed_token_ids=[np.int64(5), 6],
                            logit_bias={np.int64(3): np.float32(1.5)})
    assert params.stop_token_ids == (3, 4) and all(type(t) is int for t in params.stop_token_ids)
    assert params.allowed_token_ids == (5, 6) and all(type(t) is int for t in params.allowed_token_ids)
    assert params.logit_bias == ((3, 1.5),) and type(params.logit_bias[0][0]) is int


@pytest.mark.parametrize("name, value", [
    ("n", np.bool_(True)), ("n", True), ("temperature", np.bool_(True)), ("seed", np.float32(5.0)),
    ("max_tokens", torch.tensor(8.0)), ("temperature", np.array([0.5])), ("temperature", "0.5"),
    ("temperature", np.float32("nan"))])
def test_bools_floats_for_ints_and_arrays_stay_refused(name, value):
    with pytest.raises(ValueError, match=name.split("_")[0]):
        SamplingParams(**{name: value})
