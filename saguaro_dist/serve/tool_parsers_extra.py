"""Two more tool-call parsers for tool_choice "auto" (vLLM's names), as pure functions of the reply's text.

  qwen3_coder  Qwen3-Coder's XML: content, then <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
               </function></tool_call> blocks (the tags alone, without <tool_call>, are read too; one function a
               block, which ends at a </tool_call> followed by the next <tool_call> or the end). The markup is
               walked structurally, as vLLM's newest Qwen3CoderToolParser walks it: a "</parameter>" ends a value only when what follows it is the next parameter (one the schema
               declares, where it declares any), "</function>", "</tool_call>" or the end, so a value may hold the
               tags as text (code about tool calls); a missing "</parameter>" ends at the next parameter. A
               function name with spaces, quotes, braces or tags (an unrendered template) leaves the reply content.
               Values are text; each is typed by its parameter's JSON schema in the request's tools, as vLLM
               types them: a type list or anyOf gives its first non-null type (and "null" / "None" read null
               where null is allowed); strings and undeclared parameters stay text ("null" too); otherwise
               "null" / "None" are null; integer / number / boolean are read as such; object / array as JSON,
               then as a Python literal (a quoted repr is read once more); other declared types as a Python
               literal. Values that do not read, or read to what strict JSON cannot hold (NaN, 1e400), stay text.
               Unlike vLLM, a type list is read like anyOf (vLLM reads ["boolean", "null"]'s "true" as text),
               parameters need not start a line, and a parameter the schema lacks still ends the value before it.
  pythonic     the whole reply is a Python list of calls, [get_weather(city="Paris", days=3), other()]
               (Llama 3.2, Llama 4), read with Python's ast: keyword arguments whose values are literals
               (strings, numbers, True / False / None or JSON's true / false / null, lists, dicts); anything
               else (a variable, an expression, a positional argument) makes the reply content. An argument
               strict JSON cannot hold (1e999 is infinite) keeps its source text, "1e999": vLLM writes Infinity,
               which Python's json.loads reads but JSON.parse and other strict readers refuse.

Each gives (content, [(name, arguments)]); tool_parsers.py turns the pairs into ToolCalls. Arguments are always
strict JSON. A reply that does not parse stays content: the model's text is never lost.
"""
from __future__ import annotations

import ast
import bisect
import json
import logging
import re

logger = logging.getLogger(__name__)

Calls = list[tuple[str, dict]]
ParsedCalls = tuple[str | None, Calls]  # (content, calls) of a finished reply

QWEN_CALL_OPEN = "<tool_call>"
QWEN_FUNCTION = "<function="
_CALL_CLOSE = "</tool_call>"
_FUNCTION_CLOSE = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_CLOSE = "</parameter>"
# Structural closes are followed (past whitespace) by what may come next: a literal one inside a value is not.
_CALL_END = re.compile(r"</tool_call>(?=\s*(?:<tool_call>|\Z))")
_FUNCTION_END = re.compile(r"</function>(?=\s*(?:</tool_call>|\Z))")
_SPACE = re.compile(r"\s*")
_LINE_PARAMETER = re.compile(r"(?:^|(?<=\n))<parameter=")  # a parameter tag that starts a line
_NAME_FORBIDDEN = frozenset("{}<>\"' \t\n\r")

_TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_JSON_PREFIXES = ("object", "array", "arr", "dict", "list")
_NULL_WORDS = ("null", "none")  # Qwen3.5's template writes a null argument as Python's None
_JSON_NAMES = {"null": None, "true": True, "false": False}  # some models write JSON's words in Python calls
_LITERAL_TYPES = (str, int, float, bool, type(None))


def parse_qwen3_coder(text: str, functions: tuple[dict, ...] = ()) -> ParsedCalls:
    """Qwen3-Coder's calls: the text before the first <tool_call> holding a function (or the first <function=
    where the reply has no <tool_call>) is content; `functions` (the request's tools) give each parameter's type."""
    if QWEN_FUNCTION not in text:
        return text, []
    try:
        start, calls = _qwen_calls(text, functions)
    except ValueError as e:
        logger.debug("not a qwen3_coder tool call (%s): kept as content", e)
        return text, []
    return (text[:start] or None, calls) if calls else (text, [])


