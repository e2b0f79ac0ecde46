"""The field tables of the OpenAI request models, and the base model that reads them.

Every declared field is honoured, accepted because it changes nothing in the output, or refused with a
400 naming it when given a value we cannot honour (`Unsupported`): a field that would change the output
or its shape is never silently dropped. Unknown fields are ignored, as vLLM does, so newer `openai`
clients keep working, and logged as vLLM logs them, with the known field a typo was probably meant as.
"""
from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Annotated, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationInfo, field_validator, model_validator

from saguaro_dist.serve.errors import APIError

# The unknown-field warnings have always gone to protocol's logger: users and tests filter on its name
log = logging.getLogger("saguaro_dist.serve.protocol")

# Extra (undeclared) field -> the only values we support; completions' and chat's echo is a field, so
# never extra there: this refuses it on /v1/responses.
_UNSUPPORTED_UNLESS = {"echo": (None, False)}


@dataclass(frozen=True)
class Unsupported:
    """A declared field we cannot honour past its inert values (those that ask for nothing we lack): any
    other value is a 400 naming the field and saying why."""
    inert: tuple
    why: str


# Fields of both generation routes (and /v1/responses, which shares the sampling fields).
SAMPLING_UNSUPPORTED = {
    "best_of": Unsupported((None, 1), "each choice is one sample; ask for more with n"),
    "suffix": Unsupported((None, ""), "there is no fill-in-the-middle"),
    "use_beam_search": Unsupported((False,), "/v1/responses runs no beam search (/v1/completions and "
                                             "/v1/chat/completions do)"),
    "spaces_between_special_tokens": Unsupported((True,), "special tokens are decoded as the tokenizer joins them"),
    "prompt_logprobs": Unsupported((None,), "/v1/responses carries no prompt log-probabilities; /v1/completions and "
                                            "/v1/chat/completions return them"),
    "logits_processors": Unsupported((None, []), "no logits processors are installed"),
    "return_tokens_as_token_ids": Unsupported((None, False), "/v1/responses' log-probability tokens are text"),
    "return_token_ids": Unsupported((None, False), "/v1/responses carries no token ids; /v1/completions and "
                                                   "/v1/chat/completions return them"),
    "truncation_side": Unsupported((None, "left"), "/v1/responses keeps a truncated input's last tokens; "
                                                   "/v1/completions truncates from either side"),
    "kv_transfer_params": Unsupported((None, {}), "there is no disaggregated prefill"),
    "vllm_xargs": Unsupported((None, {}), "no extension reads them"),
    "request_id": Unsupported((None,), "on /v1/responses give the id as the X-Request-Id header"),
    "guided_decoding_backend": Unsupported((None, "auto", "guidance", "llguidance"),
                                           "structured outputs run on llguidance"),
    "guided_whitespace_pattern": Unsupported((None,), "JSON whitespace is set by the schema's x-guidance options"),
    "structural_tag": Unsupported((None,), "there are no structural tags"),
    "audio": Unsupported((None,), "replies are text only"),
    "modalities": Unsupported((None, ["text"]), "replies are text only"),
    "web_search_options": Unsupported((None,), "there is no web search"),
    "functions": Unsupported((None, []), "use tools"),
    "function_call": Unsupported((None, "none"), "use tools and tool_choice"),
    "service_tier": Unsupported((None, "auto", "default"), "every request is served in one tier"),
    "verbosity": Unsupported((None, "medium"), "the model's replies are as long as it makes them"),
}
# Honoured by /v1/completions and /v1/chat/completions (vLLM's), still refused on /v1/responses
_GENERATION_HONOURS = frozenset({"prompt_logprobs", "return_tokens_as_token_ids", "return_token_ids", "request_id",
                                 "use_beam_search", "truncation_side"})
GENERATION_UNSUPPORTED = {name: rule for name, rule in SAMPLING_UNSUPPORTED.items() if name not in _GENERATION_HONOURS}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")
    unsupported_fields: ClassVar[dict[str, Unsupported]] = {}  # declared fields refused past their inert values

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, rule in self.unsupported_fields.items():
            value = getattr(self, name)
            if value not in rule.inert:
                raise ValueError(f"{name} is not supported by this server ({rule.why}), got {value!r}")
        return self

    @model_validator(mode="after")
    def _log_unknown(self):
        """vLLM's warning: a typo (max_token) is otherwise lost without a word."""
        unknown = sorted(set(self.model_extra or ()) - set(_UNSUPPORTED_UNLESS))
        if unknown:
            named = ", ".join(_with_suggestion(name, type(self).model_fields) for name in unknown)
            log.warning("%s: the following fields were present in the request but ignored: %s", type(self).__name__, named)
        return self

    def reject_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, allowed in _UNSUPPORTED_UNLESS.items():
            if name in extra and extra[name] not in allowed:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)


def tagged_union(members: dict, tag_of, expected: str):
    """A union whose member is picked by tag_of(value) (None: the value is none of them, "{loc}: must be
    {expected}"): pydantic then reports only that member's errors, where a plain union's first error was another
    member's ("messages.0.content: Input should be a valid string" for a bad part). errors.py leaves the tags out
    of the error's field path: a tag that is also a key of the body would be taken for a step into it."""
    return Annotated[Union[tuple(Annotated[kind, Tag(tag)] for tag, kind in members.items())],
                     Discriminator(tag_of, custom_error_type="invalid_type", custom_error_message=f"must be {expected}")]


def null_means_default(*names: str):
    """A before-validator for `names`: an explicit JSON null is the field's default. OpenAI allows null on
    these, vLLM reads it so, and the openai SDK sends it for an argument given as None. Each model needs
    its own attribute name for it (a subclass's same name would replace its base's)."""
    def default_for_null(cls, given, info: ValidationInfo):
        return cls.model_fields[info.field_name].get_default(call_default_factory=True) if given is None else given
    return field_validator(*names, mode="before")(classmethod(default_for_null))


def _with_suggestion(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
