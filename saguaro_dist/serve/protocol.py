"""OpenAI request bodies as pydantic models: types and ranges are checked here, at the HTTP edge.

Every OpenAI and vLLM request field is declared, and each is honoured, accepted because it changes
nothing in the output (`user`, `metadata`, `store`, ...), or refused with a 400 naming it when given a
value we cannot honour (`Unsupported` below): a field that would change the output or its shape is
never silently dropped. Unknown fields are ignored, as vLLM does, so newer `openai` clients keep
working, and logged as vLLM logs them, with the known field a typo was probably meant as.
"""
from __future__ import annotations

import difflib
import enum
import json
import logging
import re
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from saguaro_dist.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan

log = logging.getLogger(__name__)
MAX_CHOICES = 64  # n; a request's prompts x n generations are capped at MAX_GENERATIONS too
MAX_GENERATIONS = 256

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
_SAMPLING_UNSUPPORTED = {
    "best_of": Unsupported((None, 1), "each choice is one sample; ask for more with n"),
    "suffix": Unsupported((None, ""), "there is no fill-in-the-middle"),
    "use_beam_search": Unsupported((False,), "there is no beam search"),
    "spaces_between_special_tokens": Unsupported((True,), "special tokens are decoded as the tokenizer joins them"),
    "prompt_logprobs": Unsupported((None,), "/v1/responses carries no prompt log-probabilities; /v1/completions and "
                                            "/v1/chat/completions return them"),
    "logits_processors": Unsupported((None, []), "no logits processors are installed"),
    "return_tokens_as_token_ids": Unsupported((None, False), "/v1/responses' log-probability tokens are text"),
    "cache_salt": Unsupported((None,), "the prefix cache is shared by every request"),
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
_GENERATION_HONOURS = frozenset({"prompt_logprobs", "return_tokens_as_token_ids", "request_id"})
_GENERATION_UNSUPPORTED = {name: rule for name, rule in _SAMPLING_UNSUPPORTED.items() if name not in _GENERATION_HONOURS}
# A request id (the X-Request-Id header's or the request_id field's): it names the response, its engine
# requests and their log lines
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class PromptEnd(str, enum.Enum):
    """How a chat prompt ends (vLLM's add_generation_prompt / continue_final_message)."""
    NEW_TURN = "new_turn"  # an assistant turn opened for the reply (the default)
    AS_IS = "as_is"        # the conversation's last turn closed, nothing opened
    CONTINUE = "continue"  # the last message left open: the reply continues it (an assistant prefill)


class ChatPromptFields(BaseModel):
    """vLLM's fields on how a rendered conversation ends (chat completions, /tokenize)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_end(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message continues the last message: set add_generation_prompt to false "
                             "with it (vLLM's rule)")
        return self

    def prompt_end(self) -> PromptEnd:
        if self.continue_final_message:
            return PromptEnd.CONTINUE
        return PromptEnd.NEW_TURN if self.add_generation_prompt else PromptEnd.AS_IS
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's max_tokens for a completions request without one
MAX_TOOLS = 128  # OpenAI's limit on functions a request may declare
# Chat request fields that are chat template variables: joined to chat_template_kwargs, read or refused there
TEMPLATE_VARIABLE_FIELDS = ("documents", "reasoning_effort")
REPLY_ROLE = "assistant"  # the role of every chat reply


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


def _with_suggestion(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class JsonSchema(BaseModel):
    name: str | None = None
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's: plain text, any JSON object, or JSON following a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (completions): score the prompt, generate nothing
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 disables, as in vLLM
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extra parameter (0: off)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # samples per prompt; with a seed, sample i draws from seed + i
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extra parameter: keep generating past end-of-sequence
    stop_token_ids: list[int] | None = None  # vLLM's extra parameter: ids that end generation like EOS
    min_tokens: int = Field(0, ge=0)  # vLLM's extra parameter: EOS / stop_token_ids held back until this many
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # vLLM's extra parameter (1: off)
    # OpenAI's: JSON keys are token ids as strings ({"50256": -100})
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)  # vLLM's extra parameter
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extra parameter
    guided_json: dict | str | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    include_stop_str_in_output: bool = False  # vLLM's extra parameters on the text and the prompt
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # the prompt's last N tokens; -1: the model's max length
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower is admitted first
    # Accepted, as they change nothing in the output: annotations, hints, and settings inert here
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored either way
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes itself
    safety_identifier: str | None = None
    prediction: dict | None = None  # OpenAI's predicted output: a speed hint; the reply is the same without it
    length_penalty: float = 1.0  # vLLM's: beam search's only (refused below)
    mm_processor_kwargs: dict | None = None  # vLLM's: no image or audio reaches the model (refused in messages)
    # Known, refused past their inert values (_SAMPLING_UNSUPPORTED says why)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    use_beam_search: bool = False
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's (completions and chat, unstreamed)
    bad_words: list[str] | None = None
    logits_processors: list | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    request_id: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    unsupported_fields: ClassVar[dict[str, Unsupported]] = _SAMPLING_UNSUPPORTED
    continuous_usage: ClassVar[bool] = False  # whether the route's stream honours stream_options.continuous_usage_stats

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return self

    @model_validator(mode="after")
    def _check_stream_options(self):
        """OpenAI's and vLLM's rule: stream_options only with stream (a usage chunk asked for and never sent)."""
        options = self.stream_options
        if options is not None and not self.stream and (options.model_fields_set or options.model_extra):
            raise ValueError("stream_options is only allowed with stream set to true")
        if options is not None and options.continuous_usage_stats and not self.continuous_usage:
            raise ValueError("stream_options with continuous_usage_stats is not supported on this route (its events "
                             "carry usage at the end)")
        return self

    @model_validator(mode="after")
    def _check_prompt_logprobs(self):
        """vLLM's rule: prompt log-probabilities come in the whole response, never in a stream (vLLM lets
        prompt_logprobs 0 through with stream and drops it; a field is never dropped here)."""
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream set to true")
        return self

    @field_validator("request_id")
    @classmethod
    def _check_request_id(cls, given: str | None) -> str | None:
        if given is not None and not REQUEST_ID_PATTERN.fullmatch(given):
            raise ValueError("request_id must be 1-128 letters, digits, '.', '_', ':' or '-'")
        return given

    @model_validator(mode="after")
    def _check_best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n ({self.n}), got {self.best_of}")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def default_max_tokens(self) -> int | None:
        """The route's max_tokens when the request leaves it out (None: the rest of the context)."""
        return None

    def prompt_tokens_kept(self, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens run (truncate_prompt_tokens; -1: max_model_len; None: all)."""
        return self.truncate_prompt_tokens

    def requested_structure(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint asked for: response_format, structured_outputs or guided_*."""
        guided = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar)) if v is not None}
        asked = [name for name, given in (("response_format", self.response_format and self.response_format.type != "text"),
                                          ("structured_outputs", self.structured_outputs), ("guided_*", guided)) if given]
        if len(asked) > 1:
            raise ValueError(f"structured_outputs can be asked for once (response_format, structured_outputs or guided_*), got {asked}")
        if self.structured_outputs is not None:
            return StructuredOutputsParams(**self.structured_outputs.model_dump(by_alias=True, exclude_none=True))
        if guided:
            return StructuredOutputsParams(**guided)
        if asked:  # response_format
            schema = self.response_format.json_schema
            return StructuredOutputsParams(json=schema.schema_) if schema else StructuredOutputsParams(json_object=True)
        return None

    def requested_logprobs(self) -> int | None:
        """Top log-probabilities per token (0: the chosen token's only), or None for none."""
        return None

    def tool_plan(self) -> ToolPlan:
        return ToolPlan(ToolChoiceKind.NONE)  # chat requests may declare tools

    def requested_prompt_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """The engine's settings; `defaults` (the model's generation config, LLM.generation_defaults) fill
        the sampling fields the request left out, as vLLM's do."""
        given = self._given_sampling(defaults or {})
        return SamplingParams(
            temperature=given["temperature"],
            top_p=given["top_p"],
            top_k=max(0, given["top_k"]),  # -1 (vLLM's off) is our 0
            min_p=given["min_p"],
            max_tokens=max_tokens,
            stop=self.stop or (),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given["repetition_penalty"],
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self.requested_structure(),
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words or None,  # (tokenized where the engine's LLM checks the request)
        )

    def _given_sampling(self, defaults: dict) -> dict:
        """Each generation-config field: the request's value, else the model's default, else the neutral one."""
        neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        return {name: getattr(self, name) if getattr(self, name) is not None else defaults.get(name, value)
                for name, value in neutral.items()}

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    # left out: OpenAI's and vLLM's 16 for completions (default_max_tokens; chat's is the rest of the context); null
    # asks for the rest here too
    max_tokens: int | None = Field(None, ge=0)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. added to a text prompt
    prompt_embeds: str | list[str] | None = None  # vLLM's: base64 tensors in place of a prompt
    unsupported_fields: ClassVar[dict[str, Unsupported]] = {
        **_GENERATION_UNSUPPORTED, "prompt_embeds": Unsupported((None,), "prompts are text or token ids")}
    continuous_usage: ClassVar[bool] = True
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # legacy completions: how many top tokens
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked): lm-eval's loglikelihood

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


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    """A call an earlier assistant turn made, sent back in the history."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """Chat templates (transformers' convention) read the arguments as a mapping, as vLLM passes them."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # a template may walk them (Qwen3-Coder's `arguments|items`)
            raise ValueError(f"tool call {self.function.name!r}: arguments must be JSON text of an object, "
                             f"got {self.function.arguments!r}")
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns
    tool_call_id: str | None = None                  # tool turns: the call this answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """Parts other than text (image_url, input_audio, file, ...) are refused by name, not as a failed union."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
            if kind != "text":
                raise ValueError(f"part {i} is {f'of type {kind!r}' if kind else 'not a typed part'}: this server "
                                 "reads text parts only "
                                 "({'type': 'text', 'text': ...})")
        return content

    @model_validator(mode="after")
    def _check_tool_fields(self):
        if self.content is None and self.role != "assistant":  # OpenAI's: only an assistant turn may lack it
            raise ValueError(f"a message with role {self.role!r} needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # one part a line, as vLLM joins them for string templates
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest, ChatPromptFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer OpenAI name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the chat template (Qwen3's enable_thinking)
    echo: bool = False  # vLLM's: the reply starts with the last message when that is the reply's role
    # Variables for the chat template, joined to chat_template_kwargs (a template that reads neither is a 400)
    documents: list[dict[str, str]] | None = None  # vLLM's: RAG documents, transformers' documents=
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # OpenAI's
    add_special_tokens: bool = False  # vLLM's: BOS etc. added on top of what the chat template writes
    chat_template: str | None = None  # vLLM's per-request template
    # vLLM's: false leaves the reasoning out of the reply (no `reasoning` field or delta; the model still
    # reasons), and a constrained reply is held to its constraint from the first token (vLLM's reasoning_ended)
    include_reasoning: bool = True
    unsupported_fields: ClassVar[dict[str, Unsupported]] = {
        **_GENERATION_UNSUPPORTED,
        "chat_template": Unsupported((None,), "the server's --chat-template or the tokenizer's applies, as vLLM "
                                              "without --trust-request-chat-template")}
    continuous_usage: ClassVar[bool] = True

    @model_validator(mode="after")
    def _join_template_variables(self):
        """documents and reasoning_effort reach the template as chat_template_kwargs do (vLLM passes them so)."""
        given = {name: getattr(self, name) for name in TEMPLATE_VARIABLE_FIELDS if getattr(self, name) is not None}
        twice = sorted(given.keys() & (self.chat_template_kwargs or {}).keys())
        if twice:
            raise ValueError(f"{twice[0]} is given twice: as a field and in chat_template_kwargs")
        if given:
            self.chat_template_kwargs = {**(self.chat_template_kwargs or {}), **given}
        return self

    @model_validator(mode="after")
    def _check_tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice {_choice_name(choice)!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
        return self

    def tool_plan(self) -> ToolPlan:
        """What the tools ask for; a request without tools gets a plain-text plan."""
        if not self.tools:
            return ToolPlan(ToolChoiceKind.NONE)
        functions = tuple(t.function.model_dump(exclude_none=True) for t in self.tools)
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            return ToolPlan(ToolChoiceKind.NAMED, functions, choice.function.name)
        return ToolPlan(ToolChoiceKind(choice), functions, parallel=self.parallel_tool_calls)

    def requested_structure(self) -> StructuredOutputsParams | None:
        asked = super().requested_structure()
        forced = self.tool_plan().structure()
        if asked is not None and forced is not None:
            raise ValueError(f"tool_choice {_choice_name(self.tool_choice)!r} constrains the reply itself; it cannot "
                             "be combined with response_format or structured outputs")
        return forced or asked

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be >= 1")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def echoed(self) -> str:
        """What `echo` puts before the reply's content: the last message's text when it is the reply's role
        (an assistant prefill, continued with continue_final_message), else nothing (vLLM's rule)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == REPLY_ROLE else ""

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_prompt_logprobs(self) -> int | None:
        """vLLM's: prompt_logprobs, else echo's (top_logprobs of each prompt token, in the whole response only:
        vLLM scores a streamed echo's prompt too, and sends nothing of it)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return (self.top_logprobs or 0) if self.echo and not self.stream else None


def _choice_name(choice) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice


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
