"""The request fields the gateway accepts, each checked for type and range: the allow-list.

Only a field named here is forwarded to vLLM; any other answers 400 naming it, since vLLM
answers some unknown or odd fields with a 500 and a dropped connection (`structured_outputs`).
`FIELDS` lists the OpenAI fields clora offers plus the few vLLM sampling extras it supports
(`top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `ignore_eos`, `return_token_ids`,
`return_tokens_as_token_ids`, `cache_salt`), per route.

Every value is also walked as JSON (`check_json`): no object or array nests deeper than
`max_depth`, no number is NaN or infinite, no string (or key) holds a lone surrogate — each
of those made the gateway fail to encode what it forwards or records. A field's path names the
exact spot: `tools.0.function.parameters.default`.

`RESPONSES` is the allow-list of `POST /v1/responses` (`clora.serving.responses` translates
the request into a chat completion, which then passes `CHAT`'s checks as well). What the gateway
cannot do statelessly (`previous_response_id`, `conversation`, `store: true`, `background: true`)
or at all (`include` items, a `text.format` other than text, `reasoning`) is refused naming the field.

`prompt` must be one string: a prompt list would be served as one request holding many
sequences (64 prompts answered on one quota slot), so clora refuses it; send one request per
prompt (`n` asks for several completions of one prompt and counts each).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clora.serving.completions import Kind

Check = Callable[[str, Any], None]
"""Raises `Refused(field, message)` for a value the gateway will not forward."""


class Refused(ValueError):
    """A field the gateway refuses: unknown, of the wrong type, or out of range."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class Bounds:
    """The per-request limits `FIELDS` checks against (`settings.TenantLimits` and the record bounds)."""

    max_tokens: int
    n: int
    max_depth: int


