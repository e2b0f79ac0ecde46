"""Turning request prompts and chat messages into token ids, the same way `LLM.generate` does."""
from __future__ import annotations

import json

from saguaro_dist.serve.protocol import ChatMessage, Tool
from saguaro_dist.serve.tool_parsers import HERMES_CLOSE, HERMES_OPEN


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    # `tokenizer.encode(text)` is what LLM.generate uses, so HTTP and in-process outputs agree.
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


# Arguments we pass apply_chat_template ourselves: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt", "chat_template",
                                      "return_dict", "return_tensors", "continue_final_message", "documents"})


def render_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None = None,
                template_kwargs: dict | None = None) -> tuple[str, bool]:
    """The prompt text for `messages` (and the tools the model may call) and whether it already carries
    the special tokens.

    The tokenizer's own chat template when it has one (tools go to it as transformers' `tools=`);
    otherwise a plain "Role: text" transcript ending with "Assistant:", so base models without a
    template can still be chatted with (tools as a JSON line first, earlier calls in hermes tags).
    template_kwargs: extra variables for the template (Qwen3's enable_thinking), unused by the transcript.
    """
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {clash}")
    turns = [m.for_template() for m in messages]
    tools = [t.model_dump(exclude_none=True) for t in tools or []]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(turns, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
        return text, True
    lines = [f"Tools: {json.dumps(tools)}"] if tools else []
    lines += [f"{turn['role'].capitalize()}: {_plain_content(turn)}" for turn in turns]
    return "\n".join(lines + ["Assistant:"]), False


def _plain_content(turn: dict) -> str:
    calls = [f"{HERMES_OPEN}{json.dumps(c['function'])}{HERMES_CLOSE}" for c in turn.get("tool_calls", ())]
    return "".join([turn["content"], *calls])


def encode_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    text, templated = render_chat(tokenizer, messages, tools, template_kwargs)
    # A chat template writes BOS etc. itself; adding them again would double them (as vLLM avoids).
    return encode_text(tokenizer, text, add_special_tokens=not templated)
