"""The HTTP front door the feedback webhook, the gateway, the control API and the Tinker training
API share: reading a key or token from the headers, the request-body limit, string fields that
must encode (`Utf8Str`), the 422 for an invalid request and the error envelope.

Each door answers errors in its own shape (`ErrorShape`), one `HttpError` rendered either way:

    "clora"   the webhook and control API:
              {"error": {"code": "invalid_request", "message": "score: ...", "field": "score"}}
    "openai"  the gateway, as OpenAI's clients expect:
              {"error": {"message": "...", "type": "invalid_request_error", "param": "model",
                         "code": "model_not_found"}}

A door calls `install_error_handlers(app, shape)` once; then raising `HttpError` anywhere in a
route answers it, and so do FastAPI's own refusals: a request it cannot validate (422 naming the
field), a path no route serves (404 `not_found`), a method the path does not take (405
`method_not_allowed`, with `Allow`) and a body it cannot parse (400) — never FastAPI's
`{"detail": ...}`. `BodyLimit` refuses an oversized body before a route reads it, and, given
`max_depth`, a body nested deeper than that (`too_deep`); `read_body` does the size check from
inside a route (the gateway, which authenticates first and counts every answer).

`MAX_JSON_DEPTH` is the one nesting bound for what a client sends, below every parser that reads
it later: Python's `json` gives up at about 1000 levels less the caller's stack (RecursionError),
orjson at 1024, Redis Lua's cjson at 1000, and pydantic-core's JSON parser, which reads events
back off the topics (`model_validate_json`), at 200 — with an event's own envelope on top.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator
from starlette.exceptions import HTTPException as StarletteHTTPException

ErrorShape = Literal["clora", "openai"]

OnError = Callable[[int], None]
"""Called with the status of every error a door answers (e.g. to count it in a metric)."""


class HttpError(Exception):
    """An error answered to the client: an HTTP status, a machine-readable `code`, a message
    for people and, when one input was wrong, the `field` that was. `type` is OpenAI's error
    type (the "openai" shape only; default "invalid_request_error")."""

    def __init__(self, status: int, code: str | None, message: str, field: str | None = None, *,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.type, self.headers = type, headers

    def body(self, shape: ErrorShape) -> dict[str, Any]:
        if shape == "openai":
            return {"error": {"message": self.message, "type": self.type or "invalid_request_error",
                              "param": self.field, "code": self.code}}
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}

    def response(self, shape: ErrorShape) -> JSONResponse:
        return JSONResponse(self.body(shape), status_code=self.status, headers=self.headers)


# --- credentials ------------------------------------------------------------------------------

def bearer_token(headers: Mapping[str, str]) -> str:
    """The token of `Authorization: Bearer <token>` (the scheme in any case), '' without one."""
    header = headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def api_key(headers: Mapping[str, str]) -> str:
    """A tenant API key sent as `Authorization: Bearer <key>` or, without an Authorization
    bearer, as `X-Api-Key: <key>`; '' without either."""
    header = headers.get("authorization", "")
    return bearer_token(headers) if header[:7].lower() == "bearer " else headers.get("x-api-key", "")


# --- request bodies ---------------------------------------------------------------------------

def encodable(text: str) -> str:
    """`text` if it is valid Unicode, else ValueError: JSON may escape a lone surrogate
    (`"\\ud800"`), which Python decodes but cannot encode as UTF-8 (a Redis key, say)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate at character {e.start}: not valid Unicode") from e
    return text


Utf8Str = Annotated[str, AfterValidator(encodable)]
"""A body's string field that goes on as UTF-8 (a Redis key, another service's request): a lone
surrogate in it is a 422 naming the field."""


def body_too_large(max_bytes: int, size: int | None = None) -> HttpError:
    """The 413 for a body over `max_bytes` (`size`: its declared length, when it had one)."""
    what = "request body" if size is None else f"request body of {size} bytes"
    return HttpError(413, "request_too_large", f"{what} exceeds the limit of {max_bytes} bytes")


def declared_too_large(headers: Mapping[str, str], max_bytes: int) -> HttpError | None:
    """The 413 for a Content-Length over `max_bytes`, None when it is within (or absent)."""
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        return body_too_large(max_bytes, int(length))
    return None


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or `body_too_large` as soon as its declared length or the bytes streamed
    so far pass `max_bytes` (a chunked body is never read past the limit)."""
    refused = declared_too_large(request.headers, max_bytes)
    if refused is not None:
        raise refused
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a client may send, in a body or in a JSON string
field such as a tool call's `arguments` (module docstring: the parsers downstream)."""

