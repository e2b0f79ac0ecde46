"""Reasoning outputs (serve/reasoning.py): the <think> split finished and streamed, for both parsers,
and over real HTTP (the serving app under uvicorn, the demo pair, the `openai` client); Qwen3's
enable_thinking reaches the chat template through chat_template_kwargs."""
from __future__ import annotations

import openai
import pytest
import random
from itertools import chain, combinations, pairwise

from transformers import AutoTokenizer

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.prompts import render_chat
from saguaro_dist.serve.protocol import ChatMessage
from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.serve.reasoning import ReasoningParser, ReasoningStream, reasoning_first, split_reasoning

QWEN3, R1 = ReasoningParser.QWEN3, ReasoningParser.DEEPSEEK_R1


@pytest.mark.parametrize("parser, text, reasoning, content", [
    (QWEN3, "<think>\nadd them</think>\n\n4", "\nadd them", "\n\n4"),
    (QWEN3, "<think>cut by max_tokens", "cut by max_tokens", ""),  # vLLM's newest: cut before </think>, reasoning
    (QWEN3, "x<think>y</think>z", "x<think>y", "z"),        # only a leading <think> is dropped
    (R1, "add them</think>4", "add them", "4"),             # the template opened <think> in the prompt
    (R1, "<think>add them</think>4", "add them", "4"),
    (R1, "still thinking when max_tokens came", "still thinking when max_tokens came", ""),
    (None, "<think>a</think>b", None, "<think>a</think>b"),  # no parser: the text as it came
])
def test_split(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser, text", [
    (QWEN3, "<think>\nadd </thin them</think>\n\n4 </think> 5"), (QWEN3, "4, plainly </thi"),
    (R1, "<think>add </thin them</think>4"), (R1, "add them</think>4"), (R1, "<thin"), (R1, "cut </thi"),
])
def test_streamed_pieces_join_to_the_split(parser, text, piece):
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for start in range(0, len(text), piece):
        r, c = stream.feed(text[start:start + piece], start + piece >= len(text))
        reasoning, content = reasoning + r, content + c
    want_reasoning, want_content = split_reasoning(parser, text)
    assert (reasoning, content) == (want_reasoning or "", want_content)


@pytest.mark.parametrize("parser", [QWEN3, R1])
def test_every_split_of_a_reply_streams_as_the_whole(parser):
    """Old: a later <think> that began held text was dropped streamed (pieces "<think>x", "<think>y</think>z"
    streamed ("xy", "z"), the whole ("x<think>y", "z")). Every cut into up to 4 pieces, on seeded random texts
    of the tags' characters too."""
    rng = random.Random(5)
    texts = ["<think>x<think>y</think>z", "<think>a</think>b</think>c", "x</think>", "<think></think>", "<think>",
             "a<think>b</think>c", "<think><think>x", "<think>a</thi", " <think>a</think>b", "<thin"]
    texts += ["".join(rng.choice(["<think>", "</think>", "<", "/", "think>", "x", " "]) for _ in range(4)) for _ in range(8)]
    for text in texts:
        want = split_reasoning(parser, text)
        for cuts in chain.from_iterable(combinations(range(1, len(text)), k) for k in range(4)):
            bounds, stream, reasoning, content = [0, *cuts, len(text)], ReasoningStream(parser), "", ""
            for start, end in pairwise(bounds):
                r, c = stream.feed(text[start:end], end == len(text))
                reasoning, content = reasoning + r, content + c
            assert (reasoning, content) == (want[0] or "", want[1]), (text, cuts)


def test_reasoning_streams_as_it_comes():
    """Old: qwen3 sent nothing until </think> or the end. vLLM's streams reasoning deltas as they come, less text
    that may begin </think>."""
    stream = ReasoningStream(QWEN3)
    assert [stream.feed(piece, False) for piece in ("<think>", "add", " them </th", "en", "</think>4")] == [
        ("", ""), ("add", ""), (" them ", ""), ("</then", ""), ("", "4")]


