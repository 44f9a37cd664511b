"""Tools an agent may call: the `Tool` record, the `ToolRegistry`, and the two built-ins.

A tool is a name, a JSON-schema for its arguments (what the model sees in `tools`) and a
python callable that gets the parsed arguments as keywords and returns text (what the
model sees in the tool result). A tool marked `final` ends the episode: its `answer`
argument is the agent's answer (`FinalAnswer`).

`Calculator` evaluates arithmetic by walking the `ast` of the expression — numbers,
`+ - * / // % **`, unary signs and parentheses only. Names, calls, attributes,
subscripts and exponents above `MAX_EXPONENT` are refused with `ToolError`; nothing is
ever passed to `eval`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class ToolError(Exception):
    """A tool could not run on the arguments it got; the message is shown to the model."""


@dataclass(frozen=True)
class Tool:
    """One callable tool. `parameters` is the JSON schema of the arguments object."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str]
    final: bool = False
    """Calling it ends the episode; its `answer` argument is the episode's answer."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRegistry:
    """The tools one agent may call, by name."""

    tools: tuple[Tool, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        if len(names) != len(set(names)):
            raise ValueError(f"duplicate tool names in {names}")

    @classmethod
    def of(cls, tools: Iterable[Tool]) -> "ToolRegistry":
        return cls(tuple(tools))

    def __contains__(self, name: str) -> bool:
        return any(t.name == name for t in self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    def get(self, name: str) -> Tool:
        for t in self.tools:
            if t.name == name:
                return t
        raise ToolError(f"unknown tool {name!r}; available: {', '.join(t.name for t in self.tools) or 'none'}")

    @property
    def has_final(self) -> bool:
        return any(t.final for t in self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools]

    def call(self, name: str, arguments: str) -> str:
        """Run tool `name` on JSON-encoded `arguments` (as the API carries them); returns its text.

        Raises ToolError naming the tool when the tool is unknown, the arguments are not a
        JSON object, or the tool refuses them.
        """
        tool = self.get(name)
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise ToolError(f"{name}: arguments are not valid JSON ({e.msg}): {arguments[:200]!r}") from e
        if not isinstance(args, dict):
            raise ToolError(f"{name}: arguments must be a JSON object, got {type(args).__name__}")
        try:
            return tool.fn(**args)
        except ToolError:
            raise
        except TypeError as e:
            raise ToolError(f"{name}: bad arguments {sorted(args)}: {e}") from e


# --- Calculator ---------------------------------------------------------------------------

MAX_EXPONENT = 100
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression such as `"(17 + 3) * 2 / 5"`, without eval.

    Raises ToolError for anything but numbers and arithmetic operators, for exponents
    above MAX_EXPONENT, for results above MAX_MAGNITUDE and for division by zero.
    """
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {expression!r}: {e.msg}") from e
    return _eval(tree.body, expression)


def _eval(node: ast.AST, source: str) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value, source)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, source), _eval(node.right, source)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} in {source!r} exceeds {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right), source)
        except ZeroDivisionError as e:
            raise ToolError(f"division by zero in {source!r}") from e
        except OverflowError as e:
            raise ToolError(f"result of {source!r} is too large") from e
    raise ToolError(f"only numbers and + - * / // % ** are allowed; {type(node).__name__} found in {source!r}")


def _bounded(value: Any, source: str) -> int | float:
    if isinstance(value, complex):
        raise ToolError(f"{source!r} has no real value")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"result of {source!r} is too large")
    return value


def format_number(value: int | float) -> str:
    """`51` for 51 and 51.0, `2.5` for 2.5, at most 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}".rstrip("0").rstrip(".")


def _calculate(expression: str) -> str:
    return format_number(evaluate(expression))


def _final_answer(answer: Any) -> str:
    return str(answer)


Calculator = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression, e.g. 17*3+2.",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    fn=_calculate,
)

FinalAnswer = Tool(
    name="final_answer",
    description="Give the final answer.",
    parameters={"type": "object", "properties": {"answer": {"type": "number"}}, "required": ["answer"]},
    fn=_final_answer,
    final=True,
)