_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_STRINGS = re.compile(_STRING.encode())
_TOKENS = re.compile(rf'({_STRING})(\s*:)?|[\[\]{{}},]')
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")   # +1 / -1 as signed bytes
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def too_deep(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> list[str | int] | None:
    """Where `text` (JSON, or JSON-like) nests arrays and objects deeper than `max_depth`: the
    path of the first value that does, as keys and indices (`too_deep('{"a": [[1]]}', 2)` is
    `["a", 0]`), or None when it does not. Strings are skipped, so brackets inside them do not
    count; text that is not JSON is measured by its brackets all the same, up to a closing bracket
    with nothing open (where any parser stops). Never recursive; the depth is summed at C speed,
    and only text that does nest too deep is walked token by token to name where."""
    raw = text.encode() if isinstance(text, str) else text
    steps = array("b", _STRINGS.sub(b"", raw).translate(_STEP, _NOT_BRACKETS))
    if not steps or max(accumulate(steps)) <= max_depth:
        return None
    levels = list(accumulate(steps))   # the depth after each bracket
    crossed = levels.index(max_depth + 1)
    if crossed and min(levels[:crossed]) < 0:
        return None
    frames: list[list] = []   # per open container: [is_array, the key or index inside it]
    for m in _TOKENS.finditer(raw.decode(errors="replace")):
        token = m.group(0)
        if m.group(1) is not None:
            if m.group(2) and frames and not frames[-1][0]:
                try:
                    frames[-1][1] = json.loads(m.group(1))
                except ValueError:
                    frames[-1][1] = m.group(1)[1:-1]
        elif token in "[{":
            frames.append([token == "[", 0 if token == "[" else ""])
            if len(frames) > max_depth:
                return [f[1] for f in frames[:-1]]
        elif token in "]}":
            frames.pop()
        elif frames and frames[-1][0]:   # a comma in an array
            frames[-1][1] += 1
    raise AssertionError("unreachable: the brackets' sums said the text nests too deep")


def nested_too_deep(path: list[str | int], max_depth: int = MAX_JSON_DEPTH, *, within: str = "") -> HttpError:
    """The 422 for a body (or the JSON string field `within`) nesting deeper than `max_depth`,
    naming where."""
    field = ".".join(str(p) for p in ([within] if within else []) + path) or within or "body"
    return HttpError(422, "too_deeply_nested", f"{field}: nests arrays and objects deeper than {max_depth} levels",
                     field)


class BodyLimit:
    """ASGI middleware: a 413 in `shape` for a body over `max_bytes`, by Content-Length or by
    counting a chunked body as it arrives. It reads the body before the app runs (at most
    `max_bytes` of it, which the app would hold anyway) and hands it on: a limit hit while a
    route is reading would surface as that route's own parse error, not as a 413. Pure ASGI:
    Starlette's `BaseHTTPMiddleware` would run every request through an extra task and
    response stream. With `max_depth`, a body nesting deeper answers 422 naming where
    (`too_deep`), before any parser recurses into it."""

    def __init__(self, app, max_bytes: int, shape: ErrorShape, on_error: OnError | None = None,
                 max_depth: int | None = None):
        self.app, self.max_bytes, self.shape, self.on_error = app, max_bytes, shape, on_error
        self.max_depth = max_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        refused = declared_too_large(headers, self.max_bytes)
        if refused is not None:
            return await self._answer(refused, scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":   # the client left
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._answer(body_too_large(self.max_bytes), scope, receive, send)
            if not message.get("more_body", False):
                break
        if self.max_depth is not None:
            body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
            path = too_deep(body, self.max_depth)
            if path is not None:
                return await self._answer(nested_too_deep(path, self.max_depth), scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _answer(self, error: HttpError, scope, receive, send) -> None:
        if self.on_error is not None:
            self.on_error(error.status)
        await error.response(self.shape)(scope, receive, send)


# --- error handlers ---------------------------------------------------------------------------

def first_error(errors: list[dict], *, default: str = "body") -> tuple[str, str]:
    """(field, message) of the first of pydantic's `errors()`: the field as a dotted path
    without FastAPI's leading "body" (`records.3.score`), `default` when it names none. A body
    that is not JSON names `default` (FastAPI's location is then the character it failed at)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return default, f"not valid JSON at character {first['loc'][-1]}: {reason}"
    field = ".".join(str(p) for p in first["loc"] if p != "body")
    return field or default, first["msg"]


def invalid_request(errors: list[dict]) -> HttpError:
    """The 422 for a request FastAPI could not validate, naming the first wrong field."""
    field, message = first_error(errors)
    return HttpError(422, "invalid_request", f"{field}: {message}", field)


def routing_error(e: StarletteHTTPException, method: str, path: str) -> HttpError:
    """The `HttpError` for an error Starlette or FastAPI raised outside any route's own code: no
    route for the path (404 `not_found`), not with this method (405 `method_not_allowed`, keeping
    `Allow`), a body FastAPI could not parse (400, naming `body`); another status keeps its detail
    under `http_error`. The wrong part of a route error is the request's `path`."""
    where = f"{method} {path[:200]}"
    if e.status_code == 404:
        return HttpError(404, "not_found", f"{where}: no such route or file", "path", headers=e.headers)
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return HttpError(405, "method_not_allowed", f"{where}: the path does not take {method}"
                         + (f" (allowed: {allowed})" if allowed else ""), "path", headers=e.headers)
    if e.status_code == 400:   # not UTF-8, or nested past Python's recursion limit
        return HttpError(400, "invalid_request", f"body: {e.detail}", "body", headers=e.headers)
    return HttpError(e.status_code, "http_error", f"{where}: {e.detail}", headers=e.headers)


def install_error_handlers(app: FastAPI, shape: ErrorShape, on_error: OnError | None = None) -> None:
    """Answer `HttpError`, FastAPI's validation errors and its routing errors (`routing_error`)
    in `shape`, calling `on_error` with each status first."""

    def answer(error: HttpError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return error.response(shape)

    async def http_error(_request: Request, e: HttpError) -> JSONResponse:
        return answer(e)

    async def validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return answer(invalid_request(e.errors()))

    async def starlette_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return answer(routing_error(e, request.method, request.url.path))

    app.add_exception_handler(HttpError, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, starlette_error)
