"""Review of the reasoning parsers and gpt-oss's harmony format (session 89): what chat (whole and streamed) and
Responses make of a reply, through the functions their routes call (split_reasoning, ReasoningStream,
ToolPlan.parse, ToolStream, HarmonyReply). A gpt-oss final answer opening with `to=` was read again as harmony
by the tool side (tool_choice none, the openai tool parser) as a header, and dropped whole; and, for every
parser, any cut of a reply into stream pieces must join to the whole reply's reasoning, content and calls."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from saguaro_dist.serve.openai_responses import ResponseEvents, ResponsesRequest
from saguaro_dist.serve.openai_responses_output import HarmonyReply
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream, split_reasoning
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

GPTOSS, QWEN3, R1 = ReasoningParser.OPENAI_GPTOSS, ReasoningParser.QWEN3, ReasoningParser.DEEPSEEK_R1
F = ({"name": "f", "parameters": {"type": "object"}},)
NEXT = "<|end|><|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>hm" + NEXT
CALL = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
HARMONY_PLANS = {"no tools": ToolPlan(ToolChoiceKind.NONE, harmony=True),
                 "tool_choice none": ToolPlan(ToolChoiceKind.NONE, F, harmony=True),
                 "openai parser": ToolPlan(ToolChoiceKind.AUTO, F, parser=ToolCallParser.OPENAI, harmony=True)}


def _whole(parser, plan: ToolPlan, text: str) -> tuple[str, str, list]:
    """(reasoning, content, calls) of a finished chat reply, as full_replies reads it."""
    reasoning, rest = split_reasoning(parser, text)
    content, calls = plan.parse(rest)
    return reasoning or "", content or "", [(c.name, c.arguments) for c in calls]


def _streamed(parser, plan: ToolPlan, pieces: list[str]) -> tuple[str, str, list]:
    """The same, joined from the deltas a stream sends, as sse_stream makes them."""
    stream, tools = ReasoningStream(parser), ToolStream(plan)
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        thought, text = stream.feed(piece, final)
        delta = tools.step(text, final)
        reasoning, content = reasoning + thought, content + delta.get("content", "")
        for call in delta.get("tool_calls", []):
            name, arguments = calls.get(call["index"], ("", ""))
            function = call.get("function", {})
            calls[call["index"]] = (name + (function.get("name") or ""), arguments + (function.get("arguments") or ""))
    return reasoning, content, [calls[i] for i in sorted(calls)]


def _cuts(text: str, rng: random.Random) -> list[str]:
    """text in random pieces (some empty)."""
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("answer", ["to=be or not to be", "  to=functions.f is how a call is named", "t", "to="])
@pytest.mark.parametrize("plan", HARMONY_PLANS.values(), ids=HARMONY_PLANS.keys())
def test_a_final_answer_opening_with_to_is_content(plan, answer):
    text = ANALYSIS + "<|channel|>final<|message|>" + answer + "<|return|>"
    assert _whole(GPTOSS, plan, text) == ("hm", answer, [])
    rng = random.Random(0)
    for _ in range(30):
        assert _streamed(GPTOSS, plan, _cuts(text, rng)) == ("hm", answer, [])


def test_a_preamble_opening_with_to_stays_before_the_call():
    text = ANALYSIS + "<|channel|>commentary<|message|>to do: call f" + NEXT + CALL
    plan = HARMONY_PLANS["openai parser"]
    assert _whole(GPTOSS, plan, text) == ("hm", "to do: call f", [("f", '{"a": 1}')])
    assert _streamed(GPTOSS, plan, [text[:60], text[60:]]) == ("hm", "to do: call f", [("f", '{"a": 1}')])


def test_responses_keep_a_final_answer_opening_with_to():
    request = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    plan = replace(request.tool_plan(), harmony=True)
    reply = HarmonyReply.of(ResponseEvents("r", "m", request, 0), plan)
    reply.feed(ANALYSIS + "<|channel|>final<|message|>to=be<|return|>", True)
    reply.events.finish("stop")
    texts = [(i["type"], i["content"][0]["text"]) for i in reply.events.items]
    assert texts == [("reasoning", "hm"), ("message", "to=be")]


HARMONY_WORDS = ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>", "assistant",
                 "<|call|>", "<|return|>", " to=functions.f", " to=browser.search", "<|constrain|>json", " json",
                 "hi", '{"a": 1}', "<|", "<", "\n", "é", " ", "to=", "t", ANALYSIS, CALL, NEXT]
THINK_WORDS = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}',
               "x", " ", "\n", "<", "</", "<th", "ink>", "é"]


@pytest.mark.parametrize("parser, plan, words", [
    (GPTOSS, HARMONY_PLANS["no tools"], HARMONY_WORDS),
    (GPTOSS, HARMONY_PLANS["tool_choice none"], HARMONY_WORDS),
    (GPTOSS, HARMONY_PLANS["openai parser"], HARMONY_WORDS),
    (QWEN3, ToolPlan(ToolChoiceKind.AUTO, F, parser=ToolCallParser.HERMES), THINK_WORDS),
    (R1, ToolPlan(ToolChoiceKind.NONE), THINK_WORDS),
], ids=["gptoss", "gptoss-none", "gptoss-openai", "qwen3-hermes", "deepseek_r1"])
def test_any_cut_of_any_reply_streams_as_the_whole(parser, plan, words):
    rng = random.Random(89)
    for _ in range(400):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 10)))
        assert _streamed(parser, plan, _cuts(text, rng)) == _whole(parser, plan, text), text
