"""use_beam_search over real HTTP (the served app on loopback, a real tiny checkpoint with a word-level tokenizer):
the served beams are LLM.beam_search's and the brute force's (tokens, text, order), EOS-ended ones "stop" with
the EOS left out (vLLM's online search), chat too (streamed as vLLM streams a finished search), and what the
search cannot honour is a 400 naming the field."""
from __future__ import annotations

import json

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.beam_search import BeamSearchParams
from saguaro_dist.serve.api import ServerOptions, create_app
from test_beam_search import PROMPTS, STEPS, checkpoint, ranked_after, reference, with_tokenizer  # noqa: F401

PROMPT = " ".join(f"t{t}" for t in PROMPTS[0])


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):  # noqa: F811
    """(base url, llm, eos, extra): the tokenizer's EOS ranks second after PROMPTS[0]; the generation config's
    `extra` (the top token) ends generate but not a beam."""
    path, model = checkpoint
    eos, extra = ranked_after(model, PROMPTS[0], 1), ranked_after(model, PROMPTS[0], 0)
    copy = with_tokenizer(path, tmp_path_factory.mktemp("served_beams"), eos, [eos, extra])
    with LLM(model=str(copy), mode="ar") as llm, serve_on_loopback(create_app(llm, ServerOptions("m"))) as url:
        yield url, llm, eos, extra


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json={"model": "m", "use_beam_search": True, "temperature": 0, **body},
                      timeout=120)


def words(ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in ids)


def expected_choices(beams, prompt_len: int, eos: int) -> list[tuple[str, str, int | None]]:
    """vLLM's online choices of beams: the generated text without a final EOS, finish_reason, stop_reason."""
    out = []
    for beam in beams:
        generated, ended = beam.tokens[prompt_len:], beam.tokens[-1] == eos
        out.append((words(generated[:-1] if ended else generated), "stop" if ended else "length", eos if ended else None))
    return out


@pytest.mark.parametrize("width", [1, 2, 3])
def test_completions_match_offline_and_the_brute_force(served, checkpoint, width):  # noqa: F811
    url, llm, eos, _ = served
    reply = post(url, "completions", prompt=PROMPT, n=width, max_tokens=STEPS, logprobs=1)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    offline = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=width, max_tokens=STEPS))[0]
    brute = [tokens for tokens, _ in reference(checkpoint[1], PROMPTS[0], width, STEPS, eos)]
    assert [s.tokens for s in offline.sequences] == brute
    want = expected_choices(offline.sequences, len(PROMPTS[0]), eos)
    assert [(c["text"], c["finish_reason"], c["stop_reason"]) for c in choices] == want
    assert [c["index"] for c in choices] == list(range(width))
    for c, beam in zip(choices, offline.sequences):  # each beam token's own log p, as the step scored it
        ids = [int(t[1:]) for t in c["logprobs"]["tokens"]]
        assert words(ids) == c["text"]
        assert sum(c["logprobs"]["token_logprobs"]) == pytest.approx(
            beam.cum_logprob - (beam.logprobs[-1][eos].logprob if beam.tokens[-1] == eos else 0.0), abs=1e-4)
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == len(PROMPTS[0])
    assert usage["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in choices)
    if width > 1:
        assert "stop" in [c["finish_reason"] for c in choices]  # the EOS beam of step one is among the best


def test_only_the_tokenizers_eos_ends_a_served_beam(served):
    """`extra` ends a plain completion (generation config) but a beam grows through it (vLLM's online rule)."""
    url, _, eos, extra = served
    plain = httpx.post(f"{url}/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
                       timeout=60).json()["choices"][0]
    assert (plain["text"], plain["finish_reason"], plain["stop_reason"]) == ("", "stop", extra)  # (its text left out, a stop id)
    choices = post(url, "completions", prompt=PROMPT, n=3, max_tokens=STEPS).json()["choices"]
    assert any(c["text"].split()[:1] == [f"t{extra}"] and len(c["text"].split()) > 1 for c in choices), choices


def test_include_stop_str_in_output_counts_the_eos(served):
    url, _, eos, _ = served
    reply = post(url, "completions", prompt=PROMPT, n=2, max_tokens=STEPS, include_stop_str_in_output=True,
                 logprobs=0).json()
    ended = [c for c in reply["choices"] if c["finish_reason"] == "stop"]
    assert ended and all(c["logprobs"]["tokens"][-1] == f"t{eos}" and not c["text"].endswith(f"t{eos}") for c in ended)


def test_ignore_eos_grows_every_beam(served):
    url, _, _, _ = served
    choices = post(url, "completions", prompt=PROMPT, n=3, max_tokens=STEPS, ignore_eos=True).json()["choices"]
    assert all(c["finish_reason"] == "length" and len(c["text"].split()) == STEPS for c in choices)


def test_chat_whole_and_streamed(served):
    url, llm, eos, _ = served
    messages = [{"role": "user", "content": "t3 t4"}]
    from saguaro_dist.serve.chat_request import ChatMessage
    from saguaro_dist.serve.prompts import encode_chat
    prompt = encode_chat(llm.tokenizer, [ChatMessage(**m) for m in messages])
    offline = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=STEPS))[0]
    want = expected_choices(offline.sequences, len(prompt), eos)
    whole = post(url, "chat/completions", messages=messages, n=2, max_tokens=STEPS)
    assert whole.status_code == 200, whole.text
    got = [(c["message"]["content"], c["finish_reason"], c["stop_reason"]) for c in whole.json()["choices"]]
    assert got == want
    streamed = post(url, "chat/completions", messages=messages, n=2, max_tokens=STEPS, stream=True,
                    stream_options={"include_usage": True})
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    roles = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]]
    assert roles == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    contents = [(c["choices"][0]["delta"].get("content", ""), c["choices"][0]["finish_reason"],
                 c["choices"][0]["stop_reason"]) for c in chunks[2:4]]
    assert contents == want
    assert chunks[4]["choices"] == [] and chunks[4]["usage"] == whole.json()["usage"]


