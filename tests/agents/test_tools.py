"""Calculator safety and the tool registry's error handling."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clora.agents.tools import Calculator, FinalAnswer, Tool, ToolError, ToolRegistry, evaluate, format_number


@pytest.mark.parametrize("expr, value", [
    ("17*3", 51), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("7 / 2", 3.5), ("7 // 2", 3), ("7 % 4", 3),
    ("-3 + +5", 2), ("2 ** 10", 1024), ("2^3", 8), ("1.5 * 4", 6.0), ("(12*7-25)/2", 29.5),
])
def test_calculator_evaluates_arithmetic(expr, value):
    assert evaluate(expr) == value


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.sampled_from(["+", "-", "*"]))
@settings(max_examples=50, deadline=None)
def test_calculator_agrees_with_python_on_integers(a, b, op):
    assert evaluate(f"{a} {op} ({b})") == {"+": a + b, "-": a - b, "*": a * b}[op]


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os').system('true')", "Call"),
    ("x + 1", "Name"),
    ("(1).__class__", "Attribute"),
    ("[1, 2][0]", "Subscript"),
    ("lambda: 1", "Lambda"),
    ("'a' * 3", "Constant"),
    ("True + 1", "Constant"),
    ("2 ** 1000", "exponent"),
    ("9 ** 99 ** 2", "exponent"),
    ("10 ** 99 * 10 ** 99", "too large"),
    ("1e308 * 10", "too large"),
    ("1 / 0", "division by zero"),
    ("(-8) ** 0.5", "no real value"),
    ("1 +", "cannot parse"),
    ("1" * 300, "longer than"),
])
def test_calculator_refuses_anything_but_bounded_arithmetic(expr, reason):
    with pytest.raises(ToolError, match=reason):
        evaluate(expr)


def test_format_number_drops_useless_decimals():
    assert [format_number(v) for v in (51, 51.0, 2.5, 1 / 3)] == ["51", "51", "2.5", "0.333333"]


def test_registry_calls_tools_and_names_the_problem():
    reg = ToolRegistry.of([Calculator, FinalAnswer])
    assert reg.call("calculator", '{"expression": "6*7"}') == "42"
    assert reg.has_final and "calculator" in reg and len(reg) == 2
    assert [s["function"]["name"] for s in reg.schemas()] == ["calculator", "final_answer"]
    with pytest.raises(ToolError, match="unknown tool 'search'; available: calculator, final_answer"):
        reg.call("search", "{}")
    with pytest.raises(ToolError, match="calculator: arguments are not valid JSON"):
        reg.call("calculator", "{expression: 1}")
    with pytest.raises(ToolError, match="must be a JSON object, got list"):
        reg.call("calculator", "[1]")
    with pytest.raises(ToolError, match=r"calculator: bad arguments \['expr'\]"):
        reg.call("calculator", '{"expr": "1+1"}')
    with pytest.raises(ToolError, match="division by zero"):
        reg.call("calculator", '{"expression": "1/0"}')


def test_registry_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate tool names"):
        ToolRegistry.of([Calculator, Tool("calculator", "again", {}, lambda: "")])
