"""Chat messages into prompts, checked against transformers' apply_chat_template and vLLM's chat_utils: a
tokenizer's named templates, templates that read content as parts, calls sent without an id, and
--chat-template with transformers' own tags."""
from __future__ import annotations

import pytest

from saguaro_dist.serve import prompts
from saguaro_dist.serve.prompts import encode_chat, load_chat_template, render_chat
from saguaro_dist.serve.protocol import ChatMessage, Tool
from test_serve_fixtures import make_tokenizer

HI = [ChatMessage(role="user", content="hello world")]
TOOLS = [Tool(type="function", function={"name": "f", "parameters": {"type": "object"}})]
# loops over a message's content (vLLM's "openai" content format), as Gemma 3's and Llama 4's do
PARTS = "{% for m in messages %}{{ m.role }}:{% for p in m.content %}[{{ p.text }}]{% endfor %}\n{% endfor %}"
CALL_IDS = "{% for m in messages %}{% for c in m.tool_calls or [] %}<{{ c.id }}:{{ c.function.arguments.a }}>" \
           "{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_named_templates_render_the_one_transformers_picks():
    """Hermes' and Command-R's tokenizers ship {"default": ..., "tool_use": ...}: every chat was a 400
    (apply_chat_template was handed the dict: "unhashable type: 'dict'")."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = {"default": "D{% for m in messages %}{{ m.content }}{% endfor %}",
                               "tool_use": "T{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"}
    assert render_chat(tokenizer, HI) == ("Dhello world", True)
    assert render_chat(tokenizer, HI, TOOLS) == ("T1hello world", True)
    assert render_chat(tokenizer, HI)[0] == tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}],
                                                                          tokenize=False)
    ids = encode_chat(tokenizer, HI, chat_template="{{ messages[0].content }}")  # the server's still comes first
    assert ids == tokenizer.encode("hello world", add_special_tokens=False)


def test_a_template_looping_over_content_gets_text_parts(tokenizer):
    """Such a template got the parts joined into a string and walked its characters: `p.text` was undefined
    and the user's text vanished from the prompt without a word."""
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}])
    text = render_chat(tokenizer, [parts, ChatMessage(role="assistant", content="the cat")], chat_template=PARTS)[0]
    assert text == "user:[hello][world]assistant:[the cat]"  # (trim_blocks eats the newlines)
    as_vllm_passes = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "the cat"}]}]
    assert text == tokenizer.apply_chat_template(as_vllm_passes, chat_template=PARTS, tokenize=False)


def test_content_format_is_detected_as_vllm_does():
    content_as_parts = prompts.content_as_parts
    gemma_like = ("{%- set loop_messages = messages[1:] -%}{%- for message in loop_messages -%}"
                  "{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- else -%}"
                  "{%- for item in message['content'] -%}{{ item['text'] | trim }}{%- endfor -%}{%- endif -%}{%- endfor -%}")
    llama4_like = "{% for message in messages %}{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}" \
                  "{{ c['text'] }}{% endfor %}{% endfor %}"
    assert content_as_parts(gemma_like) and content_as_parts(llama4_like) and content_as_parts(PARTS)
    string_like = "{% for message in messages %}{% if message.content is string %}{{ message.content }}{% endif %}" \
                  "{% for c in message.tool_calls or [] %}{{ c.id }}{% endfor %}{% endfor %}"
    assert not content_as_parts(string_like) and not content_as_parts(None)


def test_string_templates_and_tool_turns_keep_string_content(tokenizer):
    """vLLM's rule: parts joined with newlines for string templates, and a tool turn's always."""
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    joined = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    assert render_chat(tokenizer, [ChatMessage(role="user", content=parts)], chat_template=joined)[0] == "hello\nworld|"
    tool = ChatMessage(role="tool", content=parts, tool_call_id="c1")
    assert tool.for_template(parts=True)["content"] == "hello\nworld"
    assert ChatMessage(role="assistant", content=None).for_template(parts=True)["content"] == []


def test_a_call_sent_without_an_id_has_none_in_the_template(tokenizer):
    """It reached the template as id None, which a template writing ids rendered as "None"."""
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": "cat"}'}}
    messages = [ChatMessage(role="user", content="hello"), ChatMessage(role="assistant", tool_calls=[call])]
    text = render_chat(tokenizer, messages, chat_template=CALL_IDS)[0]
    as_sent = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "",
                                                      "tool_calls": [{**call, "function": {"name": "f", "arguments": {"a": "cat"}}}]}]
    assert text == "<:cat>" == tokenizer.apply_chat_template(as_sent, chat_template=CALL_IDS, tokenize=False)
    with_id = [messages[0], ChatMessage(role="assistant", tool_calls=[{**call, "id": "c1"}])]
    assert render_chat(tokenizer, with_id, chat_template=CALL_IDS)[0] == "<c1:cat>"


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.content }}{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"])
def test_chat_template_with_transformers_tags_loads(tokenizer, template):
    """{% break %} and {% generation %} (SmolLM3's) render in transformers' environment: --chat-template refused
    them at start-up as not compiling."""
    assert load_chat_template(template) == template
    messages = [ChatMessage(role="user", content="hello"), ChatMessage(role="assistant", content="world")]
    as_sent = [m.model_dump(include={"role", "content"}) for m in messages]
    assert render_chat(tokenizer, messages, chat_template=template)[0] == \
        tokenizer.apply_chat_template(as_sent, chat_template=template, tokenize=False)
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}{% generation %}{{ m.content }}{% endfor %}")
