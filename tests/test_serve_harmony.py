"""gpt-oss's harmony replies (serve/harmony.py): the `openai_gptoss` reasoning parser and the `openai` tool-call
parser, pure (whole, cut off, streamed in any pieces) and over real HTTP: the serving app under uvicorn in front
of a tiny real checkpoint whose tokenizer has harmony's special tokens, made to write harmony by a Lark grammar
(a random model knows no harmony), spoken to by the `openai` client."""
from __future__ import annotations

import json

import openai
import pytest
from engine_helpers import llama_config, save_model
from http_helpers import serve_on_loopback
from offline_tokenizers import byte_level_bpe

from saguaro_dist import LLM, SamplingParams
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.harmony import MARKERS, parse_openai, reasoning_token_count, split_harmony
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream, split_reasoning
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

GPTOSS = ReasoningParser.OPENAI_GPTOSS
NEXT = "<|end|><|start|>assistant"
ANSWER = "<|channel|>analysis<|message|>2 and 2 make 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
CALLS = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
         "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
         '<|message|>{"city":"Tucson",\n "days": 2}<|call|><|start|>assistant to=functions.get_time<|channel|>'
         'commentary json<|message|>{"zone": "UTC"}<|call|>')
RECIPIENT_FIRST = ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "MST"}'  # the prompt opened it


@pytest.mark.parametrize("text, reasoning, content", [
    (ANSWER, "2 and 2 make 4.", "It is 4."),
    (ANSWER.removesuffix("<|return|>"), "2 and 2 make 4.", "It is 4."),  # <|return|> is EOS: not in the text
    ("<|channel|>analysis<|message|>still thinking", "still thinking", ""),  # cut off by max_tokens
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", "a", ""),  # cut in a header
    ("<|channel|>analysis<|message|>a<|en", "a<|en", ""),  # cut in a marker: the text as it came
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b" + NEXT
     + "<|channel|>final<|message|>c" + NEXT + "<|channel|>final<|message|>d", "a\nb", "c\nd"),  # "\n" between, as vLLM
    ("<|channel|>commentary<|message|>A preamble." + NEXT + "<|channel|>final<|message|>Done.", None, "A preamble.\nDone."),
    ("<|channel|>analysis to=browser.search code<|message|>{}" + NEXT + "<|channel|>commentary to=browser.open<|message|>"
     "{}" + NEXT + "<|channel|>final<|message|>x", "{}", "x"),  # built-in tools: analysis is reasoning, the rest dropped
    ("4, plainly", None, "4, plainly"),  # not harmony at all (a reply held to JSON from its first token, say)
])
def test_split(text, reasoning, content):
    assert split_harmony(text) == split_reasoning(GPTOSS, text) == (reasoning, content)


def _calls(text: str) -> tuple[str | None, list[tuple[str, object]]]:
    content, calls = parse_openai(text)
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


def test_calls_are_read_from_raw_replies_and_from_the_reasoning_parsers_content():
    want = ("Checking.", [("get_weather", {"city": "Tucson", "days": 2}), ("get_time", {"zone": "UTC"})])
    reasoning, content = split_harmony(CALLS)
    assert reasoning == "Need the weather." and content.startswith("Checking.<|start|>assistant<|channel|>commentary")
    assert _calls(CALLS) == _calls(content) == want
    assert parse_openai(CALLS)[1][0][1] == '{"city": "Tucson", "days": 2}'  # JSON re-written compactly, as vLLM
    assert _calls(RECIPIENT_FIRST) == (None, [("get_time", {"zone": "MST"})])  # the recipient before the channel
    assert _calls(split_harmony(RECIPIENT_FIRST)[1]) == (None, [("get_time", {"zone": "MST"})])
    assert _calls(ANSWER) == ("It is 4.", [])  # no calls: the final channel (analysis is not content)
    assert parse_openai("no harmony here") == ("no harmony here", [])


