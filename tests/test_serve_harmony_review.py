"""A review of gpt-oss's harmony replies (serve/harmony.py): history turns' reasoning reaches gpt-oss's template
(`thinking`) and Responses' reasoning items reach the prompt; a server with either harmony parser reads every
reply as harmony; a reply cut in a header leaves no header in the content; plain text streams as it comes at a
cost linear in its length; calls no parser reads are left out of the content; calls the server returned are
taken back in the history; content joins preambles and finals alike whole and streamed. Pure, and over real
HTTP (test_serve_harmony.py's tiny checkpoint, made to write harmony by a Lark grammar)."""
from __future__ import annotations

import random

import openai
import pytest
from http_helpers import serve_on_loopback
from offline_tokenizers import byte_level_bpe
from test_serve_harmony import ANSWER, CALLS, MARKERS, TOOLS, _ask, _leaks, _stream, harmony_tokenizer, save_harmony_model
from test_serve_harmony import served  # noqa: F401 - the fixture: a server with both harmony parsers

from saguaro_dist import LLM
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.chat_request import ChatMessage, ToolCallMessage
from saguaro_dist.serve.harmony import HarmonySplitter, parse_openai, split_harmony
from saguaro_dist.serve.openai_responses import ResponsesRequest
from saguaro_dist.serve.prompts import render_chat
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

