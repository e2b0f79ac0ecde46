"""Qwen3.5 / Qwen3-Coder may open a tool call inside the think block without writing </think> first. vLLM's
qwen3 reasoning parser reads such a reply with no </think> as reasoning up to the <tool_call> that opens a call
(one followed, after any whitespace, by <function= or <function name=), and the call on as content, so the tool
parser reads it; a </think> anywhere still ends the reasoning first. Old: the whole reply was reasoning and the
call was lost. Whole and streamed (any cut) agree; the reasoning token count and the reasoning-first grammar
of constrained replies end the reasoning where the split does."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream, ReasoningTokens, split_reasoning
from saguaro_dist.serve.tool_parsers import ToolCallParser
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan, ToolStream

QWEN3, R1 = ReasoningParser.QWEN3, ReasoningParser.DEEPSEEK_R1
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nTucson\n</parameter>\n</function>\n</tool_call>"
THOUGHT = "Let me call the tool.\n"
FUNCTIONS = ({"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},)
PLAN = ToolPlan(ToolChoiceKind.AUTO, FUNCTIONS, parser=ToolCallParser.QWEN3_CODER)


@pytest.mark.parametrize("text, reasoning, content", [
    (THOUGHT + CALL, THOUGHT, CALL),                                   # the repro
    ("<think>" + THOUGHT + CALL, THOUGHT, CALL),                       # older templates: the model opens <think>
    (CALL, None, CALL),                                                # a call straight away
    (THOUGHT + "<tool_call>  \n\t<function name=\"f\">", THOUGHT, "<tool_call>  \n\t<function name=\"f\">"),
    (THOUGHT + "<tool_call><function=f>", THOUGHT, "<tool_call><function=f>"),
    ("a <tool_call> b" + CALL, "a <tool_call> b", CALL),               # a mention first: the call still ends it
    # a </think> anywhere ends the reasoning first (vLLM's extract_reasoning looks for it first)
    (THOUGHT + CALL + "</think>done", THOUGHT + CALL, "done"),
    ("x</think>" + CALL, "x", CALL),
    # no call opens: a mention of the tag, or a tag not followed by <function= / <function name
    ("I would write <tool_call> here", "I would write <tool_call> here", ""),
    ("use <tool_call>{\"name\": 1}", "use <tool_call>{\"name\": 1}", ""),
    ("cut at <tool_call>\n<function", "cut at <tool_call>\n<function", ""),
    ("cut at <tool_call>\n<functions=", "cut at <tool_call>\n<functions=", ""),
    ("<tool_call></tool_call> is the pair", "<tool_call></tool_call> is the pair", ""),
])
def test_a_call_opened_while_thinking_ends_qwen3_reasoning(text, reasoning, content):
    assert split_reasoning(QWEN3, text) == (reasoning, content)


def test_deepseek_r1_keeps_such_a_call_as_reasoning():
    """vLLM's deepseek_r1 parser knows no tool-call end: only </think>."""
    assert split_reasoning(R1, THOUGHT + CALL) == (THOUGHT + CALL, "")


def test_the_call_reaches_the_tool_parser():
    reasoning, rest = split_reasoning(QWEN3, THOUGHT + CALL)
    content, calls = PLAN.parse(rest)
    assert reasoning == THOUGHT and not content
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Tucson"}')]


