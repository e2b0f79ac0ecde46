"""The Ray Serve OpenAI app on loopback, driven by the `openai` package and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from saguaro_dist import SamplingParams
from saguaro_dist.serve.prompts import encode_chat
from saguaro_dist.serve.protocol import ChatMessage
from test_serve_fixtures import app_stats

pytest_plugins = ["test_serve_fixtures"]

PROMPTS = ["the cat sat on", "hello world", "def add ( a , b )", "import os", "a dog ran", "class Stack",
           "saguaro cactus", "for i in range", "the mat", "speculative decoding", "the target verifies",
           "grows slowly", "from the desert", "return a + b", "park", "tokens and"]


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


def greedy(reference_llm, prompt: str, max_tokens: int) -> str:
    return reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].text


def post(server, path: str, body=None, headers=None, **kwargs) -> httpx.Response:
    headers = server.headers if headers is None else headers
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kwargs)


# ---- OpenAI client: completions and chat, plain and streamed ------------------------------------
def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list().data] == [server.model]
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    from saguaro_dist import __version__
    assert httpx.get(server.url + "/version", headers=server.headers).json() == {"version": __version__}


def test_completion_greedy_matches_llm_generate(server, oai, reference_llm):
    out = oai.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert out.choices[0].text == greedy(reference_llm, PROMPTS[0], 24)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(reference_llm.tokenizer.encode(PROMPTS[0]))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    stats = out.model_extra["speculation"]
    assert stats["mode"] == "ssd" and stats["rounds"] >= 1
    assert {"acceptance_rate", "mean_accepted_length", "cache_hit_rate"} <= stats.keys()


def test_chat_greedy_matches_llm_generate(server, oai, reference_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
    out = oai.chat.completions.create(model=server.model, messages=messages, max_tokens=20, temperature=0)
    ids = encode_chat(reference_llm.tokenizer, [ChatMessage(**m) for m in messages])
    expected = reference_llm.generate(prompt_token_ids=[ids],
                                      sampling_params=SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(ids)


def test_responses_through_serve_equal_the_chat_reply(server, oai, reference_llm):
    """/v1/responses on the Ray Serve deployment (SSD behind it): the chat turn's greedy reply, whole and streamed."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
    ids = encode_chat(reference_llm.tokenizer, [ChatMessage(**m) for m in messages])
    expected = reference_llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=20))[0]
    body = dict(model=server.model, instructions="be brief", input="the cat sat", max_output_tokens=20, temperature=0)
    resp = oai.responses.create(**body)
    events = list(oai.responses.create(stream=True, **body))
    assert resp.output_text == expected.text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert resp.usage.input_tokens == len(ids) and resp.model_extra["speculation"]["rounds"] >= 1


def test_streamed_completion_equals_generate_and_ends_with_stats(server, oai, reference_llm):
    stream = oai.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                    stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == greedy(reference_llm, PROMPTS[1], 24)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra["speculation"]["rounds"] >= 1
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streamed_chat_chunks(server, oai):
    stream = oai.chat.completions.create(messages=[{"role": "user", "content": "hello"}], model=server.model,
                                         max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1  # OpenAI's usage chunk
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def reference_logprobs(reference_llm, prompt_ids: list[int], max_tokens: int, top: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=top)
    return reference_llm.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0]