def _qwen_calls(text: str, functions: tuple[dict, ...]) -> tuple[int, Calls]:
    """Where the calls' markup begins, and the calls, each read from where the one before it ended."""
    wrapped = QWEN_CALL_OPEN in text  # as vLLM: bare <function= tags are read only where no <tool_call> is
    found = _next_call(text, 0, wrapped)
    start, calls = (found[0] if found else -1), []
    while found:
        name, arguments, end = _qwen_call(text, found[1] + len(QWEN_FUNCTION), functions, wrapped)
        calls.append((name, arguments))
        found = _next_call(text, end, wrapped)
    return start, calls


def _next_call(text: str, pos: int, wrapped: bool) -> tuple[int, int] | None:
    """(where the call's markup opens, where its <function= is) of the next call at or after pos. A <tool_call>
    with no function before its </tool_call> is text about the tags, not a call."""
    if not wrapped:
        function = text.find(QWEN_FUNCTION, pos)
        return (function, function) if function >= 0 else None
    while (opened := text.find(QWEN_CALL_OPEN, pos)) >= 0:
        function, closed = text.find(QWEN_FUNCTION, opened), text.find(_CALL_CLOSE, opened)
        if function < 0:
            return None
        if closed < 0 or function < closed:
            return opened, function
        pos = closed + len(_CALL_CLOSE)
    return None


def _qwen_call(text: str, at: int, functions: tuple[dict, ...], wrapped: bool) -> tuple[str, dict, int]:
    """The function named at `at` (just past <function=): its name, its typed parameters and where it ends. Its
    body runs at most to its block's structural </tool_call> (or, cut short by EOS, to the end of the text)."""
    name_end = text.find(">", at)
    name = text[at:name_end] if name_end >= 0 else ""
    if not name or not _NAME_FORBIDDEN.isdisjoint(name):
        raise ValueError("a <function= tag must name the function (no spaces, quotes, braces or tags) and close "
                         "with '>'")
    block_end = _CALL_END.search(text, name_end) if wrapped else None
    properties = _properties(name, functions)
    body = _Body(text[name_end + 1:block_end.start() if block_end else len(text)], set(properties) or None)
    arguments, end = _qwen_parameters(body, properties)
    return name, arguments, name_end + 1 + end


def _qwen_parameters(body: _Body, properties: dict) -> tuple[dict, int]:
    """A function body's parameters, typed by their schemas, and where the function ends in the body."""
    text, arguments, pos = body.text, {}, 0
    while True:
        pos = _SPACE.match(text, pos).end()
        if pos == len(text) or text.startswith(_FUNCTION_CLOSE, pos):
            return arguments, min(len(text), pos + len(_FUNCTION_CLOSE))
        if not text.startswith(_PARAMETER, pos):  # stray text: skipped to the next parameter or the end
            stop = body.function_end(pos)
            pos = next(body.line_parameters(pos, stop, None), stop)
            continue
        key_end = text.find(">", pos)
        if key_end < 0:  # cut short by EOS inside the tag
            return arguments, len(text)
        key = text[pos + len(_PARAMETER):key_end]
        value, pos = _parameter_value(body, key_end + 1)
        value = value[1:] if value.startswith("\n") else value  # the template puts each value on its own lines
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = qwen_typed_value(value, properties.get(key))


def _parameter_value(body: _Body, start: int) -> tuple[str, int]:
    """The raw value that starts at `start` and where reading goes on: up to its structural </parameter> (one
    followed by a declared parameter; else by any, where the model wrote one the schema lacks: vLLM then reads on
    to the function's end); missing that, up to the next parameter that starts a line, else the function's end."""
    end = body.value_end(start)
    if end >= 0:
        return body.text[start:end], end + len(_PARAMETER_CLOSE)
    stop = body.function_end(start)
    following = next(body.line_parameters(start, stop, body.known), stop)
    return body.text[start:following], following


