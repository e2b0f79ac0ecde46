"""Harmony marker text written by ordinary tokens (a JSON string holding "<|end|>", prose naming <|channel|>) is
content, as vLLM reads harmony by token id; only the markers' single special tokens split a reply. Pure (the chat
stream's stages over a reply's ids and text, whole and in pieces, its text lagging its ids) and over real HTTP
(test_serve_harmony.py's tiny checkpoint and server, made to write the reply by a Lark grammar whose quoted
strings only ordinary tokens can write)."""
from __future__ import annotations

import json

import pytest
from test_serve_harmony import TOOLS, harmony_tokenizer
from test_serve_harmony import served  # noqa: F401 - the fixture: a server with both harmony parsers

from saguaro_dist.serve import harmony
from saguaro_dist.serve.harmony import MARKERS
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream, split_reasoning
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

GPTOSS = ReasoningParser.OPENAI_GPTOSS


class Mark(str):
    """A marker written as its special token (a plain str in a reply is text, written with ordinary tokens)."""


LITERAL_FINAL = 'Write "<|end|>" or <|channel|>final<|message|>, as text.<|'
ANSWER = [Mark("<|channel|>"), "analysis", Mark("<|message|>"), "Say <|end|> plainly.", Mark("<|end|>"),
          Mark("<|start|>"), "assistant", Mark("<|channel|>"), "final", Mark("<|message|>"), LITERAL_FINAL,
          Mark("<|return|>")]
ARGUMENTS = {"note": "<|call|> and <|end|><|start|>assistant", "n": 2}
CALL = [Mark("<|channel|>"), "commentary", Mark("<|message|>"), "Noting <|call|>.", Mark("<|end|>"),
        Mark("<|start|>"), "assistant", Mark("<|channel|>"), "commentary to=functions.get_time ", Mark("<|constrain|>"),
        "json", Mark("<|message|>"), json.dumps(ARGUMENTS), Mark("<|call|>")]
# no marker but the EOS (a reply held to JSON from its first token)
PLAIN = ['{"a": "<|end|>", "b": "<|channel|>"}', Mark("<|return|>")]


def _ids(tok, reply: list) -> list[int]:
    ids = []
    for part in reply:
        ids += [tok.convert_tokens_to_ids(part)] if isinstance(part, Mark) else \
            tok.encode(part, add_special_tokens=False, split_special_tokens=True)
    return ids


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def test_the_replies_spell_markers_with_ordinary_tokens(tok):
    marks = {tok.convert_tokens_to_ids(m) for m in MARKERS}
    for reply in (ANSWER, CALL, PLAIN):
        ids = _ids(tok, reply)
        assert sum(i in marks for i in ids) == sum(isinstance(p, Mark) for p in reply)
        assert _text(tok, ids) == "".join(reply)


def _whole(tok, reply: list, plan: ToolPlan):
    ids = _ids(tok, reply)
    text = harmony.LiteralMarkers.of(tok).feed(_text(tok, ids[:-1]), ids)  # (the last, an EOS, is not text)
    reasoning, rest = split_reasoning(GPTOSS, text)
    content, calls = plan.parse(rest)
    return reasoning, content, [(c.name, c.arguments) for c in calls]


def _auto() -> ToolPlan:
    return ToolPlan(ToolChoiceKind.AUTO, ({"name": "get_time"},), parser=ToolCallParser.OPENAI, harmony=True)


def test_literal_marker_text_is_content_and_marker_tokens_still_split(tok):
    assert _whole(tok, ANSWER, _auto()) == ("Say <|end|> plainly.", LITERAL_FINAL, [])
    reasoning, content, calls = _whole(tok, CALL, _auto())
    assert (reasoning, content) == (None, "Noting <|call|>.")
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_time", ARGUMENTS)]
    assert _whole(tok, PLAIN, _auto()) == (None, PLAIN[0], [])
    named = ToolPlan(ToolChoiceKind.NAMED, ({"name": "get_time"},), name="get_time", harmony=True)
    assert _whole(tok, PLAIN, named) == (None, None, [("get_time", PLAIN[0])])
    none = ToolPlan(ToolChoiceKind.NONE, ({"name": "get_time"},), harmony=True)
    assert _whole(tok, CALL, none) == (None, "Noting <|call|>.", [])