GPTOSS = ReasoningParser.OPENAI_GPTOSS
# gpt-oss's chat template, its assistant turns as they are (the rest cut short)
GPTOSS_TEMPLATE = """{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
  {%- if "tool_calls" in message -%}
    {%- set tool_call = message.tool_calls[0].function -%}
    {%- if message.content and message.thinking -%}
      {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") -}}
    {%- elif message.content -%}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" -}}
    {%- elif message.thinking -%}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
    {%- endif -%}
    {{- "<|start|>assistant to=functions." + tool_call.name + "<|channel|>commentary json<|message|>" -}}
    {{- tool_call.arguments|tojson + "<|call|>" -}}
  {%- else -%}
    {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
  {%- endif -%}
{%- else -%}
  {{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" -}}
{%- endif -%}
{%- endfor -%}<|start|>assistant"""
WEATHER_CALL = {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Tucson"}'}}


def _render(messages: list[ChatMessage]) -> str:
    return render_chat(byte_level_bpe(), messages, chat_template=GPTOSS_TEMPLATE)[0]


# ---- 1. history: an assistant turn's reasoning as gpt-oss's template reads it ----------------------------------
def test_a_tool_calling_turns_reasoning_reaches_gpt_oss_template_as_thinking():
    """Old: `reasoning` and `reasoning_content` only; gpt-oss's template reads `thinking`: the analysis was lost."""
    turn = ChatMessage(role="assistant", content=None, reasoning="Need the weather.", tool_calls=[WEATHER_CALL])
    prompt = _render([ChatMessage(role="user", content="weather?"), turn])
    assert "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather" in prompt
    sent_as_thinking = ChatMessage(role="assistant", content=None, thinking="Hmm.", tool_calls=[WEATHER_CALL])
    assert "analysis<|message|>Hmm.<|end|>" in _render([ChatMessage(role="user", content="x"), sent_as_thinking])
    # the server's own reply (a preamble and reasoning) goes back: the template refuses both (old: a 400, as
    # transformers fills `thinking` from `reasoning`), so the content is its analysis
    both = ChatMessage(role="assistant", content="Checking.", reasoning="Need it.", tool_calls=[WEATHER_CALL])
    assert both.for_template()["thinking"] == "" and "analysis<|message|>Checking.<|end|>" in _render([both])
    with pytest.raises(ValueError, match="only assistant messages carry reasoning"):
        ChatMessage(role="user", content="x", thinking="no")


def test_responses_reasoning_items_reach_the_assistant_turn():
    """Old: a reasoning input item was dropped: the turn's analysis never reached the template."""
    body = ResponsesRequest(input=[
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need it."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": '{"city":"Tucson"}'},
        {"type": "function_call_output", "call_id": "a", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sunny."}]},
        {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{}"}])
    turns = body.messages()
    assert [t.role for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert (turns[1].reasoning, turns[1].content, len(turns[1].tool_calls)) == ("Need it.", "Checking.", 1)
    assert (turns[3].reasoning, turns[3].content, turns[3].tool_calls[0].id) == ("Sunny.", None, "b")
    assert "analysis<|message|>Sunny.<|end|>" in _render(turns)


# ---- 3. a reply cut inside a header -----------------------------------------------------------------------------
@pytest.mark.parametrize("cut", ["<|start|>assistant", "<|start|>assistant to=functions.get_weather", "<|start|>assist",
                                 "<|start|>assistant<|channel|>final <|constrain|>json"])
def test_a_header_cut_off_is_no_content(cut):
    """Old: text after a consumed <|start|> was content at the end ('assistant')."""
    text = "<|channel|>analysis<|message|>a<|end|>" + cut
    assert split_harmony(text) == ("a", "") and parse_openai(text) == (None, [])
    for piece in (1, 3):
        thoughts, contents, calls = _stream(text, piece)
        assert ("".join(thoughts), "".join(contents), calls) == ("a", "", [])


# ---- 4. plain text streams as it comes, each piece read once ------------------------------------------------------
def test_plain_text_streams_as_it_comes_and_nothing_but_a_marker_beginning_is_held():
    """Old: a reply with no harmony markers (a constrained reply's JSON) was held to the end and each piece
    rescanned all of it (quadratic)."""
    splitter, out = HarmonySplitter(), []
    for _ in range(2000):
        out.append(splitter.feed('{"k": "v"}, ', final=False)[1])
        assert len(splitter.reader.held) == 0
    assert all(out) and splitter.feed("<|", final=False) == ("", "") and splitter.reader.held == "<|"
    assert splitter.feed("x", final=True) == ("", "<|x")
    # so does a body, and a header's text is searched once
    splitter = HarmonySplitter()
    splitter.feed("<|channel|>analysis<|message|>", final=False)
    assert all(splitter.feed("word <| ", final=False)[0] for _ in range(2000)) and len(splitter.reader.held) <= 2


def test_a_constrained_reply_streams_over_http(served):  # noqa: F811
    chunks = list(_ask(served, "plain words " * 20, stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) >= 2 and "".join(contents) == "plain words " * 20  # old: all of it in the last chunk


# ---- 5. calls no parser reads are not content ---------------------------------------------------------------------
def _none_plan(harmony: bool = True) -> ToolPlan:
    return ToolPlan(ToolChoiceKind.NONE, ({"name": "get_weather"},), parser=ToolCallParser.OPENAI, harmony=harmony)


@pytest.mark.parametrize("reasoning_parser", [GPTOSS, None])
def test_tool_choice_none_leaves_harmony_calls_out_of_the_content(reasoning_parser):
    """Old: content held `<|start|>assistant<|channel|>commentary to=functions...` (vLLM leaves calls out)."""
    text = split_harmony(CALLS)[1] if reasoning_parser else CALLS
    assert _none_plan().parse(text) == ("Checking.", [])
    for piece in (1, 5, 1000):
        stream = ToolStream(_none_plan())
        deltas = [stream.step(text[i:i + piece], i + piece >= len(text)) for i in range(0, len(text), piece)]
        contents = [d.get("content", "") for d in deltas]
        assert "".join(contents) == "Checking." and not _leaks(contents)
    assert _none_plan(harmony=False).parse("a<|call|>") == ("a<|call|>", [])  # other servers: the text as it is


def test_tool_choice_none_over_http(served):  # noqa: F811
    out = _ask(served, CALLS, tools=TOOLS, tool_choice="none")
    message = out.choices[0].message
    assert (message.content, message.tool_calls, message.reasoning) == ("Checking.", None, "Need the weather.")
    chunks = list(_ask(served, CALLS, stream=True, tools=TOOLS, tool_choice="none"))
    contents = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(contents) == "Checking." and not _leaks(contents)


# ---- 2. the tool parser alone reads every reply as harmony --------------------------------------------------------
@pytest.fixture(scope="module")
def tool_only(tmp_path_factory):
    llm = LLM(model=save_harmony_model(tmp_path_factory.mktemp("harmony_tool_only")), mode="ar")
    with serve_on_loopback(create_app(llm, ServerOptions("gpt", tool_call_parser="openai"))) as url:
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    llm.shutdown()


@pytest.mark.parametrize("tools", [{}, {"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS}])
def test_the_tool_parser_alone_reads_every_reply_as_harmony(tool_only, tools):
    """Old: without tools (or with tool_choice none) special tokens were skipped and nothing was parsed:
    content 'analysis2 and 2 make 4.assistantfinalIt is 4.'. As vLLM's HarmonyParser without a reasoning
    parser: the analysis is dropped (no `reasoning`), the final channel is the content."""
    out = _ask(tool_only, ANSWER, **tools)
    assert (out.choices[0].message.content, getattr(out.choices[0].message, "reasoning", None)) == ("It is 4.", None)
    chunks = list(_ask(tool_only, ANSWER, stream=True, **tools))
    contents = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(contents) == "It is 4." and not _leaks(contents)
    assert not any(getattr(c.choices[0].delta, "reasoning", None) for c in chunks if c.choices)


# ---- 6. calls the server returned are taken back ------------------------------------------------------------------
@pytest.mark.parametrize("arguments", ["print( 1 )", '{"cmd": "l', '{"cmd": ls}'])
def test_calls_returned_as_written_are_taken_back(served, arguments):  # noqa: F811
    """Old: a 400 ('arguments must be JSON text of an object') for a call the openai parser itself returned
    (a `code` call, one cut off, malformed JSON): on a harmony server the text reaches the template as written
    (vLLM renders gpt-oss's history with harmony, a call's body as written). Other servers still refuse it
    (vLLM's json.loads of them fails too), which keeps templates that walk the arguments from a string."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "run"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    out = served.chat.completions.create(model="gpt", messages=messages, tools=TOOLS, max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    taken = ToolCallMessage.model_validate(call).taken_as_written()
    assert taken.for_template()["function"]["arguments"] == arguments
    with pytest.raises(ValueError, match="arguments must be JSON text of an object"):
        ToolCallMessage.model_validate(call).for_template()
    items = [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}]
    turn = ResponsesRequest(input=items).messages(calls_as_written=True)[1]
    assert turn.for_template()["tool_calls"][0]["function"]["arguments"] == arguments


def test_json_that_is_not_an_object_is_still_refused_and_empty_arguments_are_an_object():
    for arguments in ("[1]", "7", '"text"', "null"):
        call = ToolCallMessage(function={"name": "f", "arguments": arguments})
        for taken in (call, call.taken_as_written()):  # JSON, not an object: refused on any server
            with pytest.raises(ValueError, match="arguments must be JSON text of an object"):
                taken.for_template()
    assert ToolCallMessage(function={"name": "f", "arguments": ""}).for_template()["function"]["arguments"] == {}


# ---- 7. content: preambles and finals joined, whole and streamed alike ---------------------------------------------
def test_preamble_and_final_join_whole_and_streamed():
    """vLLM's HarmonyParser joins every content message with "\\n" (and streams them all): so here, both ways."""
    text = ("<|channel|>commentary<|message|>Looking.<|end|><|start|>assistant<|channel|>commentary to=functions.f"
            " json<|message|>{}<|call|><|start|>assistant<|channel|>final<|message|>Done.")
    for reasoning_parser in (GPTOSS, None):
        content, calls = parse_openai(split_harmony(text)[1] if reasoning_parser else text)
        assert (content, calls) == ("Looking.\nDone.", [("f", "{}")])
        for piece in (1, 4):
            assert "".join(_stream(text, piece, reasoning_parser=reasoning_parser)[1]) == content


# ---- every cut of any text: streamed pieces join to the whole reply ------------------------------------------------
ATOMS = [*MARKERS, "assistant", " to=functions.f", " to=functions.g", "analysis", "final", "commentary", " json", "hi",
         " ", "\n", "<|", "x|>", "t", "o=", '{"a":1}']
PARSERS = [(GPTOSS, ToolCallParser.OPENAI, ToolChoiceKind.AUTO), (None, ToolCallParser.OPENAI, ToolChoiceKind.AUTO),
           (GPTOSS, None, ToolChoiceKind.NONE), (None, ToolCallParser.OPENAI, ToolChoiceKind.NONE)]


def _streamed(text: str, cuts: list[int], reasoning_parser, plan: ToolPlan) -> tuple[str, str, list]:
    reasoning, tools, thoughts, content, calls = ReasoningStream(reasoning_parser), ToolStream(plan), "", "", []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        thought, rest = reasoning.feed(text[start:end], end == len(text))
        delta = tools.step(rest, end == len(text))
        thoughts, content = thoughts + thought, content + delta.get("content", "")
        calls += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])]
    return thoughts, content, calls


def test_any_cut_of_any_text_streams_as_the_whole_reply():
    """Old: 3000+ of these disagreed (mostly the tool parser alone: whitespace, a stray marker before a header)."""
    rng = random.Random(1)
    for _ in range(1500):
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 12)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
        for reasoning_parser, tool_parser, kind in PARSERS:
            plan = ToolPlan(kind, ({"name": "f"},), parser=tool_parser, harmony=True)
            reasoning, rest = split_harmony(text) if reasoning_parser else (None, text)
            content, calls = plan.parse(rest)
            whole = (reasoning or "", content or "", [(c.name, c.arguments) for c in calls])
            assert _streamed(text, cuts, reasoning_parser, plan) == whole, (text, cuts, reasoning_parser, tool_parser, kind)


def test_calls_returned_as_written_are_taken_back_by_responses_and_tokenize(served):  # noqa: F811
    """The same history on /v1/responses (a function_call item) and /tokenize (chat messages): taken as written on
    a harmony server (before: a 400 on both)."""
    import httpx
    arguments = "print( 1 )"
    items = [{"role": "user", "content": "run"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "c1", "output": "done"}]
    reply = served.responses.create(model="gpt", input=items, tools=[{"type": "function", **TOOLS[0]["function"]}],
                                    max_output_tokens=2, temperature=0)
    assert reply.status in ("completed", "incomplete")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "run"}, {"role": "assistant", "tool_calls": [call]}]
    root = str(served.base_url).rstrip("/").removesuffix("/v1")
    tokenized = httpx.post(f"{root}/tokenize", json={"model": "gpt", "messages": messages}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text


def test_a_searched_beam_keeps_the_special_tokens_its_parser_reads():
    """Beam search decodes a beam as the job's params say (a harmony server's chat jobs keep special tokens), not
    as the request's skip_special_tokens: before, a searched gpt-oss reply lost its markers and read as content."""
    from types import SimpleNamespace

    from saguaro_dist import SamplingParams
    from saguaro_dist.engine.beam_search import BeamSearchSequence
    from saguaro_dist.serve.beam_route import beam_result
    from saguaro_dist.serve.state import Job
    tok = harmony_tokenizer()
    reply = tok.encode("<|channel|>final<|message|>Hi", add_special_tokens=False)
    job = Job(prompt_ids=[1], params=SamplingParams(skip_special_tokens=False))
    body = SimpleNamespace(include_stop_str_in_output=False, skip_special_tokens=True)
    beam = BeamSearchSequence(tokens=[1, *reply], logprobs=[{t: -1.0} for t in reply], finish_reason="length")
    result = beam_result(SimpleNamespace(tokenizer=tok), body, job, beam, None)
    assert result.text == "<|channel|>final<|message|>Hi"
