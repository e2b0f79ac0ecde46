"""OpenAI's Responses API (`POST /v1/responses`), the subset vLLM serves: `input` (a string, or message,
function_call and function_call_output items) after `instructions`, sampling fields, `max_output_tokens`,
`text.format` (structured outputs), function `tools` / `tool_choice`, `stream`, `top_logprobs` with
`include: ["message.output_text.logprobs"]`, `reasoning.effort` (to the chat template, as chat's
reasoning_effort); the reply as a `reasoning` item (with a reasoning parser), a `message` item and
`function_call` items.

The request becomes a chat conversation and runs exactly as chat does (the same tool plans and
parsers). As on chat (request_fields.py), every field is honoured, accepted because it changes nothing, or a
400 naming it. Nothing is stored: `previous_response_id`, `background`, `conversation` and stored prompts
are refused, as are built-in tools (only functions run here).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from saguaro_dist.sampling_params import MAX_LOGPROBS, StructuredOutputsParams
from saguaro_dist.serve.allowed_tools import ResponsesAllowedToolsChoice, allowed_plan, check_named, choice_tag
from saguaro_dist.serve.chat_request import (MAX_TOOLS, ChatCompletionRequest, ChatMessage, FunctionCall,
                                             FunctionDefinition, Tool, ToolCallMessage)
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.openai_responses_output import (ResponseEvents, function_call_item, message_item, new_item_id,
                                                        output_items, reasoning_item, response_body, text_part, usage)
from saguaro_dist.serve.request_fields import OpenAIModel, Unsupported, null_means_default, tagged_union
from saguaro_dist.serve.sampling_request import SamplingRequest, StreamOptions
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan

# The reply's builders (openai_responses_output.py) are re-exported: the routes import them from here
__all__ = ["LOGPROBS_INCLUDE", "FunctionCallItem", "FunctionCallOutputItem", "FunctionChoice", "FunctionTool", "InputMessage",
           "InputPart", "Reasoning", "ReasoningEffort", "ReasoningInputItem", "ResponseEvents", "ResponsesRequest",
           "ResponsesStreamOptions", "TextFormat", "TextOptions", "function_call_item", "message_item", "new_item_id",
           "output_items", "reasoning_item", "refuse_past_inert", "response_body", "text_part", "usage"]

# Responses' own fields (and vLLM's on this route) refused past their inert values: checked after validation,
# as an APIError, so the 400's param names the field (errors._param_of knows chat's and completions' fields only)
_RESPONSES_UNSUPPORTED = {
    "previous_response_id": Unsupported((None,), "this server stores no responses; send the earlier output back "
                                                 "as input items"),
    "background": Unsupported((None, False), "this server runs no background responses"),
    "conversation": Unsupported((None,), "this server stores no conversations"),
    "prompt": Unsupported((None,), "this server stores no prompt templates"),
    "enable_response_messages": Unsupported((False,), "the response carries output items only"),
    "previous_input_messages": Unsupported((None, []), "give the conversation as input items"),
}
# Chat's spellings, not Responses fields: a 400 naming the Responses one (they were logged and dropped)
_CHAT_SPELLINGS = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                   "logprobs": "include: ['message.output_text.logprobs'] (with top_logprobs)",
                   "reasoning_effort": "reasoning.effort", "documents": "chat_template_kwargs.documents"}
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")  # the input items read here
_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_MESSAGE_PARTS = (*_TEXT_PARTS, "refusal")  # a message's: an earlier output's refusal is read as its text (chat's)
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # log-probabilities on the message's output_text
# OpenAI's other `include` values name outputs this server never makes (built-in tools, images, encrypted
# reasoning): accepted and empty, since clients send them by default (agents ask for encrypted reasoning).
_INCLUDE_EMPTY = {"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                  "web_search_call.action.sources", "message.input_image.image_url",
                  "computer_call_output.output.image_url", "code_interpreter_call.outputs"}


def _text_or_list(item, expected: str):
    """A string or a list of `item`, told apart by JSON type (a bad part's error is the part's, not "should be
    a valid string")."""
    return tagged_union({"text": str, "list": list[item]}, lambda v: "text" if isinstance(v, str) else
                        "list" if isinstance(v, list) else None, expected)


class InputPart(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


def _part_type(part):
    return part.get("type") if isinstance(part, dict) else getattr(part, "type", None)


class RefusalPart(BaseModel):
    """OpenAI's output message part for a refusal, sent back with an earlier output: read as its text, as chat
    reads one (chat_content.RefusalPart)."""
    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


TextOrParts = _text_or_list(InputPart, "a string or a list of text parts")
# By type (tags no body key, as errors.py's field path needs): _known_items let text and refusal parts through
MessagePart = tagged_union({"part:text": InputPart, "part:refusal": RefusalPart},
                           lambda v: "part:refusal" if _part_type(v) == "refusal" else "part:text", "a text part")
MessageContent = _text_or_list(MessagePart, "a string or a list of text parts")


def joined(content: str | list[InputPart | RefusalPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)  # as chat's parts


class InputMessage(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: MessageContent
    id: str | None = None      # items echoed back from an earlier response carry these
    status: str | None = None

    @field_validator("content")
    @classmethod
    def _refusals_are_outputs(cls, content, info: ValidationInfo):
        """A refusal part is an assistant's output (OpenAI's output message), sent back as one: OpenAI refuses
        it in a user, system or developer message, which would otherwise become that turn's text here."""
        role = info.data.get("role")
        for j, part in enumerate(content if role != "assistant" and isinstance(content, list) else ()):
            if isinstance(part, RefusalPart):
                raise ValueError(f"part {j} is a refusal, which only an assistant message holds (an earlier "
                                 f"output's); a {role} message reads text parts ({', '.join(_TEXT_PARTS)})")
        return content

    def chat_message(self) -> ChatMessage:
        return ChatMessage(role=self.role, content=joined(self.content))


class FunctionCallItem(BaseModel):
    """A call an earlier response made, sent back in the input."""
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)  # (an empty one: a 400 naming it, not the chat turn it becomes)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    def chat_call(self) -> ToolCallMessage:
        return ToolCallMessage(id=self.call_id, function=FunctionCall(name=self.name, arguments=self.arguments))


class ReasoningText(BaseModel):
    type: Literal["reasoning_text", "summary_text"] = "reasoning_text"
    text: str


class ReasoningInputItem(BaseModel):
    """A reasoning item of an earlier response, sent back with its output: its text (the content's, else the
    summary's) is the reasoning of the assistant turn it opens, which the chat template may show (gpt-oss's
    does for a turn with calls). Encrypted reasoning (none is made here) is ignored."""
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "\n".join(part.text for part in self.content or self.summary or [])


class FunctionCallOutputItem(BaseModel):
    """What the caller's function returned for a call."""
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: TextOrParts  # OpenAI's: a string or parts (input_text; images and files are refused by name)
    id: str | None = None
    status: str | None = None


class FunctionTool(BaseModel):
    """Responses' function tool: chat's definition, flat. Built-in tools (web search, ...) fail validation."""
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def chat_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(**self.model_dump(exclude={"type"})))


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


ToolChoice = tagged_union({"mode": Literal["none", "auto", "required"], "function": FunctionChoice,  # built-in tools': none
                           "allowed_tools": ResponsesAllowedToolsChoice}, choice_tag, "'none', 'auto', 'required', "
                          "{\"type\": \"function\", \"name\": ...} or {\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}")


# By its type, which a message may leave out (OpenAI's EasyInputMessage)
InputItem = tagged_union({"message": InputMessage, "function_call": FunctionCallItem,
                          "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningInputItem},
                         lambda v: v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None),
                         "an input item (an object)")
Input = _text_or_list(InputItem, "a string or a list of input items")


def refuse_past_inert(value, rule: Unsupported):
    """A nested field's check (its 400 names it, text.verbosity): the value, if one of the rule's inert ones."""
    if value not in rule.inert:
        raise ValueError(f"{value!r} is not supported by this server ({rule.why})")
    return value


class TextFormat(BaseModel):
    """Responses' text.format: OpenAI's response_format with the schema fields inline."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, validate_default=True)  # json_schema's: required (_named_schema)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None  # accepted, as chat's json_schema.description
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _named_schema(cls, name, info: ValidationInfo):
        """OpenAI requires a json_schema format's name (vLLM's ResponseTextConfig, the openai type, too): the
        reply echoes the format, and the openai SDK's Response fails to validate one without it. A "missing"
        error, so the 400's param is text.format.name (errors._field_path keeps a missing field's step)."""
        if name is None and info.data.get("type") == "json_schema":
            raise PydanticCustomError("missing", "Field required (a json_schema format needs a name)")
        return name


class TextOptions(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # OpenAI's; refused past medium, as chat's verbosity

    @field_validator("verbosity")
    @classmethod
    def _inert_verbosity(cls, value):
        return refuse_past_inert(value, SamplingRequest.unsupported_fields["verbosity"])


_SUMMARY = Unsupported((None, "auto"), "no reasoning summary is written; the reasoning item carries the reasoning "
                                       "itself (auto: none here)")


ReasoningEffort = ChatCompletionRequest.model_fields["reasoning_effort"].annotation  # chat's values, or None


class Reasoning(OpenAIModel):
    """OpenAI's reasoning options: effort goes to the chat template (vLLM's rule); a summary is not made."""
    effort: ReasoningEffort = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # OpenAI's older name for summary

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summary(cls, value):
        return refuse_past_inert(value, _SUMMARY)


class ResponsesStreamOptions(StreamOptions):
    # OpenAI's: random padding on delta events against length side channels; clients discard it, none is sent
    include_obfuscation: bool | None = None


class ResponsesRequest(SamplingRequest):
    input: Input
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    text: TextOptions | None = None
    store: bool | None = None  # accepted (the SDK sends it); nothing is stored either way
    reasoning: Reasoning | None = None  # effort: the chat template's reasoning_effort, as chat's field
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the chat template
    stream_options: ResponsesStreamOptions | None = None
    # OpenAI's: a cap on calls to built-in tools, of which none run here (function calls are not counted)
    max_tool_calls: int | None = Field(None, ge=0)
    session_id: str | None = None  # vLLM's: an annotation
    # vLLM's: "auto" keeps the input's last tokens that leave max_output_tokens room (prompt_tokens_kept)
    truncation: Literal["auto", "disabled"] | None = None
    include_reasoning: bool = True  # vLLM's chat field: false leaves the reasoning item out (the model still reasons)
    # Declared so typos of them are suggested; refused past their inert values (_RESPONSES_UNSUPPORTED says why)
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    enable_response_messages: bool = False
    previous_input_messages: list | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # default: auto (without tools: no calls, as "none")
    parallel_tool_calls: bool | None = True  # null: the default, as chat's (the openai SDK sends it for None)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives a token, with LOGPROBS_INCLUDE
    include: list[str] | None = None
    _null_parallel_tool_calls = null_means_default("parallel_tool_calls")

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, given):
        """An item this server cannot read is refused by name (item_reference, an image part, a tool role),
        not as a string the list failed to be."""
        if given in ("", []):
            raise ValueError("must not be empty")
        for i, item in enumerate(given if isinstance(given, list) else ()):
            kind = item.get("type", "message") if isinstance(item, dict) else "message"
            if kind not in _ITEM_TYPES:
                raise ValueError(f"item {i} is of type {kind!r}: this server reads {', '.join(_ITEM_TYPES)} items")
            if not isinstance(item, dict) or kind not in ("message", "function_call_output"):
                continue
            if kind == "message" and item.get("role") not in _ROLES:
                raise ValueError(f"item {i}: a message's role must be one of {', '.join(_ROLES)}, got {item.get('role')!r} "
                                 "(a function's result goes back as a function_call_output item)")
            key, readable = ("content", _MESSAGE_PARTS) if kind == "message" else ("output", _TEXT_PARTS)
            for j, part in enumerate(item[key] if isinstance(item.get(key), list) else ()):  # (an image, a file: by name)
                if _part_type(part) not in readable:
                    raise ValueError(f"item {i}, {key} part {j} is of type {_part_type(part)!r}: this server reads "
                                     f"text parts only ({', '.join(readable)})")
        return given

    @field_validator("include")
    @classmethod
    def _known_includes(cls, given):
        unknown = sorted(set(given or ()) - _INCLUDE_EMPTY - {LOGPROBS_INCLUDE})
        if unknown:
            raise ValueError(f"{unknown} is not supported (this server includes {LOGPROBS_INCLUDE!r})")
        return given

    @model_validator(mode="after")
    def _effort_to_template(self):
        """reasoning.effort reaches the chat template as chat's reasoning_effort does (vLLM passes it so)."""
        effort = self.reasoning.effort if self.reasoning else None
        if effort is None:
            return self
        if "reasoning_effort" in (self.chat_template_kwargs or {}):
            raise ValueError("reasoning.effort is given twice: also as chat_template_kwargs.reasoning_effort")
        self.chat_template_kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": effort}
        return self

    @model_validator(mode="after")
    def _check_fields(self):
        if self.n != 1:
            raise ValueError("n is not a Responses API field (one output a response)")
        if self.max_tokens is not None:
            raise ValueError("max_tokens is max_output_tokens on /v1/responses")
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:  # auto without tools: no calls (OpenAI's, vLLM's)
            raise ValueError("tool_choice needs tools")
        check_named((choice.name,) if isinstance(choice, FunctionChoice) else
                    choice.names() if isinstance(choice, ResponsesAllowedToolsChoice) else (), names)
        return self

    def tool_plan(self) -> ToolPlan:
        """As chat's: what the tools ask for (chat's plans, parsers and constraints run them)."""
        if not self.tools:
            return ToolPlan(ToolChoiceKind.NONE)
        functions = tuple(t.chat_tool().function.model_dump(exclude_none=True) for t in self.tools)
        choice = self.tool_choice or "auto"
        if isinstance(choice, FunctionChoice):
            return ToolPlan(ToolChoiceKind.NAMED, functions, choice.name)
        if isinstance(choice, ResponsesAllowedToolsChoice):
            return allowed_plan(choice, functions, self.parallel_tool_calls)
        return ToolPlan(ToolChoiceKind(choice), functions, parallel=self.parallel_tool_calls)

    def chat_tools(self) -> list[Tool]:
        return [t.chat_tool() for t in self.tools or []]

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        for name, rule in _RESPONSES_UNSUPPORTED.items():
            if getattr(self, name) not in rule.inert:
                raise APIError(400, f"'{name}' is not supported: {rule.why}", param=name)
        chat_fields = sorted(_CHAT_SPELLINGS.keys() & (self.model_extra or {}).keys())
        if chat_fields:
            name = chat_fields[0]
            raise APIError(400, f"'{name}' is chat's field; on /v1/responses use {_CHAT_SPELLINGS[name]}", param=name)

    def messages(self, calls_as_written: bool = False) -> list[ChatMessage]:
        """The conversation as chat messages: calls join the assistant turn before them (or start one),
        their outputs become tool turns; calls_as_written (a gpt-oss server's): ToolCallMessage.taken_as_written."""
        turns = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, FunctionCallItem):
                if not turns or turns[-1].role != "assistant":
                    turns.append(ChatMessage(role="assistant", content=None))
                call = item.chat_call()
                turns[-1].tool_calls = [*(turns[-1].tool_calls or []), call.taken_as_written() if calls_as_written else call]
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(ChatMessage(role="tool", content=joined(item.output), tool_call_id=item.call_id))
            elif isinstance(item, ReasoningInputItem) and item.text():
                _add_reasoning(turns, item.text())
            elif isinstance(item, InputMessage):
                turns.append(item.chat_message())
                if len(turns) > 1 and _reasoning_only(turns[-2]) and item.role == "assistant":  # its reasoning's turn
                    turns[-2:] = [turns[-2].model_copy(update={"content": turns[-1].content})]
        return turns

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def prompt_tokens_kept(self, max_model_len: int) -> int | None:
        """truncation "auto", vLLM's rule: the input's last max_model_len - max_output_tokens tokens, so the
        reply fits. Without max_output_tokens vLLM keeps max_model_len tokens, which leaves no room and fails
        the request; here one token's room is left. A smaller truncate_prompt_tokens wins."""
        given = super().prompt_tokens_kept(max_model_len)
        if self.truncation != "auto":
            return given
        auto = max(1, max_model_len - (self.max_output_tokens or 1))  # (a reply past the context: state.job's 400)
        given = max_model_len if given == -1 else given
        return auto if given is None else min(auto, given)

    def requested_logprobs(self) -> int | None:
        """As OpenAI's: top_logprobs alone asks for nothing; the include entry asks for the chosen tokens'."""
        return (self.top_logprobs or 0) if LOGPROBS_INCLUDE in (self.include or ()) else None

    def requested_structure(self) -> StructuredOutputsParams | None:
        """text.format (or chat's spellings), or the constraint a named / required tool choice writes under."""
        asked, forced = self._asked_structure(), self.tool_plan().structure()
        if asked is not None and forced is not None:
            raise ValueError("tool_choice constrains the reply itself; it cannot be combined with text.format "
                             "or structured outputs")
        return forced or asked

    def structure_field(self) -> str | None:
        """Where the reply's constraint was asked for, as a 400 about it names it: tools (a named or required
        choice's), text.format; None for the fields that name themselves (structured_outputs, ...)."""
        if self.tool_plan().structure() is not None:
            return "tools"
        return "text.format" if self.text and self.text.format and self.text.format.type != "text" else None

    def _asked_structure(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return super().requested_structure()
        if self.response_format is not None or super().requested_structure() is not None:  # (guided_* too)
            raise ValueError("structured_outputs can be asked for once (text.format, response_format, "
                             "structured_outputs or guided_*)")
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text.format")
        return StructuredOutputsParams(json=fmt.schema_)


def _reasoning_only(turn: ChatMessage) -> bool:
    """An assistant turn a reasoning item opened, with no content or calls yet (its output follows)."""
    return turn.role == "assistant" and turn.content is None and not turn.tool_calls and turn.reasoning is not None


def _add_reasoning(turns: list[ChatMessage], text: str) -> None:
    """A reasoning item opens the assistant turn its message and calls then join (a second one adds to it)."""
    if turns and _reasoning_only(turns[-1]):
        turns[-1].reasoning += "\n" + text
    else:
        turns.append(ChatMessage(role="assistant", content=None, reasoning=text))
