"""/v1/chat/completions' request: the messages, the tools and how the rendered conversation ends."""
from __future__ import annotations

import enum
import json
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from saguaro_dist.sampling_params import MAX_LOGPROBS, StructuredOutputsParams
from saguaro_dist.serve.allowed_tools import ChatAllowedToolsChoice, allowed_plan, check_named, choice_tag
from saguaro_dist.serve.chat_content import MessageContent, TextPart, refuse_media
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.request_fields import GENERATION_UNSUPPORTED, Unsupported, null_means_default, tagged_union
from saguaro_dist.serve.sampling_request import SamplingRequest
from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan

MAX_TOOLS = 128  # OpenAI's limit on functions a request may declare
# Chat request fields that are chat template variables: joined to chat_template_kwargs, read or refused there
TEMPLATE_VARIABLE_FIELDS = ("documents", "reasoning_effort")
REPLY_ROLE = "assistant"  # a new turn's role in chat replies unless the server's --response-role names another


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


__all__ = ["MAX_TOOLS", "REPLY_ROLE", "TEMPLATE_VARIABLE_FIELDS", "ChatCompletionRequest",
           "ChatMessage", "ChatPromptFields", "FunctionCall", "FunctionDefinition", "NamedFunction",
           "NamedToolChoice", "PromptEnd", "TextPart", "Tool", "ToolCallMessage"]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    """A call an earlier assistant turn made, sent back in the history."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    _as_written: bool = PrivateAttr(False)  # arguments that are not JSON reach the template as written

    def taken_as_written(self) -> ToolCallMessage:
        """This call on a gpt-oss (harmony) server, which returns calls whose arguments are not JSON (a `code`
        call, one cut off, malformed JSON): taken back as written, as vLLM's harmony rendering takes them."""
        call = self.model_copy()
        call._as_written = True
        return call

    def for_template(self) -> dict:
        """Chat templates (transformers' convention) read the arguments as a mapping, as vLLM passes them
        (empty arguments as {}, vLLM's); JSON text of anything but an object is refused (a template may walk
        them: Qwen3-Coder's `arguments|items`), and so is other text, unless taken_as_written (a string)."""
        try:
            arguments = json.loads(self.function.arguments) if self.function.arguments else {}
        except ValueError:
            if self._as_written:
                return self._with_id({"type": "function", "function": self.function.model_dump()})
            arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call {self.function.name!r}: arguments must be JSON text of an object, "
                             f"got {self.function.arguments!r}")
        return self._with_id({"type": "function", "function": {"name": self.function.name, "arguments": arguments}})

    def _with_id(self, call: dict) -> dict:
        """The call with its id, if it has one: a call sent without one has none in the template either (as
        transformers renders the client's call), where None would be written out ("None")."""
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent = None  # a string or text parts (chat_content.py); null only in an assistant turn
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns
    tool_call_id: str | None = Field(None, validate_default=True)  # tool turns: the call this answers
    # An earlier assistant turn's reasoning (vLLM's name; reasoning_content, its former one, read too): templates
    # that show past reasoning (interleaved thinking) read it as either name
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        return refuse_media(content)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_in_tool_turns(cls, call_id, info: ValidationInfo):
        """Checked at the field, so the 400 names it (`messages.1.tool_call_id: Field required ...`), as OpenAI's
        names `messages[1].tool_call_id`."""
        if info.data.get("role") == "tool" and call_id is None:
            raise PydanticCustomError("missing", "Field required in a message with role 'tool'")
        if info.data.get("role") == "tool" and not call_id:
            raise ValueError("must not be empty in a message with role 'tool'")
        return call_id

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_in_assistant_turns(cls, calls, info: ValidationInfo):
        if calls and info.data.get("role") not in (None, "assistant"):
            raise ValueError("only assistant messages carry tool_calls")
        return calls

    @model_validator(mode="after")
    def _check_tool_fields(self):
        if self.content is None and self.role != "assistant":  # OpenAI's: only an assistant turn may lack it
            raise ValueError(f"a message with role {self.role!r} needs content")
        if self.past_reasoning() is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning")
        return self

    def past_reasoning(self) -> str | None:
        """reasoning, else reasoning_content, else `thinking` (the name gpt-oss's template reads, which
        transformers users send)."""
        thinking = (self.model_extra or {}).get("thinking")
        given = (self.reasoning, self.reasoning_content, thinking if isinstance(thinking, str) else None)
        return next((r for r in given if r is not None), None)

    def with_calls_as_written(self) -> ChatMessage:
        """The message with its calls taken_as_written (a gpt-oss server's history)."""
        if not self.tool_calls:
            return self
        return self.model_copy(update={"tool_calls": [call.taken_as_written() for call in self.tool_calls]})

    def text(self) -> str:
        if isinstance(self.content, list):  # one part a line, as vLLM joins them for string templates
            return "\n".join(part.value() for part in self.content)
        return self.content or ""

    def text_parts(self) -> list[dict]:
        """The content as a list of text parts (vLLM's "openai" content format): a string is one part, none none."""
        given = [self.content] if isinstance(self.content, str) else self.content or []
        return [{"type": "text", "text": part if isinstance(part, str) else part.value()} for part in given]

    def for_template(self, parts: bool = False) -> dict:
        """The message as chat templates read it; `parts`: content as text_parts, for a template that loops over
        it (prompts.content_as_parts), except a tool turn's, which vLLM joins into a string for any template."""
        out = {"role": self.role, "content": self.text_parts() if parts and self.role != "tool" else self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.past_reasoning() is not None:  # both names, as vLLM passes it (Qwen3's and DeepSeek's templates)
            out["reasoning"] = out["reasoning_content"] = self.past_reasoning()
            # gpt-oss's template reads `thinking` (transformers fills it from these too), but refuses it with
            # content in a turn with calls (it shows that content as the analysis then): "" says none there
            out["thinking"] = "" if self.tool_calls and self.text() else self.past_reasoning()
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


# Picked by type (a mode's string, else the object's "type"), so {"type": "function"} is "tool_choice.function:
# Field required", not the first member's "Input should be 'none', 'auto' or 'required'"
_ToolChoice = tagged_union({"mode": Literal["none", "auto", "required"], "function": NamedToolChoice,
                            "allowed_tools": ChatAllowedToolsChoice}, choice_tag,
                           "'none', 'auto', 'required', {\"type\": \"function\", \"function\": {\"name\": ...}} or "
                           "{\"type\": \"allowed_tools\", \"allowed_tools\": {\"mode\": ..., \"tools\": [...]}}")


class ChatCompletionRequest(SamplingRequest, ChatPromptFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer OpenAI name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    # default: auto with tools
    tool_choice: _ToolChoice | None = None
    parallel_tool_calls: bool | None = True  # null: the default (_null_parallel_tool_calls)
    chat_template_kwargs: dict | None = None  # vLLM's: extra variables for the chat template (Qwen3's enable_thinking)
    echo: bool = False  # vLLM's: the reply starts with the last message when that is the reply's role (reply_role)
    # Variables for the chat template, joined to chat_template_kwargs (a template that reads neither is a 400)
    documents: list[dict[str, str]] | None = None  # vLLM's: RAG documents, transformers' documents=
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # OpenAI's
    add_special_tokens: bool = False  # vLLM's: BOS etc. added on top of what the chat template writes
    chat_template: str | None = None  # vLLM's per-request template
    # vLLM's: false leaves the reasoning out of the reply (no `reasoning` field or delta; the model still
    # reasons), and a constrained reply is held to its constraint from the first token (vLLM's reasoning_ended)
    include_reasoning: bool = True
    unsupported_fields: ClassVar[dict[str, Unsupported]] = {
        **GENERATION_UNSUPPORTED,
        "chat_template": Unsupported((None,), "the server's --chat-template or the tokenizer's applies, as vLLM "
                                              "without --trust-request-chat-template"),
        "truncation_side": Unsupported((None, "left"), "vLLM's chat keeps a truncated prompt's last tokens; "
                                                       "/v1/completions truncates from either side")}
    continuous_usage: ClassVar[bool] = True
    _null_parallel_tool_calls = null_means_default("parallel_tool_calls")

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
        check_named((choice.function.name,) if isinstance(choice, NamedToolChoice) else
                    choice.names() if isinstance(choice, ChatAllowedToolsChoice) else (), names)
        return self

    def tool_plan(self) -> ToolPlan:
        """What the tools ask for; a request without tools gets a plain-text plan."""
        if not self.tools:
            return ToolPlan(ToolChoiceKind.NONE)
        functions = tuple(t.function.model_dump(exclude_none=True) for t in self.tools)
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            return ToolPlan(ToolChoiceKind.NAMED, functions, choice.function.name)
        if isinstance(choice, ChatAllowedToolsChoice):
            return allowed_plan(choice, functions, self.parallel_tool_calls)
        return ToolPlan(ToolChoiceKind(choice), functions, parallel=self.parallel_tool_calls)

    def requested_structure(self) -> StructuredOutputsParams | None:
        asked = super().requested_structure()
        forced = self.tool_plan().structure()
        if asked is not None and forced is not None:
            raise ValueError(f"tool_choice {_choice_name(self.tool_choice)!r} constrains the reply itself; it cannot "
                             "be combined with response_format or structured outputs")
        return forced or asked

    def tool_structure_error(self, err: ValueError) -> APIError | None:
        """The engine's refusal of the constraint a named or required tool_choice wrote (it says
        "structured_outputs ..."), naming what the client sent: tool_choice for a setting it cannot be combined
        with (ignore_eos, min_tokens, ...), tools for parameters that do not compile. None for any other error."""
        plan, rest = self.tool_plan(), str(err).removeprefix("structured_outputs ")
        if rest.startswith("is not valid") and plan.structure() is not None:
            return APIError(400, f"the tools' parameters are{rest.removeprefix('is')}", param="tools")
        return plan.clash_error(err)  # (shared with /v1/responses)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # vLLM's rule: top_logprobs 0 alone asks for nothing
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be >= 1")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def reply_role(self, response_role: str = REPLY_ROLE) -> str:
        """The reply's role (vLLM's get_chat_request_role): the server's --response-role when a new turn is
        opened for it (add_generation_prompt), else the last message's, which the reply continues or follows."""
        return response_role if self.add_generation_prompt else self.messages[-1].role

    def echoed(self, reply_role: str) -> str:
        """What `echo` puts before the reply's content: the last message's text when it is of the reply's role
        (`reply_role`: an assistant prefill, continued with continue_final_message), else nothing (vLLM's rule)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == reply_role else ""

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_prompt_logprobs(self) -> int | None:
        """vLLM's: prompt_logprobs, else echo's (top_logprobs of each prompt token, in the whole response only:
        vLLM scores a streamed echo's prompt too, and sends nothing of it)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return (self.top_logprobs or 0) if self.echo and not self.stream else None


def _choice_name(choice) -> str:
    if isinstance(choice, ChatAllowedToolsChoice):
        return f"allowed_tools ({choice.mode})"
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice
