"""Pythonic tool calls (Llama 3.2/4, ToolACE, ...): `[get_weather(city="SF"), get_time()]`.

The list is the whole output, or sits between `<|python_start|>` and `<|python_end|>` (Llama 4). It is read
with `ast` and only literals are accepted (strings, numbers, booleans, None, lists, tuples, dicts; JSON's
true/false/null too): nothing is evaluated. A bare list has no closing marker, so output that starts with `[`
is held until the output ends (it may be calls) and is content if it does not parse.
"""
from __future__ import annotations

import ast
from typing import Any

from appliance.server.parsers.tool_calls.base import BlockSyntax, ToolParser
from appliance.server.parsers.tool_calls.records import BlockError, BlockParse, RawCall

BARE_LIST = BlockSyntax("[", None, at_start_only=True)
PYTHON_START = BlockSyntax("<|python_start|>", "<|python_end|>")
_NAMED_CONSTANTS: dict[str, Any] = {
    "true": True, "false": False, "null": None, "True": True, "False": False, "None": None,
}


class PythonicToolParser(ToolParser):
    name = "pythonic"
    blocks = (BARE_LIST, PYTHON_START)

    def parse_block(self, block: str, syntax: BlockSyntax) -> BlockParse:
        text = syntax.body(block) if syntax is PYTHON_START else block  # the bare list's "[" is part of it
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as e:
            raise BlockError(f"not a Python list of calls: {e.msg}") from None
        if not isinstance(tree.body, ast.List):
            raise BlockError("expected a list of calls")
        return BlockParse(calls=tuple(_call(node) for node in tree.body.elts))


def _call(node: ast.expr) -> RawCall:
    if not isinstance(node, ast.Call):
        raise BlockError("every list element must be a call")
    if node.args:
        raise BlockError("calls must use keyword arguments only")
    name = _dotted_name(node.func)
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise BlockError("**kwargs is not allowed in a tool call")
        args[kw.arg] = _literal(kw.value)
    return RawCall(name=name, arguments=args)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise BlockError("a call must name its function")


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise BlockError("dict keys in tool arguments must be strings")
            out[key] = _literal(v)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BlockError("a sign applies only to numbers")
        return -value if isinstance(node.op, ast.USub) else value
    raise BlockError(f"only literal argument values are allowed, got {type(node).__name__}")
