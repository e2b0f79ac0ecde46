"""A gpt-oss server's constrained replies (reasoning.harmony_first): with the `openai_gptoss` reasoning parser a
request's constraint (JSON schema, regex, choice, a named or required tool call) holds the final channel's body,
after an optional analysis message, as vLLM applies structured outputs to gpt-oss. The grammar driven through
llguidance with a tokenizer that has harmony's special tokens, and a reply over real HTTP (a tiny random
checkpoint, the `served` server of test_serve_harmony.py)."""
from __future__ import annotations

import json

import pytest
from test_serve_harmony import _leaks, harmony_tokenizer, served  # noqa: F401 - served: the fixture

from saguaro_dist.sampling_params import StructuredOutputsParams
from saguaro_dist.serve.reasoning import ReasoningParser, reasoning_first, split_reasoning

GPTOSS = ReasoningParser.OPENAI_GPTOSS
PROMPT = "<|start|>user<|message|>2+2?<|end|><|start|>assistant"  # as gpt-oss's template ends a prompt
THINK = "<|channel|>analysis<|message|>a is 1.<|end|><|start|>assistant"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def _matches(grammar: str, text: str | list[int]) -> bool:
    """Whether llguidance takes `text` (its markers as special tokens; or token ids) to an accepting state."""
    import llguidance
    import llguidance.hf

    from saguaro_dist.engine.structured import grammar_of
    tok = harmony_tokenizer()
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar_of(StructuredOutputsParams(grammar=grammar)))
    ids = tok.encode(text, add_special_tokens=False) if isinstance(text, str) else text
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def _typed(text: str) -> list[int]:
    """`text` spelt a character a token: its markers as plain text, not special tokens."""
    tok = harmony_tokenizer()
    return [i for c in text for i in tok.encode(c, add_special_tokens=False)]


@pytest.mark.parametrize("spec, good, bad", [
    (StructuredOutputsParams(json=SCHEMA),
     [THINK + '<|channel|>final<|message|>{"a": 1}', '<|channel|>final<|message|>{"a": 1}',
      THINK + '<|channel|>final <|constrain|>json<|message|>{"a": 1}<|end|>', '<|channel|>final json<|message|>{"a": 2}'],
     ['{"a": 1}', '<|channel|>analysis<|message|>{"a": 1}', THINK + '<|channel|>commentary<|message|>{"a": 1}',
      THINK + '<|channel|>final<|message|>{"a": "1"}', THINK + THINK + '<|channel|>final<|message|>{"a": 1}',
      THINK + '<|channel|>final<|message|>{"a": 1}<|end|><|start|>assistant<|channel|>final<|message|>{"a": 1}']),
    (StructuredOutputsParams(regex="[0-9]+"), [THINK + "<|channel|>final<|message|>42"],
     ["42", THINK + "<|channel|>final <|constrain|>json<|message|>42", THINK + "<|channel|>final<|message|>4x"]),
    (StructuredOutputsParams(choice=("yes", "no")), [THINK + "<|channel|>final<|message|>no<|end|>"],
     ["yes", "<|channel|>analysis<|message|>yes", THINK + "<|channel|>final<|message|>maybe"]),
])
def test_an_analysis_then_the_constraint_in_the_final_channel(spec, good, bad):
    """vLLM's harmony structured outputs: at most one analysis message, then the final channel (JSON may say
    ` json` or ` <|constrain|>json` in its header) holding exactly what the request allows, then <|end|> or EOS."""
    grammar = reasoning_first(spec, PROMPT, GPTOSS).grammar
    assert all(_matches(grammar, text) for text in good)
    assert not any(_matches(grammar, text) for text in bad)


def test_the_analysis_holds_no_markers_text():
    """A marker typed as plain characters in the analysis would end it for the splitter (which reads text), so
    the grammar refuses it there too."""
    grammar = reasoning_first(StructuredOutputsParams(choice=("yes",)), PROMPT, GPTOSS).grammar
    tok = harmony_tokenizer()
    head, tail = (tok.encode(t, add_special_tokens=False) for t in ("<|channel|>analysis<|message|>",
                                                                  "<|end|><|start|>assistant<|channel|>final<|message|>yes"))
    assert _matches(grammar, head + _typed("a <| b |> c") + tail)
    assert not _matches(grammar, head + _typed("a <|end|> c") + tail)


