"""usage's reasoning_tokens (Responses' output_tokens_details, chat's completion_tokens_details): the count of
generated tokens a reasoning parser read as reasoning, streamed and not, over real HTTP (the serving app under
uvicorn, the `openai` client) against a real engine. The demo model never writes </think>, so the engine runs
a tiny Llama written by transformers whose weights make greedy decoding follow a script, Qwen3-style (the
tags are single added tokens): "<think> add them</think> 4" then end-of-sequence."""
from __future__ import annotations

from itertools import pairwise

import openai
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.demo import demo_pair
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.reasoning import ReasoningParser

REASONING, CONTENT = " add them", " 4"
QUESTION = [{"role": "user", "content": "2 + 2?"}]


def write_scripted_checkpoint(path) -> list[int]:
    """A Llama whose greedy reply to any prompt is the script's ids (returned). Attention and MLPs are zero, so
    a token's hidden state is its embedding: one slot per script token, whose lm_head row names the next
    token; every other token shares slot 0, which starts the script."""
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    tok.add_tokens(["<think>", "</think>"])  # as Qwen3's tokenizer has them: added, not special
    tok.save_pretrained(path)
    think, unthink = tok.convert_tokens_to_ids(["<think>", "</think>"])
    script = [think, *tok.encode(REASONING, add_special_tokens=False), unthink,
              *tok.encode(CONTENT, add_special_tokens=False), tok.eos_token_id]
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[:, 0], head[script[0], 0] = 1.0, 10.0
        for slot, (token, following) in enumerate(pairwise(script), start=1):
            embed[token] = 0.0
            embed[token, slot], head[following, slot] = 1.0, 10.0
    model.save_pretrained(path)
    return script


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted")
    script = write_scripted_checkpoint(path)
    llm = LLM(model=str(path), mode="ar")
    apps = {name: create_app(llm, ServerOptions("scripted", reasoning_parser=name)) for name in ("qwen3", "deepseek_r1")}
    with serve_on_loopback(apps["qwen3"]) as qwen3, serve_on_loopback(apps["deepseek_r1"]) as r1, \
            serve_on_loopback(create_app(llm, ServerOptions("scripted"))) as plain:
        clients = {name: openai.OpenAI(base_url=url, api_key="none", max_retries=0)
                   for name, url in (("qwen3", qwen3), ("deepseek_r1", r1), (None, plain))}
        yield clients, script, llm.tokenizer
    llm.shutdown()


def _reasoning_ids(tokenizer) -> int:
    return len(tokenizer.encode(REASONING, add_special_tokens=False))