class _Body:
    """One function's body with its tags found once: each value's end is looked up, not rescanned (a reply of
    thousands of unclosed parameters would take quadratic time). A <parameter= tag starting a line opens a
    parameter; inside a value, one opens a nested (literal) parameter whose </parameter> is the value's text.
    A </parameter> is structural when what follows it can follow a parameter."""

    def __init__(self, text: str, known: set[str] | None):
        self.text, self.known = text, known  # known: the schema's parameter names (None: any name)
        self.opens = [m.start() for m in _LINE_PARAMETER.finditer(text)]
        self.function_ends = [m.start() for m in _FUNCTION_END.finditer(text)]
        closes = [m.start() for m in re.finditer(re.escape(_PARAMETER_CLOSE), text)]
        self.tags = sorted([(at, True) for at in self.opens] + [(at, False) for at in closes])
        self.positions = [at for at, _ in self.tags]
        self.ends = [self._ends(names) for names in ((known, None) if known is not None else (None,))]

    def _ends(self, names: set[str] | None) -> list[int]:
        """For each tag, where a value starting just before it ends (-1: nowhere), found from the last tag back."""
        matched, pending = [-1] * len(self.tags), []
        for i, (_, opens) in enumerate(self.tags):
            if opens:
                pending.append(i)
            elif pending:
                matched[pending.pop()] = i
        ends = [-1] * (len(self.tags) + 1)
        for i in range(len(self.tags) - 1, -1, -1):
            at, opens = self.tags[i]
            if opens:  # the nested parameter's own close is skipped
                ends[i] = ends[matched[i] + 1] if matched[i] >= 0 else -1
            else:
                ends[i] = at if _ends_a_value(self.text, at + len(_PARAMETER_CLOSE), names) else ends[i + 1]
        return ends

    def value_end(self, start: int) -> int:
        """The structural </parameter> of the value starting at `start` (a declared parameter after it first)."""
        first = bisect.bisect_left(self.positions, start)
        return next((ends[first] for ends in self.ends if ends[first] >= 0), -1)

    def function_end(self, pos: int) -> int:
        """The first structural </function> (followed by </tool_call> or the end) at or after pos, else the end."""
        i = bisect.bisect_left(self.function_ends, pos)
        return self.function_ends[i] if i < len(self.function_ends) else len(self.text)

    def line_parameters(self, pos: int, stop: int, names: set[str] | None):
        """The <parameter= tags starting a line in [pos, stop), naming one of `names` where given."""
        for i in range(bisect.bisect_left(self.opens, pos), bisect.bisect_left(self.opens, stop)):
            if names is None or _tag_name(self.text, self.opens[i], names) in names:
                yield self.opens[i]


def _ends_a_value(text: str, after: int, names: set[str] | None) -> bool:
    """Whether a </parameter> ending at `after` is structural: followed (past whitespace) by the end,
    </function>, </tool_call>, or a <parameter= tag (naming one of `names` where given)."""
    pos = _SPACE.match(text, after).end()
    if pos == len(text) or text.startswith((_FUNCTION_CLOSE, _CALL_CLOSE), pos):
        return True
    return text.startswith(_PARAMETER, pos) and (names is None or _tag_name(text, pos, names) in names)


def _tag_name(text: str, at: int, names: set[str]) -> str | None:
    """The name in the <parameter=NAME> tag at `at`, looked for only as far as the longest of `names` reaches."""
    start = at + len(_PARAMETER)
    end = text.find(">", start, start + max(map(len, names), default=0) + 1)
    return text[start:end] if end >= 0 else None


def _properties(name: str, functions: tuple[dict, ...]) -> dict:
    """The named function's parameter schemas ({} for a function the request did not declare)."""
    for function in functions:
        if function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def qwen_typed_value(value: str, schema: dict | None):
    """A parameter's text as its schema's type would have it (None: a parameter the function does not declare);
    text that does not read as that type, or not as strict JSON, stays text (a boolean that is not true / false
    reads false, as in vLLM)."""
    if schema is None:
        return value
    kind, nullable = _schema_kind(schema)
    if value.lower() in _NULL_WORDS and (nullable or kind not in _TEXT_TYPES):
        return None
    if kind in _TEXT_TYPES:
        return value
    typed = _typed(value, kind)
    return typed if _strict_json(typed) else value