def test_malformed_and_cut_off_arguments_come_as_written():
    header = "<|channel|>commentary to=functions.run <|constrain|>json<|message|>"
    assert parse_openai(header + '{"cmd": ls}<|call|>') == (None, [("run", '{"cmd": ls}')])  # vLLM's: as written
    assert parse_openai(header + '{"cmd": "l') == (None, [("run", '{"cmd": "l')])  # finish_reason says "length"
    assert parse_openai("<|channel|>commentary to=functions.say code<|message|>print( 1 )") == (None, [("say", "print( 1 )")])
    plan = ToolPlan(ToolChoiceKind.AUTO, ({"name": "run"},), parser=ToolCallParser.OPENAI)
    content, calls = plan.parse(header + "{}")
    assert content is None and calls[0].message()["function"] == {"name": "run", "arguments": "{}"}
    assert plan.finish_reason("stop", calls) == "tool_calls"


def _stream(text: str, piece: int, tool_parser: ToolCallParser | None = ToolCallParser.OPENAI,
            reasoning_parser: ReasoningParser | None = GPTOSS) -> tuple[list[str], list[str], list[dict]]:
    """The chat stream's two stages (sse_stream.py) over `text` in pieces: reasoning, content and call deltas."""
    reasoning = ReasoningStream(reasoning_parser)
    tools = ToolStream(ToolPlan(ToolChoiceKind.AUTO, ({"name": "f"},), parser=tool_parser))
    thoughts, contents, calls = [], [], []
    for start in range(0, len(text), piece):
        last = start + piece >= len(text)
        thought, rest = reasoning.feed(text[start:start + piece], last)
        delta = tools.step(rest, last)
        thoughts.append(thought)
        contents.append(delta.get("content", ""))
        calls += delta.get("tool_calls", [])
    return thoughts, contents, calls


def _leaks(pieces: list[str]) -> bool:
    """Whether a piece holds a marker or a bit of one (text never does here)."""
    return any(m[:n] in p for p in pieces for m in MARKERS for n in (2, len(m))) or any("|>" in p for p in pieces)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [ANSWER, CALLS, RECIPIENT_FIRST, ANSWER[:60], CALLS[:-40], "plain <| text"])
def test_streamed_pieces_join_to_the_whole_reply(text, piece):
    """Reasoning as reasoning, final text as content, calls as tool_calls deltas (indexed), whatever the cut:
    no marker, header or bit of one in a reasoning or content delta."""
    thoughts, contents, calls = _stream(text, piece)
    reasoning, rest = split_harmony(text)
    content, whole = parse_openai(rest)
    assert "".join(thoughts) == (reasoning or "") and "".join(contents) == (content or "")
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(i, name, arguments) for i, (name, arguments) in enumerate(whole)]
    if "plain" not in text:
        assert not _leaks(thoughts) and not _leaks(contents)


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_the_tool_parser_alone_reads_raw_replies(piece):
    """Without the reasoning parser the raw reply reaches the tool stage: its header (even ` to=...` before any
    marker) is never content; the calls and the content come at the end."""
    for text in (CALLS, RECIPIENT_FIRST, ANSWER):
        thoughts, contents, calls = _stream(text, piece, reasoning_parser=None)
        content, whole = parse_openai(text)
        assert "".join(contents) == (content or "") and not _leaks(contents) and not any(thoughts)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == whole


def test_both_parsers_keep_special_tokens():
    params = SamplingParams()
    assert ToolPlan(ToolChoiceKind.AUTO, ({"name": "f"},), parser=ToolCallParser.OPENAI).adjust(params).skip_special_tokens is False
    assert GPTOSS.keeps_special_tokens and not ReasoningParser.QWEN3.keeps_special_tokens


# ---- a tokenizer with harmony's special tokens, a tiny checkpoint, a real server -----------------------------
def harmony_tokenizer():
    """The offline byte-level BPE with harmony's markers added as special tokens (as gpt-oss's tokenizer has
    them), and a chat template that ends the prompt `<|start|>assistant`, as gpt-oss's does."""
    tok = byte_level_bpe()
    tok.add_tokens(list(MARKERS), special_tokens=True)
    tok.chat_template = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                         "{% if tools %}{{ tools | length }} tools{% endif %}<|start|>assistant")
    return tok


