"""The fields /v1/completions, /v1/chat/completions and /v1/responses share: sampling, stop, structured
outputs, streaming, and their checks; `SamplingRequest.sampling_params` turns them into the engine's."""
from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from saguaro_dist.engine.sequence import check_cache_salt
from saguaro_dist.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutputsParams,
                                          truncate_prompt)
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.request_fields import SAMPLING_UNSUPPORTED, OpenAIModel, Unsupported, null_means_default
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan

MAX_CHOICES = 64  # n; a request's prompts x n generations are capped at MAX_GENERATIONS too
MAX_GENERATIONS = 256
# A request id (the X-Request-Id header's or the request_id field's): it names the response, its engine
# requests and their log lines
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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
    """vLLM's structured_outputs: exactly one of json .. grammar, and vLLM's options (StructuredOutputsParams
    accepts disable_any_whitespace either way, the others at their inert values only)."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (completions): score the prompt, generate nothing
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 disables, as in vLLM
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extra parameter (0: off)
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)  # samples per prompt; with a seed, sample i draws from seed + i
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False  # (n and stream: null is the default, _null_n_stream)
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
    # vLLM's (completions): which end truncate_prompt_tokens cuts; "right" keeps the first N (left, the default: last)
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower is admitted first
    cache_salt: str | None = None  # vLLM's: prefix-cache KV is shared only with requests of the same salt
    # Accepted, as they change nothing in the output: annotations, hints, and settings inert here
    metadata: dict[str, str] | None = None
    store: bool | None = None  # nothing is stored either way
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes itself
    safety_identifier: str | None = None
    prediction: dict | None = None  # OpenAI's predicted output: a speed hint; the reply is the same without it
    length_penalty: float = 1.0  # vLLM's: beam search's only (use_beam_search; else it changes nothing)
    mm_processor_kwargs: dict | None = None  # vLLM's: no image or audio reaches the model (refused in messages)
    # Known, refused past their inert values (SAMPLING_UNSUPPORTED says why)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    use_beam_search: bool = False  # vLLM's: n beams (serve/beam_route.py); refused on /v1/responses
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's (completions and chat, unstreamed)
    bad_words: list[str] | None = None
    logits_processors: list | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the reply's token ids beside the text
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
    unsupported_fields: ClassVar[dict[str, Unsupported]] = SAMPLING_UNSUPPORTED
    continuous_usage: ClassVar[bool] = False  # whether the route's stream honours stream_options.continuous_usage_stats
    _null_n_stream = null_means_default("n", "stream")

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

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _check_cache_salt(cls, given: object) -> str | None:
        return check_cache_salt(given)  # vLLM's rule: a ValueError, so a 400 naming the field

    @model_validator(mode="after")
    def _check_best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n ({self.n}), got {self.best_of}")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The field the reply's length is asked in, as a 400 about it names it: /v1/responses' own, chat's
        newer name when given."""
        if "max_output_tokens" in type(self).model_fields:
            return "max_output_tokens"
        return "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"

    def default_max_tokens(self) -> int | None:
        """The route's max_tokens when the request leaves it out (None: the rest of the context)."""
        return None

    def prompt_tokens_kept(self, max_model_len: int) -> int | None:
        """How many of the prompt's tokens run (truncate_prompt_tokens; None: all). vLLM's rule: at most the
        room the reply leaves, max_model_len - max_tokens (left out: the route's default; null: 0), which -1
        asks for; more is a 400 naming the field, not a silent no-op."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return None
        reply = self.requested_max_tokens()
        reply = (self.default_max_tokens() if reply is None else reply) or 0
        room, field = max_model_len - reply, self.max_tokens_field()
        if reply > max_model_len:  # vLLM checks this first: the reply alone cannot fit, whatever the truncation
            raise APIError(400, f"{field}={reply} cannot be greater than max_model_len={max_model_len}. "
                                "Please request fewer output tokens.", param=field)
        if keep == -1:
            return max(1, room)  # (no room: state.job's context-length 400)
        if keep > room:
            raise APIError(400, f"truncate_prompt_tokens={keep} cannot be greater than max_model_len - {field} = "
                                f"{max_model_len} - {reply} = {room}. Please request a smaller truncation size.",
                           param="truncate_prompt_tokens")
        return keep

    def kept_prompt(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as it runs: truncated to prompt_tokens_kept from the left (its last tokens), or with
        truncation_side "right" from the right (its first tokens), as vLLM truncates."""
        keep = self.prompt_tokens_kept(max_model_len)
        if keep is not None and self.truncation_side == "right":
            return prompt_ids[:max_model_len if keep == -1 else keep]
        return truncate_prompt(prompt_ids, keep, max_model_len)

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
        self._check_min_tokens(max_tokens)
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

    def _check_min_tokens(self, max_tokens: int) -> None:
        """min_tokens within the client's max_tokens (vLLM's rule), else the engine's (the route's default, said
        as such), the 400 naming the route's length field: a scores-only echo asks 0 while the engine decides 1."""
        field, asked = self.max_tokens_field(), self.requested_max_tokens()
        if self.min_tokens <= (max_tokens if asked is None else asked):
            return
        limit = f"{field} ({asked})" if asked is not None else f"the reply's length ({field} left out: {max_tokens})"
        raise APIError(400, f"min_tokens must be at most {limit}, got {self.min_tokens}", param="min_tokens")

    def _given_sampling(self, defaults: dict) -> dict:
        """Each generation-config field: the request's value, else the model's default, else the neutral one."""
        neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        return {name: getattr(self, name) if getattr(self, name) is not None else defaults.get(name, value)
                for name, value in neutral.items()}

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
