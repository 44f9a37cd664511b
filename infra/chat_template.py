"""The tool-aware ChatML chat template, its renderer and the matching tool-call parser.

Shared by every part that turns messages into tokens: base-model preparation writes it into
the model directory (so vLLM and the learner's tokenizer both render with it), agents parse
tool calls with it. It lives in `infra` because learner, serving and agents all use it.

SmolLM2's own ChatML template ignores `tools`. `TOOL_CHAT_TEMPLATE` is a Qwen2.5-style
ChatML template that the engine (vLLM `--chat-template`, with `--tool-call-parser hermes`)
and the learner both use, so the model is trained on exactly what it is served with.
Rendered, a tool-use conversation reads:

    <|im_start|>system
    You solve math word problems.

    Tools:
    - calculator(expression: string): Evaluate an arithmetic expression, e.g. 17*3+2.
    - final_answer(answer: number): Give the final answer.
    To call a tool, reply with:
    <tool_call>
    {"name": <tool-name>, "arguments": <args-json-object>}
    </tool_call><|im_end|>
    <|im_start|>user
    What is 17 times 3?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17*3"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    51
    </tool_response><|im_end|>
    <|im_start|>assistant

Each tool is one signature line: `name(param: type, optional?: type): description`. A parameter
whose schema is more than a bare `type` (a description, an enum, nested items) is written as its
JSON schema; a tool whose parameters are not a plain object of properties gets its whole schema
on a `parameters:` line. So nothing of a schema is lost, and the common case costs a third of
the tokens of one JSON object per tool (calc's system turn: 105 tokens, was 183 with JSON
lines; every prompt, served or trained on, carries it).

Without tools it renders exactly as SmolLM2's plain ChatML (no default system prompt).
`parse_tool_calls` is equivalent to vLLM's `hermes` parser: every
`<tool_call>(.*?)</tool_call>` block is a JSON `{"name", "arguments"}` object; the text
before the first block is the content; if any block is not valid JSON the whole output is
plain content with no calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- 'Tools:' }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {%- set params = tool.parameters or {} %}
        {%- set flat = (params.type is not defined or params.type == 'object') and params | reject('in', ['type', 'properties', 'required',
                                                                                  'additionalProperties']) | list | length == 0 %}
        {{- '\\n- ' + tool.name }}
        {%- if flat %}
            {{- '(' }}
            {%- for name, prop in (params.properties or {}).items() %}
                {%- if not loop.first %}
                    {{- ', ' }}
                {%- endif %}
                {{- name + ('' if name in (params.required or []) else '?') + ': ' }}
                {%- if prop.type is string and prop | length == 1 %}
                    {{- prop.type }}
                {%- else %}
                    {{- prop | tojson }}
                {%- endif %}
            {%- endfor %}
            {{- ')' }}
        {%- endif %}
        {%- if tool.description %}
            {{- ': ' + tool.description }}
        {%- endif %}
        {%- if not flat %}
            {{- '\\n  parameters: ' + (params | tojson) }}
        {%- endif %}
    {%- endfor %}
    {{- '\\nTo call a tool, reply with:\\n<tool_call>\\n' }}
    {{- '{"name": <tool-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}
            {{- message.content + '\\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
"""vLLM hermes parser's pattern: closed blocks, or an unclosed last block."""


class ChatTemplateError(ValueError):
    """Messages the template cannot render (bad tool-call arguments, unknown shape)."""


def _compiled():
    # Same environment as transformers' apply_chat_template (which vLLM uses): sandboxed,
    # trim/lstrip blocks, and a tojson that does not HTML-escape.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(TOOL_CHAT_TEMPLATE)


_TEMPLATE = None


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as dicts, as vLLM passes them to the template (malformed -> {})."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except json.JSONDecodeError:
                args = {}
        fn["arguments"] = args if args is not None else {}
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False) -> str:
    """The prompt text for OpenAI-shaped `messages` and `tools`, as the engine renders it."""
    global _TEMPLATE
    if _TEMPLATE is None:
        _TEMPLATE = _compiled()
    msgs = [_with_parsed_arguments(dict(m)) for m in messages]
    try:
        return _TEMPLATE.render(messages=msgs, tools=tools or None, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises TypeError/UndefinedError on shapes it cannot render
        roles = [m.get("role") for m in messages]
        raise ChatTemplateError(f"cannot render {len(messages)} messages (roles {roles}): {e}") from e


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) from generated text, as vLLM's hermes parser extracts them.

    Each call is `{"name": str, "arguments": str}` with arguments JSON-encoded (no HTML
    escaping, non-ASCII kept). Content is the text before the first `<tool_call>`,
    stripped, or None when empty. Unparseable blocks: (text, []).
    """
    if "<tool_call>" not in text:
        return text, []
    try:
        calls = []
        for closed, open_ in TOOL_CALL_RE.findall(text):
            obj = json.loads(closed or open_)
            calls.append({"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)})
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []
    content = text[: text.find("<tool_call>")].strip()
    return content or None, calls


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it (what the template renders for an assistant call)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
