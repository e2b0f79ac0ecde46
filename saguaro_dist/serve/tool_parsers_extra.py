"""Two more tool-call parsers for tool_choice "auto" (vLLM's names), as pure functions of the reply's text.

  qwen3_coder  Qwen3-Coder's XML: content, then <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
               </function></tool_call> blocks (the tags alone, without <tool_call>, are read too). Values are
               text; each is typed by its parameter's JSON schema in the request's tools, as vLLM's
               Qwen3CoderToolParser types them: "null" is null; integer / number / boolean are read as such;
               object / array as JSON, then as a Python literal; other declared types as a Python literal;
               strings, undeclared parameters and values that do not read stay text.
  pythonic     the whole reply is a Python list of calls, [get_weather(city="Paris", days=3), other()]
               (Llama 3.2, Llama 4), read with Python's ast: keyword arguments whose values are literals
               (strings, numbers, True / False / None or JSON's true / false / null, lists, dicts); anything
               else (a variable, an expression, a positional argument) makes the reply content.

Each gives (content, [(name, arguments)]); tool_parsers.py turns the pairs into ToolCalls. A reply that
does not parse stays content: the model's text is never lost.
"""
from __future__ import annotations

import ast
import json
import logging
import math
import re

logger = logging.getLogger(__name__)

Calls = list[tuple[str, dict]]
ParsedCalls = tuple[str | None, Calls]  # (content, calls) of a finished reply

QWEN_CALL_OPEN = "<tool_call>"
QWEN_FUNCTION = "<function="
# A block, function or parameter runs to its close tag or, cut short by EOS, to the end of the text (and a
# parameter also to the next parameter or the function's end), as vLLM reads them.
_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_QWEN_FUNCTION = re.compile(r"<function=(.*?)(?:</function>|$)", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)

_TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_JSON_PREFIXES = ("object", "array", "arr", "dict", "list")
_JSON_NAMES = {"null": None, "true": True, "false": False}  # some models write JSON's words in Python calls
_LITERAL_TYPES = (str, int, float, bool, type(None))


def parse_qwen3_coder(text: str, functions: tuple[dict, ...] = ()) -> ParsedCalls:
    """Qwen3-Coder's calls: the text before the first <tool_call> (or <function= without one) is content;
    `functions` (the request's tools) give each parameter's type."""
    if QWEN_FUNCTION not in text:
        return text, []
    blocks = _QWEN_BLOCK.findall(text) or [text]  # no <tool_call>: the bare <function=...> tags
    bodies = [body for block in blocks for body in _QWEN_FUNCTION.findall(block)]
    try:
        calls = [_qwen_call(body, functions) for body in bodies]
    except ValueError as e:
        logger.debug("not a qwen3_coder tool call (%s): kept as content", e)
        return text, []
    if not calls:
        return text, []
    start = text.find(QWEN_CALL_OPEN)
    start = start if start >= 0 else text.find(QWEN_FUNCTION)
    return text[:start] or None, calls


def _qwen_call(body: str, functions: tuple[dict, ...]) -> tuple[str, dict]:
    """One <function=...> body: its name, then its parameters typed by the function's schema."""
    name, closed, parameters = body.partition(">")
    if not closed or not name:
        raise ValueError("a <function= tag must name the function and close with '>'")
    properties = _properties(name, functions)
    arguments = {}
    for match in _QWEN_PARAMETER.findall(parameters):
        key, closed, value = match.partition(">")
        if not closed:
            raise ValueError("a <parameter= tag must close with '>'")
        value = value[1:] if value.startswith("\n") else value  # the template puts each value on its own lines
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = qwen_typed_value(value, properties.get(key))
    return name, arguments


def _properties(name: str, functions: tuple[dict, ...]) -> dict:
    """The named function's parameter schemas ({} for a function the request did not declare)."""
    for function in functions:
        if function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def qwen_typed_value(value: str, schema: dict | None):
    """A parameter's text as its schema's type would have it; text that does not read as that type stays text
    (a boolean that is not true / false reads false, as in vLLM)."""
    if value.lower() == "null":
        return None
    if schema is None:  # a parameter the function does not declare
        return value
    kind = str(schema.get("type", "string")).strip().lower() if isinstance(schema, dict) else "string"
    if kind in _TEXT_TYPES:
        return value
    if kind.startswith(_INTEGER_PREFIXES):
        return _or_text(value, int)
    if kind.startswith(("num", "float")):
        return _or_text(value, _number)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind.startswith(_JSON_PREFIXES):
        try:
            return json.loads(value)
        except ValueError:
            pass  # not JSON: perhaps a Python literal (single quotes, True)
    return _or_text(value, _python_literal)


def _number(value: str) -> int | float:
    """A number; a whole one as an integer ("3.0" is 3), as vLLM writes it. inf and nan have no JSON."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return int(number) if number.is_integer() else number


def _python_literal(value: str):
    result = ast.literal_eval(value)
    json.dumps(result)  # sets, bytes and complex numbers have no JSON: not a value for the arguments
    return result


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
        return None, [_pythonic_call(node) for node in tree.elts]
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        logger.debug("not a pythonic tool call (%s): kept as content", e)
        return text, []


def _pythonic_call(node: ast.expr) -> tuple[str, dict]:
    """name(key=literal, ...): a plain name, keyword arguments only (duplicates: the last one, as vLLM)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError("each element must be a call of a plain function name")
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        raise ValueError("a tool call takes keyword arguments only")
    return node.func.id, {keyword.arg: _literal(keyword.value) for keyword in node.keywords}


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