def test_a_prompt_that_leaves_a_message_open_is_constrained_whole():
    choice = StructuredOutputsParams(choice=("yes",))
    assert reasoning_first(choice, PROMPT + "<|channel|>final<|message|>", GPTOSS) is None  # a prefilled final
    assert reasoning_first(choice, PROMPT + "<|channel|>analysis<|message|>hm", GPTOSS) is None
    assert reasoning_first(choice, "<|channel|>final<|message|>4<|return|>" + PROMPT, GPTOSS) is not None  # an earlier turn
    assert reasoning_first(StructuredOutputsParams(grammar='start: "a"'), PROMPT, GPTOSS) is None  # a request's own Lark


ANSWER_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
TOOLS = [{"type": "function", "function": {"name": "confirm", "parameters": ANSWER_SCHEMA}}]
ASK = dict(model="gpt", messages=[{"role": "user", "content": "ok?"}], max_tokens=300, temperature=0)


def test_a_json_schema_reply_over_http(served):  # noqa: F811
    """The reply is harmony (old: JSON from the first token): its content is the final channel's JSON, matching
    the schema, whole and streamed alike; an analysis (this tiny model writes none) would be the reasoning."""
    out = served.chat.completions.create(**ASK, response_format=RESPONSE_FORMAT, extra_body={"return_token_ids": True})
    choice, message = out.choices[0], out.choices[0].message
    assert harmony_tokenizer().decode(choice.token_ids).startswith(("<|channel|>final", "<|channel|>analysis"))
    assert choice.finish_reason == "stop" and isinstance(json.loads(message.content)["ok"], bool)
    assert set(json.loads(message.content)) == {"ok"}
    deltas = [c.choices[0].delta for c in served.chat.completions.create(**ASK, response_format=RESPONSE_FORMAT,
                                                                          stream=True) if c.choices]
    thoughts, contents = [getattr(d, "reasoning", None) or "" for d in deltas], [d.content or "" for d in deltas]
    assert "".join(contents) == message.content and "".join(thoughts) == (getattr(message, "reasoning", None) or "")
    assert not _leaks(thoughts) and not _leaks(contents)


def test_a_named_tool_call_over_http(served):  # noqa: F811
    """A named call's arguments are the final channel's JSON (vLLM's reasoning-end route), read into the call."""
    named = {"type": "function", "function": {"name": "confirm"}}
    out = served.chat.completions.create(**ASK, tools=TOOLS, tool_choice=named, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert harmony_tokenizer().decode(choice.token_ids).startswith(("<|channel|>final", "<|channel|>analysis"))
    (call,) = choice.message.tool_calls
    assert call.function.name == "confirm" and set(json.loads(call.function.arguments)) == {"ok"}
    chunks = served.chat.completions.create(**ASK, tools=TOOLS, tool_choice=named, stream=True)
    streamed = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert "".join(c.function.arguments or "" for c in streamed) == call.function.arguments


def test_the_harmony_grammar_is_followed_alike_by_every_mode(tmp_path):
    """An ordinary structured output: ssd (its draft told the grammar too, special tokens and all) and ar write
    the same reply, an analysis (logit_bias steers this random model into one) then the final JSON."""
    from engine_helpers import llama_config, save_model

    from saguaro_dist import LLM, SamplingParams
    tok = harmony_tokenizer()
    tok.save_pretrained(tmp_path)
    config = llama_config(len(tok), hidden=32, layers=2)
    config.max_position_embeddings = 1024
    save_model(tmp_path, config, seed=0)
    spec = reasoning_first(StructuredOutputsParams(json=ANSWER_SCHEMA), PROMPT, GPTOSS)
    # "a" leads this model's analysis, then <|end|> (margins of ~0.45 logits either way)
    bias = {tok.convert_tokens_to_ids("a"): 10.0, tok.convert_tokens_to_ids("<|end|>"): 10.75}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec, skip_special_tokens=False, logit_bias=bias)
    outs = {}
    for mode in ("ar", "ssd"):
        with LLM(model=str(tmp_path), draft=None if mode == "ar" else str(tmp_path), mode=mode, draft_executor="thread") as llm:
            outs[mode] = llm.generate([PROMPT], params)[0]
    assert outs["ssd"].token_ids == outs["ar"].token_ids and outs["ssd"].metrics.drafted_tokens > 0
    reasoning, content = split_reasoning(GPTOSS, outs["ar"].text)
    assert reasoning == "a" and set(json.loads(content)) == {"ok"}