@pytest.mark.parametrize("path, fields, param", [
    ("completions", {"stream": True}, "stream"), ("completions", {"n": 11}, "n"),
    ("completions", {"top_p": 0.5}, "top_p"), ("completions", {"stop": ["t1"]}, "stop"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"), ("completions", {"logit_bias": {"3": 5}}, "logit_bias"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"), ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"structured_outputs": {"regex": "t1"}}, "structured_outputs"),
    ("chat/completions", {"min_tokens": 2}, "min_tokens"),
    ("chat/completions", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options")])
def test_what_beam_search_cannot_honour_is_a_400(served, path, fields, param):
    url = served[0]
    body = {"prompt": PROMPT} if path == "completions" else {"messages": [{"role": "user", "content": "t3"}]}
    reply = post(url, path, max_tokens=2, **body, **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_responses_still_refuse_it(served):
    reply = httpx.post(f"{served[0]}/responses", json={"model": "m", "input": "t3", "use_beam_search": True}, timeout=60)
    assert reply.status_code == 400 and "use_beam_search" in reply.text


def test_the_served_search_keeps_live_beams_by_cumulative_logprob_as_vllm_online():
    """Under ignore_eos an EOS candidate stays live, and its score leaves the EOS out of the length: vLLM's
    online search keeps the best cum_logprob (EOS here), its offline search the best score (token 9)."""
    from saguaro_dist.engine.beam_search import BeamRule, BeamSearchInstance, LiveRanking
    params, eos = BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), 2
    kept = {}
    for ranking in LiveRanking:
        instance = BeamSearchInstance.of_prompt([5, 6, 7, 8])
        BeamRule(params, eos, 100, ranking).step(instance, [{eos: -0.9, 9: -0.95}])
        kept[ranking] = [b.tokens[-1] for b in instance.beams]
    assert kept == {LiveRanking.SCORE: [9], LiveRanking.CUM_LOGPROB: [eos]}


def test_a_streamed_beam_choices_tool_calls_carry_their_index():
    from openai.types.chat import ChatCompletionChunk
    from saguaro_dist.serve import responses
    from saguaro_dist.serve.beam_route import _chat_events
    from saguaro_dist.serve.tool_parsers import ToolCall
    calls = [ToolCall.new("get_weather", {"city": "Paris"}), ToolCall.new("get_time", {"zone": "CET"})]
    choice = responses.CHAT.choice(0, None, "tool_calls", None, calls)
    last = _chat_events(None, responses.CHAT, "chatcmpl-x", "m", [choice], "assistant")[-1]
    chunk = ChatCompletionChunk.model_validate(last)
    assert [call.index for call in chunk.choices[0].delta.tool_calls] == [0, 1]
    assert [call.function.name for call in chunk.choices[0].delta.tool_calls] == ["get_weather", "get_time"]


def test_chat_beams_return_token_ids_whole_and_streamed(served):
    """vLLM's return_token_ids on a searched chat: the prompt's ids beside the choices (streamed: on the role
    chunks), each choice's generated ids on it (streamed: on its content chunk), the same both ways."""
    url, _, _, _ = served
    body = {"messages": [{"role": "user", "content": PROMPT}], "n": 2, "max_tokens": STEPS, "return_token_ids": True}
    whole = post(url, "chat/completions", **body).json()
    assert whole["prompt_token_ids"] and all(c["token_ids"] for c in whole["choices"])
    with httpx.stream("POST", f"{url}/chat/completions", timeout=120,
                      json={"model": "m", "use_beam_search": True, "temperature": 0, "stream": True, **body}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {tuple(c["prompt_token_ids"]) for c in chunks if "prompt_token_ids" in c} == {tuple(whole["prompt_token_ids"])}
    streamed = {c["choices"][0]["index"]: c["choices"][0]["token_ids"] for c in chunks if "token_ids" in c["choices"][0]}
    assert [streamed[c["index"]] for c in whole["choices"]] == [c["token_ids"] for c in whole["choices"]]


def test_beam_logprobs_list_the_likeliest_tokens_as_a_sampled_reply_does(served):
    """A beam's token keeps its rank in its step's entry: top_logprobs are the N likeliest tokens (the beam's
    token among them when it is one), never the N after it, and a completion lists it beside the top N only
    when it is outside them (the re-keyed entry lost its rank, so a top-1 beam token was ranked last)."""
    url, *_ = served
    chat = post(url, "chat/completions", messages=[{"role": "user", "content": PROMPT}], n=2, max_tokens=STEPS,
                logprobs=True, top_logprobs=1)
    assert chat.status_code == 200, chat.text
    items = [item for choice in chat.json()["choices"] for item in choice["logprobs"]["content"]]
    assert items and all(item["top_logprobs"][0]["logprob"] >= item["logprob"] for item in items), items
    done = post(url, "completions", prompt=PROMPT, n=2, max_tokens=STEPS, logprobs=1)
    assert done.status_code == 200, done.text
    for choice in done.json()["choices"]:
        for token_lp, top in zip(choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]):
            assert len(top) == (1 if token_lp >= max(top.values()) else 2), (token_lp, top)
