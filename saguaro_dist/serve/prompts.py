"""Turning request prompts and chat messages into token ids, the same way `LLM.generate` does."""
from __future__ import annotations

import functools
import json
import re
import logging
from pathlib import Path

from saguaro_dist.engine.text import encode_text
from saguaro_dist.serve.protocol import TEMPLATE_VARIABLE_FIELDS, ChatMessage, PromptEnd, Tool
from saguaro_dist.serve.tool_parsers import HERMES_CLOSE, HERMES_OPEN

log = logging.getLogger(__name__)
HINT_FIELDS = frozenset({"reasoning_effort"})  # template variables a template may ignore without a 400

# Arguments we pass apply_chat_template ourselves: a request's chat_template_kwargs may not set them.
# (documents may: it is transformers' argument and vLLM's request field, passed on as given.)
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt", "chat_template",
                                      "return_dict", "return_tensors", "continue_final_message"})


def render_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None = None,
                template_kwargs: dict | None = None, chat_template: str | None = None,
                end: PromptEnd = PromptEnd.NEW_TURN, content_format: str = "auto") -> tuple[str, bool]:
    """The prompt text for `messages` (and the tools the model may call) and whether it already carries
    the special tokens.

    `chat_template` (the server's --chat-template) or else the tokenizer's own when it has one (tools go
    to it as transformers' `tools=`); otherwise a plain "Role: text" transcript ending with "Assistant:",
    so base models without a template can still be chatted with (tools as a JSON line first, earlier
    calls in hermes tags). template_kwargs: extra variables for the template (Qwen3's enable_thinking),
    unused by the transcript. `end`: an assistant turn opened (the default), nothing opened, or the last
    message left open to be continued (a transcript ends at its last line either way). `content_format`
    (vLLM's chat_template_content_format): "auto" hands content as text parts to a template that loops over it
    (content_as_parts), else as a string; "string" and "openai" force one.
    """
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {clash}")
    tools = [t.model_dump(exclude_none=True) for t in tools or []]
    template = resolve_template(tokenizer, chat_template, tools)
    parts = content_format == "openai" or (content_format == "auto" and content_as_parts(template))
    turns = [m.for_template(parts=parts) for m in messages]
    check_template_reads(template, template_kwargs or {})
    if template:
        return _apply_template(tokenizer, template, turns, tools, template_kwargs or {}, end), True
    lines = [f"Tools: {json.dumps(tools)}"] if tools else []
    lines += [f"{turn['role'].capitalize()}: {_plain_content(turn)}" for turn in turns]
    return "\n".join(lines + (["Assistant:"] if end is PromptEnd.NEW_TURN else [])), False


def resolve_template(tokenizer, chat_template: str | None, tools: list[dict]) -> str | None:
    """The template that renders: the server's --chat-template, else the tokenizer's own; of a tokenizer's named
    templates (Hermes', Command-R's {"default": ..., "tool_use": ...}) the one transformers picks, tool_use with
    tools, else default (apply_chat_template cannot be handed the dict itself)."""
    if chat_template or not getattr(tokenizer, "chat_template", None):
        return chat_template or None
    try:
        return tokenizer.get_chat_template(None, tools or None)
    except ValueError as err:  # named templates, none of them the default
        raise ValueError(f"messages: no chat template applies: {err}") from None


@functools.lru_cache(maxsize=32)
def content_as_parts(template: str | None) -> bool:
    """vLLM's "openai" content format: a template that loops over a message's content reads it as a list of
    {"type": "text", "text": ...} parts (Gemma 3's, Llama 4's); a string there is walked a character at a time,
    and a part's text is lost. Found as vLLM finds it: a loop over `content` of a loop variable over messages."""
    if not template:
        return False
    from jinja2 import TemplateError, nodes
    try:
        ast = _compile_jinja_template(template).environment.parse(template)
    except TemplateError:
        return False
    loops = list(ast.find_all(nodes.For))
    turns = {loop.target.name for loop in loops
             if isinstance(loop.target, nodes.Name) and _reads(loop.iter, _names_bound(ast, "messages"))}
    return any(_reads(loop.iter, turns, "content") for loop in loops)


def _names_bound(ast, name: str) -> set[str]:
    """`name` and the names set from it, directly or in turn ({% set loop_messages = messages[1:] %})."""
    from jinja2 import nodes
    found, todo = {name}, [name]
    while todo:
        source = todo.pop()
        for assign in ast.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in found and _reads(assign.node, {source}):
                found.add(target.name)
                todo.append(target.name)
    return found