def test_chat_template_kwargs_reach_the_template():
    target, _ = demo_pair()
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}")
    messages = [ChatMessage(role="user", content="hi")]
    assert render_chat(tok, messages)[0] == "hi"
    assert render_chat(tok, messages, template_kwargs={"enable_thinking": False})[0] == "hi<think>\n\n</think>"
    with pytest.raises(ValueError, match="may not set"):
        render_chat(tok, messages, template_kwargs={"tokenize": True})


@pytest.fixture(scope="module")
def served():
    target, _ = demo_pair()
    llm = LLM(model=target, mode="ar")
    apps = {parser: create_app(llm, ServerOptions("demo", reasoning_parser=parser))
            for parser in ("qwen3", "deepseek_r1", None)}
    with serve_on_loopback(apps["qwen3"]) as qwen3, serve_on_loopback(apps["deepseek_r1"]) as r1, \
            serve_on_loopback(apps[None]) as plain:
        yield {name: openai.OpenAI(base_url=url, api_key="none", max_retries=0)
               for name, url in (("qwen3", qwen3), ("deepseek_r1", r1), ("plain", plain))}
    llm.shutdown()


def _ask(client, **extra):
    return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "def f(x):"}],
                                          max_tokens=12, temperature=0, **extra)


def test_replies_are_split_over_http(served):
    """The demo model never writes </think>: its reply is cut before it, all reasoning under either parser
    (vLLM's newest qwen3 parser reads it so too, unless the prompt closed the think block); streamed the same."""
    plain = _ask(served["plain"]).choices[0].message
    assert plain.content and getattr(plain, "reasoning", None) is None
    for parser in ("qwen3", "deepseek_r1"):
        thought = _ask(served[parser]).choices[0].message
        assert thought.content is None and thought.reasoning == plain.content
        deltas = [c.choices[0].delta for c in _ask(served[parser], stream=True) if c.choices]
        assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == plain.content
        assert not "".join(d.content or "" for d in deltas)


def test_a_constrained_reply_reasons_first(served):
    """vLLM applies structured outputs once reasoning ends: the grammar lets any text up to </think> come
    first, so the demo model (which never writes </think>) reasons as it would unconstrained; a server
    without a reasoning parser constrains the whole reply."""
    plain = _ask(served["plain"]).choices[0].message.content
    out = _ask(served["deepseek_r1"], extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content is None and out.choices[0].message.reasoning == plain
    streamed = [c.choices[0].delta for c in _ask(served["deepseek_r1"], stream=True,
                                                 extra_body={"structured_outputs": {"choice": ["yes", "no"]}}) if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in streamed) == plain


def _matches(grammar: str, text: str) -> bool:
    """Whether llguidance takes `text` (the demo tokenizer's tokens) to an accepting state of `grammar`."""
    import llguidance
    import llguidance.hf

    from saguaro_dist.engine.structured import grammar_of
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar_of(StructuredOutputsParams(grammar=grammar)))
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("spec, good, bad", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": False}),
     ['<think>so a = 1\n</think>\n\n{"a": 1}', '</think>{"a": 2}'],
     ['{"a": 1}', '<think>x</think>\n\n{"a":1}', '<think>x</think>yes', '<think>x</think>{"a": 1}</think>']),
    (StructuredOutputsParams(regex="[0-9]+"), ["think </think> 42"], ["42", "</think>4x"]),
    (StructuredOutputsParams(choice=("yes", "no")), ["hmm</think>\nno"], ["yes", "hmm</think>maybe"]),
])
def test_reasoning_first_grammars(spec, good, bad):
    """Any text up to the first </think>, optional whitespace, then exactly what the request allows (JSON with
    our separators, as grammar_of writes it)."""
    grammar = reasoning_first(spec, "<|user|>hi<|assistant|>").grammar
    assert all(_matches(grammar, text) for text in good)
    assert not any(_matches(grammar, text) for text in bad)