def test_reasoning_tokens_are_the_analysis_bodies():
    tok = harmony_tokenizer()
    think, answer = tok.encode("2 and 2 make 4.", add_special_tokens=False), tok.encode("It is 4.", add_special_tokens=False)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == ANSWER and len(ids) > len(think) + len(answer)
    assert reasoning_token_count(tok, ids) == len(think)
    assert reasoning_token_count(tok, tok.encode("4, plainly", add_special_tokens=False)) == 0
    assert reasoning_token_count(byte_level_bpe(), ids[:5]) == 0  # no harmony tokens: nothing to count


def _forced(text: str) -> str:
    """A Lark grammar whose one sentence is `text`: its markers as special tokens, the rest as literals."""
    parts, rest = [], text
    while rest:
        at = min([(i, m) for m in MARKERS if (i := rest.find(m)) >= 0] or [(len(rest), "")])
        parts += ([json.dumps(rest[:at[0]])] if at[0] else []) + ([at[1]] if at[1] else [])
        rest = rest[at[0] + len(at[1]):]
    return "start: " + " ".join(parts)


def save_harmony_model(path) -> str:
    """A tiny random model with the harmony tokenizer, written to path (a folder)."""
    tok = harmony_tokenizer()
    tok.save_pretrained(path)
    config = llama_config(len(tok), hidden=32, layers=2)
    config.max_position_embeddings = 1024  # room for a reply spelt in bytes, as a random model may pick them
    save_model(path, config, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = LLM(model=save_harmony_model(tmp_path_factory.mktemp("harmony_model")), mode="ar")
    app = create_app(llm, ServerOptions("gpt", reasoning_parser="openai_gptoss", tool_call_parser="openai"))
    with serve_on_loopback(app) as url:
        yield openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    llm.shutdown()


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]


def _ask(client, reply: str, stream: bool = False, **extra):
    return client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "2+2?"}], max_tokens=600,
                                          temperature=0, stream=stream, extra_body={"structured_outputs": {"grammar": _forced(reply)}},
                                          **({"stream_options": {"include_usage": True}} if stream else {}), **extra)


def test_reasoning_and_content_over_http(served):
    out = _ask(served, ANSWER)
    message = out.choices[0].message
    assert (message.reasoning, message.content, out.choices[0].finish_reason) == ("2 and 2 make 4.", "It is 4.", "stop")
    assert 0 < out.usage.completion_tokens_details.reasoning_tokens < out.usage.completion_tokens
    chunks = list(_ask(served, ANSWER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thoughts, contents = [getattr(d, "reasoning", None) or "" for d in deltas], [d.content or "" for d in deltas]
    assert "".join(thoughts) == message.reasoning and "".join(contents) == message.content
    assert not _leaks(thoughts) and not _leaks(contents)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == out.usage.completion_tokens_details.reasoning_tokens


def test_tool_calls_over_http(served):
    out = _ask(served, CALLS, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.reasoning == "Need the weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Tucson", "days": 2}), ("get_time", {"zone": "UTC"})]
    chunks = list(_ask(served, CALLS, stream=True, tools=TOOLS))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]
    assert "".join(d.content or "" for d in deltas) == "Checking." and not _leaks([d.content or "" for d in deltas])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_responses_read_harmony_too(served):
    out = served.responses.create(model="gpt", input="2+2?", tools=[{"type": "function", "name": "get_time", "parameters":
                                                                     {"type": "object"}}], max_output_tokens=600,
                                  temperature=0, extra_body={"structured_outputs": {"grammar": _forced(CALLS)}})
    kinds = [item.type for item in out.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert out.output[2].name == "get_weather" and json.loads(out.output[3].arguments) == {"zone": "UTC"}
