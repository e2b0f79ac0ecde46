"""OpenAI request bodies as pydantic models: types and ranges are checked here, at the HTTP edge.

Every OpenAI and vLLM request field is declared, and each is honoured, accepted because it changes
nothing in the output (`user`, `metadata`, `store`, ...), or refused with a 400 naming it when given a
value we cannot honour (`Unsupported`, request_fields.py): a field that would change the output or its
shape is never silently dropped. Unknown fields are ignored, as vLLM does, so newer `openai` clients
keep working, and logged as vLLM logs them, with the known field a typo was probably meant as.

Here: the completions and tokenize requests. The shared sampling fields are in sampling_request.py, chat's
request in chat_request.py; their names are re-exported, as the routes and the engine import them from here.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from saguaro_dist.sampling_params import MAX_LOGPROBS
from saguaro_dist.serve.chat_request import (MAX_TOOLS, REPLY_ROLE, TEMPLATE_VARIABLE_FIELDS, ChatCompletionRequest,
                                             ChatMessage, ChatPromptFields, FunctionCall, FunctionDefinition,
                                             NamedFunction, NamedToolChoice, PromptEnd, TextPart, Tool, ToolCallMessage)
from saguaro_dist.serve.chat_content import ContentPart, RefusalPart, ThinkingPart  # TextPart took these types once
from saguaro_dist.serve.request_fields import (GENERATION_UNSUPPORTED, OpenAIModel, Unsupported, null_means_default,
                                              tagged_union)
from saguaro_dist.serve.sampling_request import (MAX_CHOICES, MAX_GENERATIONS, REQUEST_ID_PATTERN, JsonSchema,
                                                 ResponseFormat, SamplingRequest, StreamOptions, StructuredOutputs)

__all__ = ["DEFAULT_COMPLETION_TOKENS", "MAX_CHOICES", "MAX_GENERATIONS", "MAX_TOOLS", "REPLY_ROLE",
           "REQUEST_ID_PATTERN", "TEMPLATE_VARIABLE_FIELDS", "ChatCompletionRequest", "ChatMessage",
           "ChatPromptFields", "CompletionRequest", "DetokenizeRequest", "FunctionCall", "FunctionDefinition",
           "ContentPart", "JsonSchema", "NamedFunction", "NamedToolChoice", "OpenAIModel", "PromptEnd", "RefusalPart", "ResponseFormat",
           "SamplingRequest", "StreamOptions", "StructuredOutputs", "TextPart", "ThinkingPart", "TokenizeRequest", "Tool",
           "ToolCallMessage", "Unsupported"]

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's max_tokens for a completions request without one


def _prompt_form(value) -> str | None:
    """The prompt form a client meant, by JSON kind: a list's first item that is neither a string nor null says
    token ids (a number) or lists of them (a list); else texts. Lists lax pydantic read as token ids (["1", 2])
    still are."""
    if isinstance(value, str):
        return "prompt:text"
    if not isinstance(value, list):
        return None
    first = next((item for item in value if not isinstance(item, str) and item is not None), None)
    return "prompt:texts" if first is None else "prompt:id_lists" if isinstance(first, list) else "prompt:ids"


# Picked by _prompt_form, so a bad prompt's 400 is its own form's ("prompt.0: Input should be a valid integer"),
# where a plain union reported its first member's ("prompt: Input should be a valid string")
Prompt = tagged_union({"prompt:text": str, "prompt:ids": list[int], "prompt:texts": list[str],
                       "prompt:id_lists": list[list[int]]}, _prompt_form,
                      "a string, a list of token ids, or a list of either")


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    # left out: OpenAI's and vLLM's 16 for completions (default_max_tokens; chat's is the rest of the context); null
    # asks for the rest here too
    max_tokens: int | None = Field(None, ge=0)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. added to a text prompt
    prompt_embeds: str | list[str] | None = None  # vLLM's: base64 tensors in place of a prompt
    unsupported_fields: ClassVar[dict[str, Unsupported]] = {
        **GENERATION_UNSUPPORTED, "prompt_embeds": Unsupported((None,), "prompts are text or token ids")}
    continuous_usage: ClassVar[bool] = True
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # legacy completions: how many top tokens
    echo: bool | None = False  # (null: false) the prompt comes back before the completion (with its logprobs, if asked): lm-eval's loglikelihood
    _null_echo = null_means_default("echo")

    @model_validator(mode="after")
    def _check_echo(self):
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo, to score the prompt alone)")
        return self

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def default_max_tokens(self) -> int | None:
        """Left out: OpenAI's and vLLM's 16 (a generation config's max_new_tokens if less; null: the rest)."""
        return None if "max_tokens" in self.model_fields_set else DEFAULT_COMPLETION_TOKENS

    def requested_prompt_logprobs(self) -> int | None:
        """vLLM's: prompt_logprobs, else echo's (the prompt's tokens scored as logprobs asks)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @model_validator(mode="after")
    def _check_prompt(self):
        if self.prompt == "" or self.prompt == [] or any(p == "" or p == [] for p in self.prompts()):
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class TokenizeRequest(OpenAIModel, ChatPromptFields):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # rendered with messages, as chat does
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages (as chat's)
    chat_template: str | None = None
    return_token_strs: bool | None = None  # vLLM's: each token's text beside its id
    mm_processor_kwargs: dict | None = None  # accepted: no image or audio reaches the model
    unsupported_fields: ClassVar[dict[str, Unsupported]] = {
        "chat_template": ChatCompletionRequest.unsupported_fields["chat_template"],
        "return_token_strs": Unsupported((None, False), "/tokenize returns the ids and their count")}

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self

    def special_tokens(self) -> bool:
        """Whether the tokenizer's special tokens (BOS) are added: as /v1/completions and chat would add them."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]
