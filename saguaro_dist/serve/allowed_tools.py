"""OpenAI's `tool_choice: {"type": "allowed_tools", ...}` in chat's and Responses' forms: "auto" or "required"
over a subset of the request's `tools`. The plan runs as auto's or required's (serve/tools.py's ToolPlan.allowed);
every tool still reaches the chat template, as OpenAI keeps them in the prompt (its cache survives a changed
subset). vLLM's chat refuses the form (its tool_choice is a mode or a named function)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from saguaro_dist.serve.tools import ToolChoiceKind, ToolPlan


class FunctionName(BaseModel):
    name: str


class ChatAllowedFunction(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatAllowedTools(BaseModel):
    mode: Literal["auto", "required"]
    tools: list[ChatAllowedFunction] = Field(min_length=1)


class ChatAllowedToolsChoice(BaseModel):
    """Chat's form: {"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [{"type": "function",
    "function": {"name": ...}}, ...]}}."""
    type: Literal["allowed_tools"]
    allowed_tools: ChatAllowedTools

    @property
    def mode(self) -> str:
        return self.allowed_tools.mode

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.function.name for t in self.allowed_tools.tools))


class ResponsesAllowedFunction(BaseModel):
    type: Literal["function"]  # OpenAI's built-in tools' entries (mcp, image_generation, ...) fail here, as in `tools`
    name: str


class ResponsesAllowedToolsChoice(BaseModel):
    """Responses' flat form: {"type": "allowed_tools", "mode": ..., "tools": [{"type": "function", "name": ...}]}."""
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ResponsesAllowedFunction] = Field(min_length=1)

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.name for t in self.tools))


AllowedToolsChoice = ChatAllowedToolsChoice | ResponsesAllowedToolsChoice


def allowed_plan(choice: AllowedToolsChoice, functions: tuple[dict, ...], parallel: bool) -> ToolPlan:
    return ToolPlan(ToolChoiceKind(choice.mode), functions, parallel=parallel, allowed=choice.names())


def check_named(named: tuple[str, ...], names: list[str]) -> None:
    """A tool_choice (a named function, or allowed_tools' list) names only functions among the tools: else a 400."""
    for name in named:
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools {names}")


def choice_tag(value) -> str | None:
    """Which of Responses' tool_choice members a value is: a mode's string, or an object by its "type"."""
    if isinstance(value, str):
        return "mode"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "allowed_tools") else None
