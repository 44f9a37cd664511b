"""The tool-aware chat template: exact rendering, and the round trip through the hermes-style parser."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.chat_template import parse_tool_calls, render, tool_call_text
from clora.agents.tools import Calculator, FinalAnswer

TOOLS = [Calculator.schema(), FinalAnswer.schema()]


def _assistant(calls, content=None):
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}


def _assistant_text(rendered: str) -> str:
    """The text of the last assistant turn in a rendering (what the model generated)."""
    start = rendered.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    return rendered[start:rendered.index("<|im_end|>", start)]


def test_renders_tools_calls_and_results_exactly():
    messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "17 times 3?"},
                _assistant([("calculator", {"expression": "17*3"})]),
                {"role": "tool", "tool_call_id": "c0", "content": "51"}]
    out = render(messages, [Calculator.schema()], add_generation_prompt=True)
    assert out == (
        "<|im_start|>system\nSolve it.\n\nTools:\n"
        "- calculator(expression: string): Evaluate an arithmetic expression, e.g. 17*3+2.\n"
        "To call a tool, reply with:\n<tool_call>\n{\"name\": <tool-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n17 times 3?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17*3\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n51\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tools_are_signature_lines_that_keep_every_part_of_their_schemas():
    weather = {"type": "function", "function": {
        "name": "weather", "description": "Weather now.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer"}}}}}
    odd = {"type": "function", "function": {"name": "odd", "description": "d",
                                            "parameters": {"anyOf": [{"type": "object"}]}}}
    ping = {"type": "function", "function": {"name": "ping"}}
    out = render([{"role": "user", "content": "q"}], [weather, odd, ping])
    assert out.startswith(
        "<|im_start|>system\nTools:\n"
        '- weather(city: {"type": "string", "description": "City name"}, '
        'unit?: {"type": "string", "enum": ["c", "f"]}, days?: integer): Weather now.\n'
        '- odd: d\n  parameters: {"anyOf": [{"type": "object"}]}\n'
        "- ping()\nTo call a tool, reply with:\n")


def test_without_tools_it_is_plain_chatml():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    assert render(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                "<|im_start|>assistant\nHello<|im_end|>\n")
    assert render(messages[1:2], add_generation_prompt=True) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_consecutive_tool_results_share_one_user_turn():
    messages = [{"role": "user", "content": "q"},
                _assistant([("calculator", {"expression": "1+1"}), ("calculator", {"expression": "2+2"})]),
                {"role": "tool", "tool_call_id": "c0", "content": "2"},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    out = render(messages, TOOLS)
    assert out.endswith("<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n4\n"
                        "</tool_response><|im_end|>\n")


def test_string_and_dict_arguments_render_alike_and_are_not_html_escaped():
    as_string = _assistant([("calculator", {"expression": "3<4 & 5>2"})])
    as_dict = {**as_string, "tool_calls": [{**as_string["tool_calls"][0], "function": {
        "name": "calculator", "arguments": {"expression": "3<4 & 5>2"}}}]}
    spaced = {**as_string, "tool_calls": [{**as_string["tool_calls"][0], "function": {
        "name": "calculator", "arguments": '{"expression":"3<4 & 5>2"}'}}]}
    outs = {render([{"role": "user", "content": "q"}, m], TOOLS) for m in (as_string, as_dict, spaced)}
    assert len(outs) == 1
    assert '"3<4 & 5>2"' in outs.pop()


_args = st.dictionaries(st.sampled_from(["expression", "answer", "x", "note"]),
                        st.one_of(st.integers(-10**9, 10**9), st.text(max_size=20), st.booleans(),
                                  st.lists(st.integers(0, 9), max_size=3)), max_size=3)


@given(calls=st.lists(st.tuples(st.sampled_from(["calculator", "final_answer", "lookup"]), _args),
                      min_size=1, max_size=3),
       content=st.one_of(st.none(), st.text(st.characters(blacklist_characters="<"), min_size=1, max_size=30)
                         .filter(lambda s: s.strip() == s and s.strip())))
@settings(max_examples=60, deadline=None)
def test_rendered_tool_calls_parse_back_to_the_same_calls(calls, content):
    message = _assistant(calls, content)
    rendered = render([{"role": "user", "content": "q"}, message], TOOLS)
    parsed_content, parsed = parse_tool_calls(_assistant_text(rendered))
    assert parsed_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed] == calls


def test_parser_matches_hermes_on_odd_outputs():
    assert parse_tool_calls("just text") == ("just text", [])
    bad = '<tool_call>\n{"name": "calculator", "arguments": {oops}\n</tool_call>'
    assert parse_tool_calls(bad) == (bad, [])
    no_args = '<tool_call>{"name": "calculator"}</tool_call>'
    assert parse_tool_calls(no_args) == (no_args, [])
    unclosed = 'ok <tool_call>\n{"name": "final_answer", "arguments": {"answer": 5}}'
    assert parse_tool_calls(unclosed) == ("ok", [{"name": "final_answer", "arguments": '{"answer": 5}'}])
    assert parse_tool_calls(tool_call_text("calculator", {"expression": "é"})) == (
        None, [{"name": "calculator", "arguments": '{"expression": "é"}'}])


def test_render_names_the_messages_it_cannot_render():
    from tests.chat_template import ChatTemplateError

    with pytest.raises(ChatTemplateError, match=r"roles \['system', 'user'\]"):
        render([{"role": "system", "content": None}, {"role": "user", "content": "q"}], TOOLS)


def test_transformers_renders_the_template_like_render_does():
    """vLLM renders chat templates with transformers (tool-call arguments parsed to dicts)."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    from tests.chat_template import TOOL_CHAT_TEMPLATE
    from clora.agents.envs import ArithmeticEnv

    env = ArithmeticEnv()
    p = env.problem(1, "hard")
    messages = [*p.messages, *p.reference]
    as_vllm = json.loads(json.dumps(messages))
    for m in as_vllm:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    out, _ = chat_template_utils.render_jinja_template(conversations=[as_vllm], tools=env.tools.schemas(),
                                                       chat_template=TOOL_CHAT_TEMPLATE, add_generation_prompt=True)
    assert out[0] == render(messages, env.tools.schemas(), add_generation_prompt=True)