def _respond(client, **extra):
    return client.responses.create(model="scripted", input="2 + 2?", temperature=0, **extra)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_responses_count_the_reasoning_tokens(served, parser):
    """Old: output_tokens_details.reasoning_tokens was 0 with the reply split into reasoning and content."""
    clients, script, tokenizer = served
    resp = _respond(clients[parser])
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == REASONING and resp.output_text == CONTENT
    assert resp.usage.output_tokens == len(script)
    assert resp.usage.output_tokens_details.reasoning_tokens == _reasoning_ids(tokenizer) == 2
    events = list(_respond(clients[parser], stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.model_dump() == resp.usage.model_dump()


@pytest.mark.parametrize("parser, reasoning", [("qwen3", 2), ("deepseek_r1", 2), (None, 0)])
def test_a_reply_cut_before_think_closes(served, parser, reasoning):
    """Cut after "<think> add them": all reasoning but the leading <think> (vLLM's newest qwen3 parser too; an
    older one read it as content); a server without a parser reports 0, as OpenAI's field is always there."""
    clients, _, _ = served
    for streamed in (False, True):
        resp = _respond(clients[parser], max_output_tokens=3, stream=streamed)
        usage = (list(resp)[-1].response if streamed else resp).usage
        assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (3, reasoning)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_chat_usage_counts_the_reasoning_tokens(served, parser):
    """Old: chat's usage had no completion_tokens_details; now reasoning_tokens, summed over the choices."""
    clients, script, tokenizer = served
    chat = clients[parser].chat.completions.create(model="scripted", messages=QUESTION, temperature=0, n=2)
    assert chat.choices[0].message.reasoning == REASONING and chat.choices[0].message.content == CONTENT
    assert chat.usage.completion_tokens == 2 * len(script)
    assert chat.usage.completion_tokens_details.reasoning_tokens == 2 * _reasoning_ids(tokenizer)
    chunks = list(clients[parser].chat.completions.create(model="scripted", messages=QUESTION, temperature=0, n=2,
                                                          stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == chat.usage.model_dump()


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_constrained_reply_reasons_with_the_tags_own_tokens(served, parser):
    """Old: the reason-first grammar took </think> only as text, and llguidance masks the added tag tokens: the
    scripted reply could not even open with its <think>. Now it reasons, closes with its </think>, then answers."""
    clients, script, _ = served
    for spec in ({"regex": "[0-9]+"}, {"choice": ["4", "5"]}):
        chat = clients[parser].chat.completions.create(model="scripted", messages=QUESTION, temperature=0,
                                                       max_tokens=12, extra_body={"structured_outputs": spec})
        assert (chat.choices[0].message.reasoning, chat.choices[0].message.content) == (REASONING, CONTENT), spec
        assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == len(script)


def test_a_prompt_that_closed_the_think_block_gets_content(served):
    """Old: split as any reply. A prompt that closed the think block (Qwen3's enable_thinking false) gets its
    reply as content, none of it reasoning (vLLM's prompt_is_reasoning_end): the scripted tags stay in it."""
    clients, _, _ = served
    closed = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    for streamed in (False, True):
        reply = clients["qwen3"].chat.completions.create(
            model="scripted", messages=closed, temperature=0, stream=streamed,
            extra_body={"add_generation_prompt": False, "continue_final_message": True})
        if streamed:
            deltas = [c.choices[0].delta for c in reply if c.choices]
            text = "".join(d.content or "" for d in deltas)
            assert not any(getattr(d, "reasoning", None) for d in deltas)
        else:
            text = reply.choices[0].message.content
            assert getattr(reply.choices[0].message, "reasoning", None) is None
            assert reply.usage.completion_tokens_details.reasoning_tokens == 0
        assert text == "<think>" + REASONING + "</think>" + CONTENT


CONTINUED = "<think>\nI thought.\n</think>\n\nThe answer is"  # Qwen3's template writes the last assistant turn so


def _continued_reply(client, streamed: bool, route: str) -> tuple[str, str, int]:
    """(reasoning, content, reasoning_tokens) of the scripted reply continuing CONTINUED, on chat or responses."""
    if route == "responses":
        item = {"type": "message", "role": "assistant", "status": "incomplete",
                "content": [{"type": "output_text", "text": CONTINUED}]}
        resp = client.responses.create(model="scripted", input=[*QUESTION, item], temperature=0, stream=streamed)
        resp = list(resp)[-1].response if streamed else resp
        reasoning = "".join(part.text for item in resp.output if item.type == "reasoning" for part in item.content or [])
        return reasoning, resp.output_text, resp.usage.output_tokens_details.reasoning_tokens
    messages = [*QUESTION, {"role": "assistant", "content": CONTINUED}]
    reply = client.chat.completions.create(
        model="scripted", messages=messages, temperature=0, stream=streamed,
        stream_options={"include_usage": True} if streamed else None,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    if not streamed:
        message = reply.choices[0].message
        return getattr(message, "reasoning", None) or "", message.content, reply.usage.completion_tokens_details.reasoning_tokens
    chunks = list(reply)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return ("".join(getattr(d, "reasoning", None) or "" for d in deltas), "".join(d.content or "" for d in deltas),
            chunks[-1].usage.completion_tokens_details.reasoning_tokens)


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_continued_message_after_its_closed_think_block_is_content(served, route):
    """Old: only a prompt ENDING with </think> counted as closed, so continuing an assistant message whose think
    block the template closed before its content (Qwen3's) read the continuation as reasoning. Now a continued
    message is read by its last think tag (vLLM's is_reasoning_end): all content, none of it reasoning."""
    clients, _, _ = served
    for streamed in (False, True):
        assert _continued_reply(clients["qwen3"], streamed, route) == ("", "<think>" + REASONING + "</think>" + CONTENT, 0)


def test_a_continued_message_is_read_by_its_last_think_tag():
    """A continued message's last tag decides, by id where a tag is one token (text in it may spell one); a new
    turn's prompt is closed only where it ends so (an earlier turn's block does not count)."""
    from saguaro_dist.serve.reasoning import ReasoningTokens, prompt_closed_reasoning
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    spelled = ReasoningTokens.of(tok)
    tok.add_tokens(["<think>", "</think>"])
    tags = ReasoningTokens.of(tok)
    for text, closed in ((CONTINUED, True), ("<think>\nhmm", False), ("</think><think> so", False), ("no tags", False)):
        assert prompt_closed_reasoning(text, continues=True) is closed, text
        assert tags.prompt_closed(tok.encode(text, add_special_tokens=False)) is closed, text
    assert not prompt_closed_reasoning(CONTINUED) and prompt_closed_reasoning("<think>\n\n</think>\n\n")
    assert tags.prompt_closed([*tok.encode("<think> a", add_special_tokens=False), *tok.encode("</", add_special_tokens=False),
                               *tok.encode("think>", add_special_tokens=False)]) is False  # spelled: no tag
    assert spelled.prompt_closed(tok.encode(CONTINUED, add_special_tokens=False)) is None  # tags of many tokens: the text's


def test_chat_without_a_reasoning_parser_reports_no_details(served):
    clients, _, _ = served
    chat = clients[None].chat.completions.create(model="scripted", messages=QUESTION, temperature=0)
    assert chat.choices[0].message.content == "<think>" + REASONING + "</think>" + CONTENT
    assert chat.usage.completion_tokens_details is None


def test_tags_generated_in_other_pieces_than_their_encoding():
    """A tokenizer that spells </think> in several tokens (the demo's) may generate it piece by piece: the
    tag is then found in the decoded text, and its tokens are not counted."""
    from saguaro_dist.serve.reasoning import ReasoningTokens  # new: imported here so the HTTP tests run on old code
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    count = ReasoningTokens.of(tok).count

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)
    thought = ids(REASONING)
    by_char = [t for c in "</think>" for t in ids(c)]
    assert by_char != ids("</think>") and tok.decode(by_char) == "</think>"
    for parser in (p for p in ReasoningParser if not p.harmony):  # (harmony has no <think> tags)
        assert count(parser, ids("<think>") + thought + by_char + ids(CONTENT)) == len(thought)
        assert count(parser, thought + ids("</think>") + ids(CONTENT)) == len(thought)
    assert count(ReasoningParser.QWEN3, thought + ids(CONTENT)) == len(thought + ids(CONTENT))  # no </think>: cut
    assert count(ReasoningParser.DEEPSEEK_R1, ids("<think>") + thought) == len(thought)
    assert count(None, ids("<think>") + thought + ids("</think>")) == 0


def test_the_count_splits_where_the_text_does():
    """Old: with single-token tags (added, as Qwen3's), a </think> spelled in other tokens before the tag's own
    token was passed by (counted up to the later one), and a leading <think> spelled so was counted as
    reasoning, though the text's split drops it."""
    from saguaro_dist.serve.reasoning import ReasoningTokens, split_reasoning
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    tok.add_tokens(["<think>", "</think>"])
    count, (think, unthink) = ReasoningTokens.of(tok).count, tok.convert_tokens_to_ids(["<think>", "</think>"])

    def ids(*pieces: str) -> list[int]:
        return [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]
    thought = ids(REASONING)
    for parser in (ReasoningParser.QWEN3, ReasoningParser.DEEPSEEK_R1):
        for reply in (ids("<thi", "nk>") + thought + [unthink] + ids(CONTENT),
                      [think] + thought + ids("</", "think>", " more") + [unthink] + ids(CONTENT),
                      ids("<", "think>") + thought + ids("</th", "ink>", CONTENT)):
            assert split_reasoning(parser, tok.decode(reply))[0] == REASONING
            assert count(parser, reply) == len(thought), tok.decode(reply)


def test_a_think_tag_after_a_space_is_no_leading_tag():
    """Old: a reply starting " <think>" (the tag not at its text's start, so split_reasoning keeps it as reasoning)
    had its first tokens taken for the tag when the tag began at a token's first character: counted 3, not 7."""
    from saguaro_dist.serve.reasoning import ReasoningTokens, split_reasoning
    tok = AutoTokenizer.from_pretrained(demo_pair()[0])
    reply = tok.encode(" <think> a b</think> z", add_special_tokens=False)
    reasoning, _ = split_reasoning(ReasoningParser.QWEN3, tok.decode(reply))
    assert reasoning == " <think> a b"
    assert ReasoningTokens.of(tok).count(ReasoningParser.QWEN3, reply) == len(tok.encode(reasoning, add_special_tokens=False)) == 7
