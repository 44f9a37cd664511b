"""The chat template's renderer and tool-call parser, for tests: what vLLM does with
`TOOL_CHAT_TEMPLATE` (render a prompt) and with its `hermes` parser (read tool calls back).

`parse_tool_calls` is equivalent to vLLM's `hermes` parser: every
`<tool_call>(.*?)</tool_call>` block is a JSON `{"name", "arguments"}` object; the text
before the first block is the content; if any block is not valid JSON the whole output is
plain content with no calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

from clora.learner.chat_template import TOOL_CHAT_TEMPLATE

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