def _number(lo: float, hi: float, *, lo_open: bool = False) -> Check:
    def check(field: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise Refused(field, f"must be a finite number, got {v!r}")
        if v < lo or v > hi or (lo_open and v == lo):
            raise Refused(field, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return check


def _integer(lo: int, hi: int) -> Check:
    def check(field: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise Refused(field, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return check


def _boolean(field: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise Refused(field, f"must be true or false, got {v!r}")


def _string(max_len: int) -> Check:
    def check(field: str, v: Any) -> None:
        if not isinstance(v, str) or len(v) > max_len:
            raise Refused(field, f"must be a string of at most {max_len} characters")
    return check


def _stop(field: str, v: Any) -> None:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or len(items) > 4 or not all(isinstance(s, str) and 0 < len(s) <= 256
                                                                 for s in items):
        raise Refused(field, "must be a string or a list of at most 4 non-empty strings (256 characters each)")


def _stream_options(field: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise Refused(field, "must be an object")
    for k, x in v.items():
        if k not in ("include_usage", "continuous_usage_stats"):
            raise Refused(f"{field}.{k}", "is not a stream option clora supports (include_usage, "
                                          "continuous_usage_stats)")
        _boolean(f"{field}.{k}", x)


def _messages(field: str, v: Any) -> None:
    if not isinstance(v, list) or not v:
        raise Refused(field, "must be a non-empty array")  # each message: `recorded_messages`


def _tools(field: str, v: Any) -> None:
    if not isinstance(v, list) or len(v) > 128:
        raise Refused(field, "must be an array of at most 128 tools")
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise Refused(f"{field}.{i}", 'must be {"type": "function", "function": {...}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Refused(f"{field}.{i}.function.name", "must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise Refused(f"{field}.{i}.function.parameters", "must be an object (a JSON schema)")


def _tool_choice(field: str, v: Any) -> None:
    if v in ("none", "auto", "required"):
        return
    fn = v.get("function") if isinstance(v, dict) else None
    if not (isinstance(v, dict) and v.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise Refused(field, 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def _prompt(field: str, v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise Refused(field, "must be one non-empty string: clora serves one prompt per request (send one "
                             "request per prompt; `n` asks for several completions of one)")


def _metadata(field: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise Refused(field, "must be an object")  # its ids: the gateway checks them


def _anything(field: str, v: Any) -> None:
    pass


COMMON: dict[str, Check] = {
    "model": _anything,  # the gateway resolves it
    "stream": _boolean,
    "stream_options": _stream_options,
    "temperature": _number(0, 2),
    "top_p": _number(0, 1, lo_open=True),
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "stop": _stop,
    "seed": _integer(-2**63, 2**63 - 1),
    "user": _string(256),
    "metadata": _metadata,
    # vLLM's sampling extras clora offers
    "top_k": _integer(-1, 1_000_000),
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0, 2, lo_open=True),
    "ignore_eos": _boolean,
    "return_token_ids": _boolean,
    "return_tokens_as_token_ids": _boolean,
    "cache_salt": _string(256),  # replaced by the tenant's own
}
CHAT: dict[str, Check] = {
    **COMMON,
    "messages": _messages,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _boolean,
    "logprobs": _boolean,
    "top_logprobs": _integer(0, 20),
}
COMPLETION: dict[str, Check] = {**COMMON, "prompt": _prompt, "logprobs": _integer(0, 5)}
FIELDS: dict[Kind, dict[str, Check]] = {"chat": CHAT, "completion": COMPLETION}


def _stateless(field: str, v: Any) -> None:
    raise Refused(field, "this gateway keeps no response state; send the whole conversation as input")


def _false_only(why: str) -> Check:
    def check(field: str, v: Any) -> None:
        if v is not False:
            raise Refused(field, f"must be false or absent: {why}")
    return check


def _include(field: str, v: Any) -> None:
    if not isinstance(v, list) or v:
        raise Refused(field, "must be an empty array: clora includes nothing beyond the output")


def _text_format(field: str, v: Any) -> None:
    fmt = v.get("format") if isinstance(v, dict) else None
    if not isinstance(v, dict) or any(k not in ("format", "verbosity") for k in v):
        raise Refused(field, 'must be {"format": {"type": "text"}}')
    if fmt is not None and fmt != {"type": "text"}:
        raise Refused(f"{field}.format", 'only {"type": "text"} is served (structured output is not)')
    if v.get("verbosity") is not None:
        raise Refused(f"{field}.verbosity", "is not supported")


def _reasoning(field: str, v: Any) -> None:
    if not isinstance(v, dict) or any(x is not None for x in v.values()):
        raise Refused(field, "is not supported: clora serves no reasoning models (send null or omit it)")


def _truncation(field: str, v: Any) -> None:
    if v != "disabled":
        raise Refused(field, 'must be "disabled": clora does not truncate a conversation')


def _responses_stream_options(field: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise Refused(field, "must be an object")
    for k, x in v.items():
        if k != "include_obfuscation":
            raise Refused(f"{field}.{k}", "is not a stream option clora supports (include_obfuscation)")
        _boolean(f"{field}.{k}", x)


def _text(field: str, v: Any) -> None:
    if not isinstance(v, str):
        raise Refused(field, "must be a string")


RESPONSES: dict[str, Check] = {
    "model": _anything,
    "input": _anything,  # each item: `clora.serving.responses`
    "instructions": _text,
    "tools": _anything,  # each tool: `clora.serving.responses`
    "tool_choice": _anything,
    "parallel_tool_calls": _boolean,
    "temperature": COMMON["temperature"],
    "top_p": COMMON["top_p"],
    "metadata": _metadata,
    "stream": _boolean,
    "stream_options": _responses_stream_options,
    "user": COMMON["user"],
    "store": _false_only("this gateway keeps no response state"),
    "background": _false_only("clora answers every response while the request is open"),
    "previous_response_id": _stateless,
    "conversation": _stateless,
    "prompt": _stateless,  # a stored prompt template
    "include": _include,
    "text": _text_format,
    "reasoning": _reasoning,
    "truncation": _truncation,
}
"""`POST /v1/responses`'s fields; `max_output_tokens` is checked against `Bounds.max_tokens`."""

GATEWAY_ONLY = ("metadata",)
"""Fields the gateway reads and never forwards."""


def check_fields(body: dict[str, Any], kind: Kind, bounds: Bounds) -> None:
    """Refuse (`Refused`) any field not in `FIELDS[kind]`, any value out of type or range, and
    any value `check_json` refuses. A null value counts as absent."""
    allowed = FIELDS[kind]
    limits = {"max_tokens": _integer(1, bounds.max_tokens), "n": _integer(1, bounds.n),
              "min_tokens": _integer(0, bounds.max_tokens)}
    if kind == "chat":
        limits["max_completion_tokens"] = limits["max_tokens"]
    _check_body(body, allowed, limits, bounds, "/v1/chat/completions" if kind == "chat" else "/v1/completions")


def check_responses_fields(body: dict[str, Any], bounds: Bounds) -> None:
    """`check_fields` for `POST /v1/responses`: refuse any field not in `RESPONSES`, any value
    out of type or range, and any value `check_json` refuses. A null value counts as absent."""
    _check_body(body, RESPONSES, {"max_output_tokens": _integer(1, bounds.max_tokens)}, bounds, "/v1/responses")


def _check_body(body: dict[str, Any], allowed: dict, limits: dict, bounds: Bounds, route: str) -> None:
    """Each field of `body` through `check_json` and its check (`limits` before `allowed`); a
    field in neither is refused as unknown for `route`. A null value counts as absent."""
    for name, value in body.items():
        check_json(name, value, bounds.max_depth)
        check = limits.get(name) or allowed.get(name)
        if check is None:
            raise Refused(name, f"unknown field for {route}; clora accepts {', '.join(sorted({*allowed, *limits}))}")
        if value is not None:
            check(name, value)


def check_json(field: str, value: Any, max_depth: int) -> None:
    """Walk `value` (iteratively: any depth is safe to walk) and refuse nesting deeper than
    `max_depth`, a non-finite number or a string or key holding a lone surrogate."""
    todo: list[tuple[str, Any, int]] = [(field, value, 0)]
    while todo:
        path, v, depth = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise Refused(path, f"must be a finite number, got {v!r}")
        if isinstance(v, str):
            _encodable(path, v)
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise Refused(field, f"nests deeper than {max_depth} levels (at {path})")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _encodable(path, k)
                todo.append((f"{path}.{k}", x, depth + 1))


def _encodable(path: str, s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Refused(path, f"holds a lone surrogate (\\u{ord(s[e.start]):04x}); send valid UTF-16 pairs") from e
