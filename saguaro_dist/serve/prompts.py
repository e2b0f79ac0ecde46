"""Turning request prompts and chat messages into token ids, the same way `LLM.generate` does."""
from __future__ import annotations

from saguaro_dist.serve.protocol import ChatMessage


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    # `tokenizer.encode(text)` is what LLM.generate uses, so HTTP and in-process outputs agree.
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(tokenizer, messages: list[ChatMessage]) -> tuple[str, bool]:
    """The prompt text for `messages` and whether it already carries the special tokens.

    The tokenizer's own chat template when it has one; otherwise a plain "Role: text" transcript
    ending with "Assistant:", so base models without a template can still be chatted with.
    """
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        return text, True
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in plain]
    return "\n".join(lines + ["Assistant:"]), False


def encode_chat(tokenizer, messages: list[ChatMessage]) -> list[int]:
    text, templated = render_chat(tokenizer, messages)
    # A chat template writes BOS etc. itself; adding them again would double them (as vLLM avoids).
    return encode_text(tokenizer, text, add_special_tokens=not templated)