def test_completion_logprobs_plain_and_streamed(server, oai, reference_llm):
    """The legacy completions object (tokens, token_logprobs, top_logprobs, text_offset), equal to the
    engine's own figures; streamed chunks carry the same, chunk by chunk."""
    want = reference_logprobs(reference_llm, reference_llm.tokenizer.encode(PROMPTS[2]), 10, 2)
    out = oai.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=10, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([next(iter(e.values())).logprob for e in want.logprobs])
    assert lp.tokens == [reference_llm.tokenizer.decode([t]) for t in want.token_ids]
    assert all(len(top) == 2 and max(top.values()) >= chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(oai.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                         logprobs=2, stream=True))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(server, oai, reference_llm):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, temperature 0."""
    ids = reference_llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    want = reference_llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
    out = oai.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=1,
                                 echo=True)
    choice = out.choices[0]
    choice_lp = choice.logprobs
    assert choice.text == reference_llm.tokenizer.decode(ids) + want.text
    assert len(choice_lp.tokens) == len(ids) + 1 and choice_lp.token_logprobs[0] is None
    expected = [e[t].logprob for t, e in zip(ids[1:], want.prompt_logprobs[1:])] + [want.logprobs[0][want.token_ids[0]].logprob]
    assert choice_lp.token_logprobs[1:] == pytest.approx(expected)
    plain = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "echo": True}).json()
    assert plain["choices"][0]["text"].startswith(reference_llm.tokenizer.decode(ids))
    assert plain["choices"][0]["logprobs"] is None
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    # max_tokens 0 with echo scores the prompt alone, as OpenAI's legacy API allowed
    scored = oai.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=0, temperature=0, logprobs=0,
                                    echo=True)
    assert scored.choices[0].text == reference_llm.tokenizer.decode(ids) and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected[:-1])
    assert len(scored.choices[0].logprobs.tokens) == len(ids)


def test_chat_logprobs_and_their_validation(server, oai, reference_llm):
    messages = [{"role": "user", "content": "the cat sat"}]
    ids = encode_chat(reference_llm.tokenizer, [ChatMessage(**m) for m in messages])
    want = reference_logprobs(reference_llm, ids, 8, 3)
    out = oai.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0,
                                      logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([next(iter(e.values())).logprob for e in want.logprobs])
    assert all(len(c.top_logprobs) == 3 and bytes(c.bytes).decode() == c.token for c in content)
    plain = oai.chat.completions.create(model=server.model, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    r = post(server, "/v1/chat/completions", {"messages": messages, "top_logprobs": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "top_logprobs" and "logprobs set to true" in error["message"]


def test_n_samples_per_prompt_in_openai_order_reproducibly(server, oai, reference_llm):
    """n choices per prompt, prompt-major; sample i of a seeded request draws from seed + i, so a
    request repeats exactly and its samples are the in-process engine's with those seeds."""
    body = dict(model=server.model, prompt=PROMPTS[:2], max_tokens=8, temperature=1.0, seed=5, n=3)
    first, second = oai.completions.create(**body), oai.completions.create(**body)
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    for j, choice in enumerate(first.choices):
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=5 + j % 3)
        assert choice.text == reference_llm.generate([PROMPTS[j // 3]], params)[0].text
    prompt_tokens = sum(len(reference_llm.tokenizer.encode(p)) for p in PROMPTS[:2])
    assert first.usage.prompt_tokens == prompt_tokens  # each prompt once, as OpenAI counts it
    chunks = list(oai.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=1.0, seed=1, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finished) == [0, 1]


def test_sse_wire_format(server):
    body = {"prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_missing_model_means_the_served_one_and_sampling_with_seed(server, reference_llm):
    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 7}
    first, second = post(server, "/v1/completions", body).json(), post(server, "/v1/completions", body).json()
    assert first["model"] == server.model
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # a seed makes sampling reproducible


def test_min_p_reaches_the_engine(server, reference_llm):
    """vLLM's min_p: sampled with a seed, the reply is the in-process engine's under the same settings;
    min_p = 1 keeps only the likeliest token, so a sample at T = 1 is the greedy reply."""
    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 1.0, "min_p": 0.3, "seed": 3}
    params = SamplingParams(temperature=1.0, min_p=0.3, max_tokens=8, seed=3)
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == reference_llm.generate(["the cat"], params)[0].text
    only_top = post(server, "/v1/completions", {**body, "min_p": 1.0}).json()["choices"][0]["text"]
    assert only_top == greedy(reference_llm, "the cat", 8)


def test_token_id_prompts_and_batched_prompts(server, reference_llm):
    expected = [greedy(reference_llm, "the cat sat on", 10), greedy(reference_llm, "hello world", 10)]
    ids = [reference_llm.tokenizer.encode(p) for p in ("the cat sat on", "hello world")]
    for prompt in (ids, ["the cat sat on", "hello world"]):
        out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0}).json()
        assert [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] == expected
    single = post(server, "/v1/completions", {"prompt": ids[0], "max_tokens": 10, "temperature": 0}).json()
    assert single["choices"][0]["text"] == expected[0]


