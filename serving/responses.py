"""`POST /v1/responses`, OpenAI's Responses API, served as a chat completion: the request is
translated into a `/v1/chat/completions` body (`to_chat`), which the gateway serves, records,
routes, pins and counts exactly as it serves a chat completion; the answer is translated back
into a `response` object (`whole`), or, streamed, into the Responses API's server-sent events
(`EventStream`).

The gateway keeps no response state: `previous_response_id`, `conversation`, `store: true` and
`background: true` are refused (400 naming the field, `request_fields.RESPONSES`); a client sends
the whole conversation as `input`, as the OpenAI Agents SDK does by default.

Worked example. This request

    {"model": "acme", "instructions": "Be brief.", "max_output_tokens": 50,
     "tools": [{"type": "function", "name": "get_weather", "parameters": {...}}],
     "input": [{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}

is served as the chat completion

    {"model": "acme", "max_tokens": 50,
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}],
     "messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}

and its answer (message content, tool calls parsed by vLLM's tool parser, as on the chat path)
comes back as `output` items: a `message` with one `output_text` part, then one `function_call`
item per tool call (`call_id` is the chat tool call's id). The response `id` (`resp_<hex>`) is
the recorded interaction's id, so feedback on it joins the interaction.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from clora.ids import RESPONSE_ID_PREFIXES
from clora.serving.request_fields import Bounds, Refused, check_responses_fields

KIND = "responses"
"""The route's label in the gateway's metrics."""
ID_PREFIX = RESPONSE_ID_PREFIXES["responses"]

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
"""Input message roles and the chat role each is served as (`developer` is OpenAI's newer name
for the system role; chat templates know only `system`)."""
TEXT_PARTS = ("input_text", "output_text")
"""Content parts clora serves: a user's text, and an assistant's text from an earlier turn."""
CHAT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "max_output_tokens": "max_tokens",
               "parallel_tool_calls": "parallel_tool_calls", "metadata": "metadata", "user": "user",
               "stream": "stream"}
"""Responses fields that go over to the chat body as they are, under the chat name."""


@dataclass(frozen=True)
class Translated:
    """A Responses request and the chat completion body it is served as."""

    request: dict[str, Any]
    chat: dict[str, Any]
    sources: list[str]
    """Per chat message, the Responses field it came from: `["instructions", "input.0", "input.1"]`
    (a run of function calls is one assistant message, named by its first item)."""

    def param(self, chat_field: str) -> str:
        """The Responses name of a chat body's field, as the gateway's checks name it:
        `messages.2.content` -> `input.1`, `tools.0.function.name` -> `tools.0.name`,
        `max_tokens` -> `max_output_tokens`."""
        parts = chat_field.split(".")
        if parts[0] == "messages":
            if len(parts) > 1 and parts[1].isdigit() and int(parts[1]) < len(self.sources):
                return self.sources[int(parts[1])]
            return "input"
        if parts[0] == "tools" and len(parts) > 2 and parts[2] == "function":
            return ".".join(parts[:2] + parts[3:])
        if parts[0] == "max_tokens":
            return "max_output_tokens"
        return chat_field

    def renamed(self, message: str, chat_field: str) -> tuple[str, str]:
        """(message, param) of a chat check's refusal, with the Responses field's name."""
        param = self.param(chat_field)
        if message.startswith(chat_field):
            message = param + message[len(chat_field):]
        return message, param


# --- the request ------------------------------------------------------------------------------

def to_chat(body: dict[str, Any], bounds: Bounds) -> Translated:
    """The chat completion body `body` is served as. Raises `Refused` naming the Responses field
    for anything clora does not serve or cannot read."""
    check_responses_fields(body, bounds)
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": body["instructions"]})
        sources.append("instructions")
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        sources.append("input")
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            _add_item(f"input.{i}", item, messages, sources)
    else:
        raise Refused("input", "must be a string or a non-empty array of input items")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("tools") is not None and (tools := _tools(body["tools"])):  # none: as if absent (vLLM refuses [])
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for name, chat_name in CHAT_FIELDS.items():
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # the usage `response.completed` carries
    return Translated(body, chat, sources)


def _add_item(path: str, item: Any, messages: list[dict[str, Any]], sources: list[str]) -> None:
    if not isinstance(item, dict):
        raise Refused(path, "must be an input item object (a message, function_call or function_call_output)")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise Refused(f"{path}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        messages.append({"role": ROLES[role], "content": _content(f"{path}.content", item.get("content"))})
        sources.append(path)
    elif kind == "function_call":
        call = {"id": _name(f"{path}.call_id", item.get("call_id")), "type": "function",
                "function": {"name": _name(f"{path}.name", item.get("name")),
                             "arguments": _string(f"{path}.arguments", item.get("arguments"))}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the calls of one turn: one message
            last.setdefault("tool_calls", []).append(call)
            if last["content"] == "":
                last["content"] = None
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            sources.append(path)
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _name(f"{path}.call_id", item.get("call_id")),
                         "content": _content(f"{path}.output", item.get("output"))})
        sources.append(path)
    else:
        raise Refused(f"{path}.type", f"{kind!r} items are not served: clora takes message, function_call and "
                                      "function_call_output items (it keeps no state to refer to)")


def _content(path: str, content: Any) -> str:
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Refused(path, "must be a string or an array of input_text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise Refused(f"{path}.{j}.type", f"clora serves text only: a part must be input_text or output_text, "
                                              f"got {kind!r}")
        texts.append(_string(f"{path}.{j}.text", part.get("text")))
    return "".join(texts)


def _string(path: str, v: Any) -> str:
    if not isinstance(v, str):
        raise Refused(path, "must be a string")
    return v


def _name(path: str, v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > 256:
        raise Refused(path, "must be a non-empty string of at most 256 characters")
    return v


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools as chat tools."""
    if not isinstance(tools, list) or len(tools) > 128:
        raise Refused("tools", "must be an array of at most 128 tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise Refused(f"tools.{i}", 'must be {"type": "function", "name": ..., "parameters": {...}}')
        if t.get("type") != "function":
            raise Refused(f"tools.{i}.type", f"{t.get('type')!r} tools are not served: clora serves function tools "
                                             "only (built-in tools such as web_search run on OpenAI's side)")
        fn: dict[str, Any] = {"name": _name(f"tools.{i}.name", t.get("name"))}
        if t.get("description") is not None:
            fn["description"] = _string(f"tools.{i}.description", t["description"])
        if t.get("parameters") is not None:
            if not isinstance(t["parameters"], dict):
                raise Refused(f"tools.{i}.parameters", "must be an object (a JSON schema)")
            fn["parameters"] = t["parameters"]
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise Refused(f"tools.{i}.strict", "must be true or false")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    if v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function":
        return {"type": "function", "function": {"name": _name("tool_choice.name", v.get("name"))}}
    raise Refused("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')


# --- the answer -------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(request: dict[str, Any], rid: str, model: str, created_at: int, *, status: str,
                    output: list[dict[str, Any]], used: dict[str, Any] | None = None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """The `response` object: what was asked (echoed as OpenAI does), `output` and `usage`.
    A completion cut at `max_output_tokens` is `incomplete`, as OpenAI's is."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    return {"id": rid, "object": "response", "created_at": created_at, "status": status, "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
            "metadata": request.get("metadata") or {}, "model": model, "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls") is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": request.get("temperature"), "text": {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice") or "auto", "tools": request.get("tools") or [],
            "top_p": request.get("top_p"), "truncation": "disabled", "usage": used, "user": request.get("user")}


def _message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": "msg_" + rid.removeprefix(ID_PREFIX), "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(rid: str, index: int, call_id: str | None, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{rid.removeprefix(ID_PREFIX)}_{index}", "type": "function_call", "status": status,
            "call_id": call_id or f"call_{rid.removeprefix(ID_PREFIX)}_{index}", "name": name, "arguments": arguments}


def whole(tr: Translated, rid: str, completion: dict[str, Any]) -> dict[str, Any]:
    """The `response` object for a whole chat completion (as the gateway gives it to a client)."""
    choice = completion["choices"][0]
    message, finish = choice.get("message") or {}, choice.get("finish_reason")
    item_status = "incomplete" if finish == "length" else "completed"
    calls = message.get("tool_calls") or []
    output = []
    if message.get("content") or not calls:
        output.append(_message_item(rid, message.get("content") or "", item_status))
    for i, tc in enumerate(calls):
        output.append(_call_item(rid, i, tc.get("id"), tc["function"]["name"], tc["function"].get("arguments") or "",
                                 "completed"))
    u = completion.get("usage") or {}
    return response_object(tr.request, rid, completion["model"], int(completion.get("created") or time.time()),
                           status="completed", output=output, finish_reason=finish,
                           used=usage(u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0))


@dataclass
class _Open:
    """The output item being streamed: a message (`call` None) or the function call of chat
    tool call index `call`."""

    index: int
    item: dict[str, Any]
    call: int | None = None
    text: list[str] = field(default_factory=list)


class EventStream:
    """Chat completion chunks in, the Responses API's server-sent events out, each with its
    `sequence_number`: `response.created`, `response.in_progress`, then per output item
    `response.output_item.added`, (a message) `response.content_part.added`,
    `response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`
    or (a function call) `response.function_call_arguments.delta`...,
    `response.function_call_arguments.done`, then `response.output_item.done`; last
    `response.completed` (`response.incomplete` when cut at `max_output_tokens`, and
    `response.failed` when the generation failed)."""

    def __init__(self, tr: Translated, rid: str, model: str):
        self.tr, self.rid, self.model = tr, rid, model
        self.created_at = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.finish_reason: str | None = None
        self.used: dict[str, Any] | None = None
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def _response(self, status: str) -> dict[str, Any]:
        return response_object(self.tr.request, self.rid, self.model, self.created_at, status=status,
                               output=list(self.output), used=self.used, finish_reason=self.finish_reason)

    def opening(self) -> bytes:
        return (self._event("response.created", response=self._response("in_progress"))
                + self._event("response.in_progress", response=self._response("in_progress")))

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """One chat chunk's events (b"" for a chunk that adds nothing)."""
        out = b""
        if obj.get("usage"):
            u = obj["usage"]
            self.used = usage(u.get("prompt_tokens") or 0, u.get("completion_tokens") or 0)
        for c in obj.get("choices") or []:
            delta = c.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for tc in delta.get("tool_calls") or []:
                out += self._call(tc)
            if c.get("finish_reason"):
                self.finish_reason = c["finish_reason"]
        return out

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open.call is not None:
            out += self._close()
            item = _message_item(self.rid, "", "in_progress")
            item["content"] = []
            out += self._add(item)
            out += self._event("response.content_part.added", item_id=item["id"], output_index=self.open.index,
                               content_index=0, part=_text_part(""))
        if not text:
            return out
        self.open.text.append(text)
        return out + self._event("response.output_text.delta", item_id=self.open.item["id"],
                                 output_index=self.open.index, content_index=0, delta=text, logprobs=[])

    def _call(self, tc: dict[str, Any]) -> bytes:
        out = b""
        index, fn = tc.get("index", 0), tc.get("function") or {}
        if self.open is None or self.open.call != index:
            out += self._close()
            out += self._add(_call_item(self.rid, index, tc.get("id"), fn.get("name") or "", "", "in_progress"),
                             call=index)
        elif fn.get("name"):
            self.open.item["name"] += fn["name"]
        if fn.get("arguments"):
            self.open.text.append(fn["arguments"])
            out += self._event("response.function_call_arguments.delta", item_id=self.open.item["id"],
                               output_index=self.open.index, delta=fn["arguments"])
        return out

    def _add(self, item: dict[str, Any], call: int | None = None) -> bytes:
        self.open = _Open(len(self.output), item, call)
        self.output.append(item)
        return self._event("response.output_item.added", output_index=self.open.index, item=dict(item))

    def _close(self) -> bytes:
        """The events that end the open item (b"" with none open)."""
        o, self.open = self.open, None
        if o is None:
            return b""
        text = "".join(o.text)
        if o.call is None:
            status = "incomplete" if self.finish_reason == "length" else "completed"
            part = _text_part(text)
            o.item.update(status=status, content=[part])
            out = (self._event("response.output_text.done", item_id=o.item["id"], output_index=o.index,
                               content_index=0, text=text, logprobs=[])
                   + self._event("response.content_part.done", item_id=o.item["id"], output_index=o.index,
                                 content_index=0, part=part))
        else:
            o.item.update(status="completed", arguments=text)
            out = self._event("response.function_call_arguments.done", item_id=o.item["id"], output_index=o.index,
                              name=o.item["name"], arguments=text)
        return out + self._event("response.output_item.done", output_index=o.index, item=dict(o.item))

    def done(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The end of a generation: the open item's end and the terminal event. The token counts
        stand in for a usage chunk the engine did not send."""
        if self.ended:
            return b""
        self.ended = True
        out = self._close()
        if not self.output:  # nothing generated: an empty message, as a whole response has
            out += self._text("") + self._close()
        if self.used is None:
            self.used = usage(prompt_tokens, completion_tokens)
        response = self._response("completed")
        return out + self._event(f"response.{response['status']}", response=response)

    def error(self, error: dict[str, Any], status: int) -> bytes:
        """`response.failed` for a generation that failed mid-stream (`error` in OpenAI's shape)."""
        if self.ended:
            return b""
        self.ended = True
        response = self._response("failed")
        response["error"] = {"code": "server_error" if status >= 500 else "invalid_prompt",
                             "message": str(error.get("message") or "the generation failed")}
        return self._event("response.failed", response=response)