def test_reasoning_first_takes_the_tags_own_tokens():
    """Old: with <think> and </think> single added tokens (Qwen3's, DeepSeek-R1's tokenizers), which llguidance
    reads as special and masks, a constrained reply could end its reasoning only by spelling </think> in other
    tokens, and could not open with its <think>: it reasoned to max_tokens. Now the grammar names the tokens."""
    import llguidance
    import llguidance.hf

    from saguaro_dist.engine.structured import grammar_of
    from saguaro_dist.serve.reasoning import ReasoningTokens
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    tok.add_tokens(["<think>", "</think>"])
    tags, vocab = ReasoningTokens.of(tok), llguidance.hf.from_tokenizer(tok)
    grammar = grammar_of(reasoning_first(StructuredOutputsParams(json_object=True), "<|user|>hi", R1, tags))

    def takes(*pieces) -> bool:
        ids = [i for p in pieces for i in (list(p) if isinstance(p, tuple) else tok.encode(p, add_special_tokens=False))]
        matcher = llguidance.LLMatcher(vocab, grammar)
        return matcher.consume_tokens(ids) and matcher.is_accepting()
    assert tags.open_ids != tags.close_ids and len(tags.open_ids) == len(tags.close_ids) == 1
    assert takes(tags.open_ids, " a", tags.close_ids, "\n{}") and takes(" a", tags.close_ids, "{}")
    assert takes(tags.close_ids, "{}") and takes(" a", "</", "think>", "{}")  # spelled in other tokens
    assert not takes(" a</think>b", tags.close_ids, "{}")  # the text's first </think> ends it, as the split reads
    assert not takes(" a", tags.close_ids, "yes") and not takes(" a", tags.close_ids, tags.close_ids, "{}")


def test_reasoning_is_not_added_where_it_cannot_be():
    choice = StructuredOutputsParams(choice=("yes",))
    assert reasoning_first(choice, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # the template closed it
    assert reasoning_first(choice, "<|im_start|>assistant\n<think>\n") is not None               # deepseek_r1 opened it
    assert reasoning_first(choice, "<think>a</think>b<|im_start|>user\nok<|im_start|>assistant\n") is not None  # an earlier turn's
    assert reasoning_first(StructuredOutputsParams(grammar='start: "a"'), "") is None             # a request's own Lark


def test_bad_chat_template_kwargs_get_a_400(served):
    with pytest.raises(openai.BadRequestError, match="may not set"):
        _ask(served["qwen3"], extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_the_parser_option_is_checked_where_it_is_given(capsys):
    from saguaro_dist.cli import main
    from saguaro_dist.serve.app import build_app, server_options
    assert server_options({"reasoning_parser": "qwen3"}, "m").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        build_app({"model": "m", "draft": "d", "reasoning_parser": "o1"})
    with pytest.raises(SystemExit):
        main(["serve", "--reasoning-parser", "o1"])
    assert "invalid choice" in capsys.readouterr().err


def test_sdks_return_the_reasoning(served):
    """Our Client and AsyncClient read `reasoning` from whole replies and from streamed deltas."""
    import asyncio

    from saguaro_dist.client import AsyncClient, Client
    base_url = str(served["deepseek_r1"].base_url)
    messages = [{"role": "user", "content": "def f(x):"}]
    with Client(base_url) as sdk:
        done = sdk.chat(messages, max_tokens=12, temperature=0)
        stream = sdk.chat(messages, max_tokens=12, temperature=0, stream=True)
        assert "".join(stream) == "" and done.text == ""
        assert done.reasoning and stream.reasoning == done.reasoning

    async def streamed():
        async with AsyncClient(base_url) as client:
            s = await client.chat(messages, max_tokens=12, temperature=0, stream=True)
            [_ async for _ in s]
            return s.reasoning
    assert asyncio.run(streamed()) == done.reasoning


def test_a_reasoning_first_grammar_is_followed_alike_by_every_mode():
    """The composed grammar is an ordinary structured output: ssd (the draft told it too) and ar agree."""
    from saguaro_dist import SamplingParams
    target, draft = demo_pair()
    spec = reasoning_first(StructuredOutputsParams(regex="[0-9]+"), "")
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec)
    outs = {}
    for mode in ("ar", "ssd"):
        with LLM(model=target, draft=None if mode == "ar" else draft, mode=mode, draft_executor="thread") as llm:
            outs[mode] = llm.generate(["def f(x):"], params)[0]
    assert outs["ssd"].token_ids == outs["ar"].token_ids and outs["ar"].metrics.num_generated_tokens == 24