def test_tokenize_detokenize(server, reference_llm):
    tokens = post(server, "/tokenize", {"prompt": "the cat sat"}).json()
    assert tokens["tokens"] == reference_llm.tokenizer.encode("the cat sat") and tokens["max_model_len"] == reference_llm.max_model_len
    text = post(server, "/detokenize", {"tokens": reference_llm.tokenizer.encode("the cat", add_special_tokens=False)})
    assert text.json() == {"prompt": "the cat"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 0


def test_ignore_eos_generates_exactly_max_tokens(server, oai):
    out = oai.completions.create(model=server.model, prompt="the cat", max_tokens=60, seed=3,
                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 60 and out.choices[0].finish_reason == "length"


def test_stop_token_ids_end_generation(server, oai, reference_llm):
    first = reference_llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    out = oai.completions.create(model=server.model, prompt="the cat", max_tokens=20, temperature=0,
                                 extra_body={"stop_token_ids": [first]})
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    assert out.choices[0].stop_reason == first and out.choices[0].text == ""  # the ending token is not text (vLLM)
    held = oai.completions.create(model=server.model, prompt="the cat", max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert held.usage.completion_tokens >= 4


def test_stop_strings_kept_when_asked_and_named_in_stop_reason(server, oai, reference_llm):
    """vLLM's include_stop_str_in_output and stop_reason, whole and streamed, completions and chat."""
    full = greedy(reference_llm, "the cat", 16)
    stop = full[4:7]
    kept = full[:full.index(stop) + len(stop)]
    body = dict(model=server.model, max_tokens=16, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True})
    out = oai.completions.create(prompt="the cat", **body)
    assert (out.choices[0].text, out.choices[0].stop_reason) == (kept, stop)
    chunks = list(oai.completions.create(prompt="the cat", stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks) == kept and chunks[-1].choices[0].stop_reason == stop
    plain = oai.completions.create(model=server.model, prompt="the cat", max_tokens=16, temperature=0, stop=[stop])
    assert plain.choices[0].text == full[:full.index(stop)] and plain.choices[0].stop_reason == stop
    chat = oai.chat.completions.create(messages=[{"role": "user", "content": "hi"}], model=server.model, max_tokens=4,
                                       temperature=0)
    assert chat.choices[0].stop_reason is None and chat.choices[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, oai, reference_llm):
    ids = reference_llm.tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    return 0\n")
    out = oai.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0,
                                 extra_body={"truncate_prompt_tokens": 4})
    want = reference_llm.generate(prompt_token_ids=[ids[-4:]], sampling_params=SamplingParams(temperature=0, max_tokens=6))
    assert out.usage.prompt_tokens == 4 and out.choices[0].text == want[0].text
    r = post(server, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"]


def test_penalties_reach_the_engine(server, oai, reference_llm):
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty: the server's greedy text
    is the in-process engine's under the same penalties (which change it)."""
    penalties = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    want, plain = [reference_llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=24, **extra))[0].text
                   for extra in (penalties, {})]
    out = oai.completions.create(model=server.model, prompt="the cat", max_tokens=24, temperature=0,
                                 presence_penalty=1.0, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.5})
    assert out.choices[0].text == want != plain


def test_logit_bias_and_allowed_tokens_reach_the_engine(server, oai, reference_llm):
    """OpenAI's logit_bias (token ids as JSON string keys) and vLLM's allowed_token_ids: the server's
    greedy text is the in-process engine's under the same constraints (which change it)."""
    tokenizer = reference_llm.tokenizer
    plain = reference_llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=12))[0]
    banned = plain.token_ids[0]
    allowed = [t for t in range(len(tokenizer)) if t != banned]
    want = reference_llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=12, logit_bias={banned: -100.0},
                                                              allowed_token_ids=allowed))[0]
    out = oai.completions.create(model=server.model, prompt="the cat", max_tokens=12, temperature=0,
                                 logit_bias={str(banned): -100}, extra_body={"allowed_token_ids": allowed})
    assert out.choices[0].text == want.text != plain.text and banned not in want.token_ids