def _schema_kind(schema) -> tuple[str, bool]:
    """(the type a value is read as, whether null is allowed): a type list or anyOf gives its first non-null
    type; a schema with neither a type nor an anyOf holding one is read as a string."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        return _kind_of(schema["type"])
    options = schema.get("anyOf")
    kinds = [_kind_of(o["type"]) for o in options if isinstance(o, dict) and "type" in o] \
        if isinstance(options, list) else []
    named = [kind for kind, _ in kinds if kind != "null"]
    return (named[0] if named else "string"), any(nullable for _, nullable in kinds)


def _kind_of(declared) -> tuple[str, bool]:
    names = [str(name).strip().lower() for name in (declared if isinstance(declared, list) else [declared])]
    named = [name for name in names if name != "null"]
    return (named[0] if named else "null"), "null" in names


def _typed(value: str, kind: str):
    """The value read as `kind` (not a text kind); the text itself where it does not read."""
    if kind.startswith(_INTEGER_PREFIXES):
        return _or_text(value, int)
    if kind.startswith(("num", "float")):
        return _or_text(value, _number)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = kind.startswith(_JSON_PREFIXES)
    if container:
        try:
            return _unquoted(json.loads(value))
        except (ValueError, RecursionError):
            pass  # not JSON: perhaps a Python literal (single quotes, True)
    typed = _or_text(value, ast.literal_eval)
    return _unquoted(typed) if container and typed is not value else typed


def _unquoted(value):
    """A container written as a quoted Python repr ("{'k': 'v'}", from a template's json.dumps(str(dict)))
    is read once more."""
    return _or_text(value, ast.literal_eval) if isinstance(value, str) else value


def _number(value: str) -> int | float:
    """A number; a whole one as an integer ("3.0" is 3), as vLLM writes it."""
    number = float(value)
    return int(number) if number.is_integer() else number


def _strict_json(value) -> bool:
    """Whether strict JSON holds the value: no NaN or Infinity (JSON.parse refuses them), sets, bytes, complex
    numbers, or integers too long to write."""
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def _or_text(value: str, read):
    try:
        return read(value)
    except (ValueError, TypeError, SyntaxError, OverflowError, MemoryError, RecursionError):
        return value


def parse_pythonic(text: str, functions: tuple[dict, ...] = ()) -> ParsedCalls:
    """Pythonic calls: the whole reply (whitespace around it aside) is a list of calls, else it is content.
    `functions` is unused (the literals carry their types)."""
    body = text.strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("the reply must be a list of calls")
        return None, [_pythonic_call(node, body) for node in tree.elts]
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        logger.debug("not a pythonic tool call (%s): kept as content", e)
        return text, []


def _pythonic_call(node: ast.expr, source: str) -> tuple[str, dict]:
    """name(key=literal, ...): a plain name, keyword arguments only (duplicates: the last one, as vLLM)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError("each element must be a call of a plain function name")
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        raise ValueError("a tool call takes keyword arguments only")
    return node.func.id, {keyword.arg: _argument(keyword.value, source) for keyword in node.keywords}


def _argument(node: ast.expr, source: str):
    """An argument's literal; its source text where strict JSON cannot hold it (1e999 is infinite)."""
    value = _literal(node)
    return value if _strict_json(value) else ast.get_source_segment(source, node)


def _literal(node: ast.expr):
    """A JSON value written as a Python literal; anything that needs evaluating is refused."""
    if isinstance(node, ast.Constant) and isinstance(node.value, _LITERAL_TYPES):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value  # -3 is a number
    if isinstance(node, ast.List):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) and isinstance(key.value, _LITERAL_TYPES) for key in node.keys):
            raise ValueError("a dict argument's keys must be literals")
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}
    raise ValueError(f"tool call arguments must be literals, not {type(node).__name__}")