def _pieces(tok, ids: list[int], step: int, lag: int) -> list[tuple[str, list[int]]]:
    """The reply as the engine streams it: `step` ids a piece, the text `lag` tokens behind them (a possible
    stop string waits), the last id an EOS whose text is not in the reply."""
    texts = [_text(tok, ids[:n]) for n in range(len(ids))]
    pieces, sent = [], 0
    for start in range(0, len(ids), step):
        upto = texts[max(0, min(len(ids) - 1, start + step - lag))] if start + step < len(ids) else texts[-1]
        pieces.append((upto[sent:], ids[start:start + step]))
        sent = len(upto)
    return pieces


@pytest.mark.parametrize("step, lag", [(1, 0), (1, 3), (2, 1), (3, 0), (5, 4), (1000, 0)])
@pytest.mark.parametrize("reply", [ANSWER, CALL, PLAIN], ids=["answer", "call", "plain"])
def test_streamed_pieces_give_the_whole_reply(tok, reply, step, lag):
    """Reasoning, content and call deltas join to the whole reply's, whatever the cut: literal marker text
    comes through, no marker token's text (nor LITERAL) reaches a delta."""
    ids = _ids(tok, reply)
    marks, reasoning, tools = harmony.LiteralMarkers.of(tok), ReasoningStream(GPTOSS), ToolStream(_auto())
    thoughts, contents, calls = [], [], []
    pieces = _pieces(tok, ids, step, lag)
    for n, (text, piece_ids) in enumerate(pieces):
        last = n == len(pieces) - 1
        thought, rest = reasoning.feed(marks.feed(text, piece_ids), last)
        delta = tools.step(rest, last)
        thoughts.append(thought)
        contents.append(delta.get("content", ""))
        calls += delta.get("tool_calls", [])
    whole_reasoning, whole_content, whole_calls = _whole(tok, reply, _auto())
    assert "".join(thoughts) == (whole_reasoning or "") and "".join(contents) == (whole_content or "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == whole_calls
    assert not any(harmony.LITERAL in p for p in thoughts + contents)  # (a leaked marker would show in the joins)


# ---- over HTTP --------------------------------------------------------------------------------------------------
def _grammar(reply: list) -> str:
    """A Lark grammar whose one sentence is the reply: markers as special tokens, text as quoted literals, which
    only ordinary tokens can write (no_forcing: llguidance would force a literal's tokens as the tokenizer
    encodes its text, a marker's text as the marker's token, and then refuse that token)."""
    text = " ".join(part if isinstance(part, Mark) else json.dumps(part) for part in reply)
    return '%llguidance {"no_forcing": true}\nstart: ' + text


def _ask(client, reply: list, stream: bool = False, **extra):
    return client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "Hi"}], max_tokens=600,
                                          temperature=0, stream=stream, extra_body={"structured_outputs": {
                                              "grammar": _grammar(reply)}}, **extra)


def _streamed(chunks) -> tuple[str, str, list]:
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return ("".join(getattr(d, "reasoning", None) or "" for d in deltas), "".join(d.content or "" for d in deltas),
            [c for d in deltas for c in d.tool_calls or []])


def test_literal_marker_text_over_http(served):  # noqa: F811 - the fixture
    message = _ask(served, ANSWER).choices[0].message
    assert (message.reasoning, message.content) == ("Say <|end|> plainly.", LITERAL_FINAL)
    assert _streamed(_ask(served, ANSWER, stream=True)) == ("Say <|end|> plainly.", LITERAL_FINAL, [])


def test_literal_marker_text_in_call_arguments_over_http(served):  # noqa: F811 - the fixture
    choice = _ask(served, CALL, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Noting <|call|>."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_time", ARGUMENTS)]
    _, content, calls = _streamed(_ask(served, CALL, stream=True, tools=TOOLS))
    assert content == "Noting <|call|>."
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