# ---- concurrency and cancellation ---------------------------------------------------------------
@pytest.mark.slow
def test_16_concurrent_streams_complete_and_are_correct(server, reference_llm):
    expected = [o.text for o in reference_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)

    async def one(prompt):
        stream = await client.completions.create(model=server.model, prompt=prompt, max_tokens=32,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in PROMPTS))
    assert asyncio.run(all_of_them()) == expected


def test_client_disconnect_cancels_generation(server):
    before = app_stats()["cancelled"]
    # ignore_eos: a sampled end-of-sequence must not finish the generation before the hang-up lands. One 240-token
    # choice took ~1 s, which the hang-up (client -> Serve proxy -> replica) could outlast on a loaded box: the
    # most choices, 64 in waves of the 16 batch slots, take many times that (each aborted choice counts).
    body = {"prompt": "the cat", "max_tokens": 240, "n": 64, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        next(r.iter_lines())  # generation is under way; now hang up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (app_stats()["cancelled"] == before or app_stats()["running"]
                                           or app_stats()["engine"]["num_running"] or app_stats()["engine"]["num_waiting"]):
        time.sleep(0.1)
    stats = app_stats()
    assert stats["cancelled"] > before and stats["running"] == 0
    assert stats["engine"]["num_running"] == 0 and stats["engine"]["kv_cache_tokens"] == 0  # its slot and KV are free



def test_a_refused_request_is_not_counted_as_cancelled(server):
    """"cancelled" counts generations whose client went away: one the engine refused (a 400) counted there too."""
    before = app_stats()["cancelled"]
    for stream in (False, True):
        reply = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                           json={"prompt": [4, 10 ** 6], "max_tokens": 3, "stream": stream})
        assert reply.status_code == 400 and "prompt token ids must be in" in reply.text, reply.text
    assert app_stats()["cancelled"] == before

# ---- validation and security --------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "priority": 2}, "priority"),  # this server serves first come, first served
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 65}, "n"),
    ({"prompt": ["a", "b", "c", "d", "e"], "n": 64, "max_tokens": 1}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "best_of": 2}, "best_of"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias.x.[key]"),
    ({"prompt": "hi", "logit_bias": {"10000": 1}}, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [3, 10000]}, "allowed_token_ids"),
    # this pair's WordPiece-decoded tokenizer has no byte form for llguidance: said clearly
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "grammar": "start: a"}}, "structured_outputs"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "hi", "stop_token_ids": ["x"]}, "stop_token_ids.0"),
    ({"prompt": "hi", "stop": ["ok", ""]}, "stop"),
    ({"prompt": "hi", "max_tokens": 1000}, "prompt"),
    ({"prompt": " ".join(["cat"] * 300)}, "prompt"),
    ({"prompt": [1, 2, 10_000], "max_tokens": 2}, "prompt"),
    ({"max_tokens": 2}, "prompt"),
])
def test_bad_requests_get_400_envelope(server, body, param):
    r = post(server, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_malformed_json_and_wrong_shapes(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = post(server, "/v1/chat/completions", {"messages": "hello"})
    assert r.status_code == 400


def test_unknown_model_is_404(server, oai):
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert "gpt-17" in str(err.value)


def test_api_key_required_everywhere_but_health(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            r = httpx.request(method, server.url + path, json={"prompt": "hi"}, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_oversized_body_is_413(server):
    r = post(server, "/v1/completions", {"prompt": "cat " * 400_000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_no_stack_traces_to_clients(server):
    bodies = [post(server, "/v1/completions", b).text for b in ({"prompt": []}, {"prompt": [[]]}, {"prompt": None})]
    assert all(r and "Traceback" not in r and "File \"" not in r for r in bodies)