def _streamed(parser, pieces: list[str]) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for i, piece in enumerate(pieces):
        thought, text = stream.feed(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + thought, content + text
    return reasoning, content


def _cuts(text: str, rng: random.Random) -> list[str]:
    """text in random pieces (some empty), a tag often cut between two."""
    cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(0, min(len(text), 14))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


TEXTS = [THOUGHT + CALL, "<think>" + THOUGHT + CALL, CALL, THOUGHT + CALL + "</think>done", "x</think>" + CALL,
         "a <tool_call> b" + CALL, "I would write <tool_call> here", "cut at <tool_call>\n<function",
         "t<tool_call> \n <function name=\"f\">", "<tool_call>\n\n", "<tool_call",
         "<tool_call><tool_call>\n<function=f", "<tool_call>\n<funct</think>y", "<tool_call>\n<function=f></thi"]


@pytest.mark.parametrize("parser", [QWEN3, R1])
def test_streamed_pieces_join_to_the_split_under_any_cut(parser):
    """Random cuts (a tag split between deltas, empty deltas) of fixed texts and of seeded random texts made of
    the markers' pieces: the deltas join to split_reasoning of the whole."""
    rng = random.Random(89)
    parts = ["<tool_call>", "<function=", "<function", " name=", "</think>", "<think>", "\n", " ", "<", "f", ">"]
    texts = TEXTS + ["".join(rng.choice(parts) for _ in range(rng.randint(1, 7))) for _ in range(300)]
    for text in texts:
        reasoning, content = split_reasoning(parser, text)
        for _ in range(25):
            assert _streamed(parser, _cuts(text, rng)) == (reasoning or "", content), text


def test_every_two_piece_cut_of_the_repro_streams_as_the_whole():
    text = "<think>" + THOUGHT + CALL
    for at in range(len(text) + 1):
        assert _streamed(QWEN3, [text[:at], text[at:]]) == (THOUGHT, CALL)


def test_the_reasoning_streams_before_the_call_and_the_call_is_held_only_while_undecided():
    stream = ReasoningStream(QWEN3)
    assert stream.feed(THOUGHT + "<tool_", False) == (THOUGHT, "")  # a tag may be beginning: held
    assert stream.feed("call>\n", False) == ("", "")                 # may still open a call
    assert stream.feed("<function=get_weather>", False) == ("", "")  # a call: content, unless </think> comes
    closed = "\n</function>\n</tool_call>"
    assert stream.feed(closed, True) == ("", "<tool_call>\n<function=get_weather>" + closed)
    mention = ReasoningStream(QWEN3)
    assert mention.feed("say <tool_call>", False) == ("say ", "")
    assert mention.feed(" and go on", False) == ("<tool_call> and go on", "")  # no call: reasoning at once


def test_streamed_through_the_tool_stream_the_call_is_parsed():
    rng = random.Random(3)
    text = THOUGHT + CALL
    for _ in range(20):
        stream, tools, reasoning, calls = ReasoningStream(QWEN3), ToolStream(PLAN), "", {}
        pieces = _cuts(text, rng)
        for i, piece in enumerate(pieces):
            final = i == len(pieces) - 1
            thought, rest = stream.feed(piece, final)
            reasoning += thought
            for call in tools.step(rest, final).get("tool_calls", []):
                name, arguments = calls.get(call["index"], ("", ""))
                function = call.get("function", {})
                calls[call["index"]] = (name + (function.get("name") or ""),
                                        arguments + (function.get("arguments") or ""))
        assert reasoning == THOUGHT and list(calls.values()) == [("get_weather", '{"city": "Tucson"}')]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])  # as Qwen3's tokenizers have them
    return tok


@pytest.mark.parametrize("text", [THOUGHT + CALL, "<think>" + THOUGHT + CALL, CALL, THOUGHT + CALL + "</think>ok",
                                  "say <tool_call> and " + CALL, "no call: <tool_call> x", "plain thought"])