def _reads(node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (or its item `key`: m.content, m['content']) through filters, tests
    and slices."""
    from jinja2 import nodes
    if isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem) and
                                                       isinstance(node.arg, nodes.Slice)):
        return node.node is not None and _reads(node.node, names, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    item = node.attr if isinstance(node, nodes.Getattr) else \
        node.arg.value if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) else None
    return item == key and _reads(node.node, names)


def _apply_template(tokenizer, template: str, turns: list[dict], tools: list[dict], kwargs: dict,
                    end: PromptEnd) -> str:
    """The template's text; one that refuses the conversation (raise_exception: "roles must alternate")
    is the request's fault, a 400 naming the template's message, as vLLM answers. So is any other failure
    (vLLM's safe_apply_chat_template): chat_template_kwargs reach the template and transformers as given
    ({"messages": [...]} is a TypeError there), so what fails is the request's messages or kwargs."""
    from jinja2 import TemplateError
    try:
        return tokenizer.apply_chat_template(turns, tools=tools or None, tokenize=False, chat_template=template,
                                             add_generation_prompt=end is PromptEnd.NEW_TURN,
                                             continue_final_message=end is PromptEnd.CONTINUE, **kwargs)
    except TemplateError as err:
        raise ValueError(f"messages: the chat template refused them: {err}") from None
    except Exception as err:  # noqa: BLE001 - vLLM's rule: a 400 with the error's text, logged with its traceback
        log.warning("applying the chat template failed", exc_info=True)
        raise ValueError(f"messages: the chat template could not be applied to them and chat_template_kwargs: "
                         f"{type(err).__name__}: {err}") from None


def check_template_reads(template: str | dict | None, template_kwargs: dict) -> None:
    """documents change the reply only through a template that reads them: one that does not (or the plain
    transcript) would drop them without a word, so that is a 400 naming the field. reasoning_effort is a hint
    clients send by habit (vLLM ignores it where the template reads none): logged, not refused."""
    given = [name for name in TEMPLATE_VARIABLE_FIELDS if template_kwargs.get(name) is not None]
    read = template_variables(template) if (template and given) else frozenset()
    for name in (name for name in given if name not in read):
        if name in HINT_FIELDS:
            log.warning("%s is not read by this model's chat template: ignored", name)
        else:
            raise ValueError(f"{name} is not read by this model's chat template, so it would change nothing")


def template_variables(template: str | dict) -> frozenset[str]:
    """The variables a Jinja chat template (or each of a tokenizer's named ones) reads from its caller."""
    sources = template.values() if isinstance(template, dict) else [template]
    return frozenset().union(*map(_read_variables, sources))


def _read_variables(source: str) -> frozenset[str]:
    """Jinja's own answer; the names the text spells where this Jinja cannot parse it (a tag only
    transformers' environment defines, such as {% generation %})."""
    import jinja2
    from jinja2 import meta
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # {% break %}, as transformers allows
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source))


def load_chat_template(value: str) -> str:
    """--chat-template: a Jinja template given inline or as a file (vLLM's rule: text holding '{', '}'
    or a newline is the template itself), checked to compile, so a typo fails at start-up."""
    import jinja2
    if not any(c in value for c in "{}\n"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
        value = path.read_text(encoding="utf-8")
    try:  # in transformers' environment, which renders it: {% break %} and {% generation %} are tags there
        _compile_jinja_template(value)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat_template does not compile: {err} (line {err.lineno})") from None
    return value


def _compile_jinja_template(template: str):
    """transformers' compiled template (cached there), in the environment apply_chat_template renders with."""
    from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    return compile_template(template)


def _plain_content(turn: dict) -> str:
    calls = [f"{HERMES_OPEN}{json.dumps(c['function'])}{HERMES_CLOSE}" for c in turn.get("tool_calls", ())]
    return "".join([turn["content"], *calls])


def encode_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None = None,
                template_kwargs: dict | None = None, chat_template: str | None = None,
                param: str = "messages", end: PromptEnd = PromptEnd.NEW_TURN,
                add_special_tokens: bool = False, content_format: str = "auto") -> list[int]:
    """The prompt's ids. A chat template writes BOS etc. itself: the tokenizer adds its special tokens on top
    only when asked (vLLM's add_special_tokens, false by default); the plain transcript always gets them.
    content_format: vLLM's chat_template_content_format (render_chat)."""
    text, templated = render_chat(tokenizer, messages, tools, template_kwargs, chat_template, end, content_format)
    return encode_text(tokenizer, text, add_special_tokens=add_special_tokens or not templated, param=param)
