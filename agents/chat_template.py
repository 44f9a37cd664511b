"""The tool-aware chat template as agents use it (defined in `clora.infra.chat_template`,
shared with the learner and the serving engine so the model is trained on what it is served)."""

from clora.infra.chat_template import (TOOL_CALL_RE, TOOL_CHAT_TEMPLATE, ChatTemplateError, parse_tool_calls, render,
                                       tool_call_text)

__all__ = ["TOOL_CALL_RE", "TOOL_CHAT_TEMPLATE", "ChatTemplateError", "parse_tool_calls", "render", "tool_call_text"]
