"""The HTTP front door the feedback webhook, the gateway and the control API share: reading a
key or token from the headers, the request-body limit, the 422 for an invalid request and
the error envelope.

Each door answers errors in its own shape (`ErrorShape`), one `HttpError` rendered either way:

    "clora"   the webhook and control API:
              {"error": {"code": "invalid_request", "message": "score: ...", "field": "score"}}
    "openai"  the gateway, as OpenAI's clients expect:
              {"error": {"message": "...", "type": "invalid_request_error", "param": "model",
                         "code": "model_not_found"}}

A door calls `install_error_handlers(app, shape)` once; then raising `HttpError` anywhere in a
route answers it. `BodyLimit` refuses an oversized body before a route reads it; `read_body`
does the same from inside a route (the gateway, which authenticates first and counts every
answer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

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


class BodyLimit:
    """ASGI middleware: a 413 in `shape` for a body over `max_bytes`, by Content-Length or by
    counting a chunked body as it arrives. It reads the body before the app runs (at most
    `max_bytes` of it, which the app would hold anyway) and hands it on: a limit hit while a
    route is reading would surface as that route's own parse error, not as a 413. Pure ASGI:
    Starlette's `BaseHTTPMiddleware` would run every request through an extra task and
    response stream."""

    def __init__(self, app, max_bytes: int, shape: ErrorShape, on_error: OnError | None = None):
        self.app, self.max_bytes, self.shape, self.on_error = app, max_bytes, shape, on_error

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
    without FastAPI's leading "body" (`records.3.score`), `default` when it names none."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = ".".join(str(p) for p in first["loc"] if p != "body")
    return field or default, first["msg"]


def invalid_request(errors: list[dict]) -> HttpError:
    """The 422 for a request FastAPI could not validate, naming the first wrong field."""
    field, message = first_error(errors)
    return HttpError(422, "invalid_request", f"{field}: {message}", field)


def install_error_handlers(app: FastAPI, shape: ErrorShape, on_error: OnError | None = None) -> None:
    """Answer `HttpError` and FastAPI's validation errors in `shape`, calling `on_error` with
    each status first."""

    def answer(error: HttpError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return error.response(shape)

    async def http_error(_request: Request, e: HttpError) -> JSONResponse:
        return answer(e)

    async def validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return answer(invalid_request(e.errors()))

    app.add_exception_handler(HttpError, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