@pytest.mark.parametrize("parser", [QWEN3, R1])
def test_reasoning_tokens_end_where_the_split_does(tokenizer, parser, text):
    """usage's reasoning_tokens: the tokens of the split's reasoning (Old: a call opened while thinking was
    counted as reasoning under qwen3)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    reasoning, _ = split_reasoning(parser, text)
    want = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    assert ReasoningTokens.of(tokenizer).count(parser, ids) == want


def test_a_call_opened_while_thinking_is_not_counted_as_reasoning(tokenizer):
    ids = tokenizer.encode("<think>" + THOUGHT + CALL, add_special_tokens=False)
    thought = len(tokenizer.encode(THOUGHT, add_special_tokens=False))
    assert ReasoningTokens.of(tokenizer).count(QWEN3, ids) == thought < len(ids) - 1
    assert ReasoningTokens.of(tokenizer).count(R1, ids) == len(ids) - 1


def test_a_constrained_reply_still_reasons_to_its_first_think_close():
    """The reasoning-first grammar ends the reasoning at the first </think>, and split_reasoning reads that
    </think> first even after a call opened while thinking: the constrained answer is the content exactly."""
    import llguidance
    import llguidance.hf

    from saguaro_dist.engine.structured import grammar_of
    from saguaro_dist.sampling_params import StructuredOutputsParams
    from saguaro_dist.serve.reasoning import reasoning_first
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    grammar = grammar_of(reasoning_first(StructuredOutputsParams(choice=("yes", "no")), "<|user|>hi", QWEN3))
    text = THOUGHT + CALL + "</think>\nno"
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar)
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    assert split_reasoning(QWEN3, text) == (THOUGHT + CALL, "\nno")


def _stream_seconds(text: str) -> float:
    """CPU seconds of this thread (the stream runs in it) to stream `text` in 1-character deltas (the split
    checked): a stall of a loaded box, while other processes run, is not counted, as wall time would be."""
    import time
    start = time.thread_time()
    assert _streamed(QWEN3, list(text)) == tuple(part or "" for part in split_reasoning(QWEN3, text))
    return time.thread_time() - start


def _best_of_three_under(text: str, bound: float) -> float:
    """The least of up to 3 timings of `text`, stopping at one under `bound` (what's left of noise is cache
    and frequency, which a retry clears; the quadratic bug is slow on every try)."""
    best = float("inf")
    for _ in range(3):
        best = min(best, _stream_seconds(text))
        if best < bound:
            break
    return best


def test_a_long_stream_after_a_call_opened_while_thinking_costs_linear_time():
    """Once a call opened, the rest is held: each delta is searched for </think> once, not the whole held text
    again (Old: 60 KB after the call in 1-character deltas took ~7x a plain reasoning stream; 200 KB ~70 s)."""
    size = 60_000
    bound = 3 * _stream_seconds("x" * size) + 0.5
    assert _best_of_three_under("<tool_call>\n<function=f>\n" + "y" * size, bound) < bound
    assert _best_of_three_under("<tool_call>\n<function=f>\n" + "y" * size + "</think>ok", bound) < bound


def test_a_constrained_reply_cut_inside_its_reasoning_is_all_reasoning():
    """A reply constrained after its reasoning (reasoning_first's grammar ends it at </think> only) that stops
    inside the reasoning, after a call opened there, is all reasoning, counted so too: split at the call, its
    raw call text reached a named tool_choice's parse as the function's arguments."""
    from saguaro_dist import LLM, SamplingParams
    from saguaro_dist.sampling_params import StructuredOutputsParams
    from saguaro_dist.serve.state import Job, ServingState

    cut = THOUGHT + "<tool_call>\n<function=get_weather>\n<parameter=city>\nTuc"
    with LLM(model=demo_pair()[0], mode="ar") as llm:
        state = ServingState(llm, "m", metrics=None, reasoning_parser="qwen3")
        params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=("yes", "no")))
        job = Job(prompt_ids=llm.tokenizer.encode("hi"), params=params, reasoned=True)
        parser = state.reasoning_parser_for(job)
        assert split_reasoning(parser, cut) == (cut, "")
        ids = llm.tokenizer.encode(cut, add_special_tokens=False)
        assert state.reasoning_count(job, ids) == len(ids)
        free = Job(prompt_ids=job.prompt_ids, params=SamplingParams())  # an unconstrained reply: the call ends it
        assert split_reasoning(state.reasoning_parser_for(free), cut) == (THOUGHT, cut[len(THOUGHT):])
