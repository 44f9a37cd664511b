"""The errors the gateway answers, as `clora.web.HttpError`s in OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}

Routing errors too (`route_error`): an unknown path is 404 `unknown_url`, a known path asked with
the wrong method 405 `method_not_allowed` (with its `Allow` header), as OpenAI answers them.
"""

from __future__ import annotations

from collections.abc import Mapping

from clora.web import ErrorShape, HttpError

SHAPE: ErrorShape = "openai"
"""The gateway's error shape (`clora.web.ErrorShape`)."""


def invalid_api_key() -> HttpError:
    return HttpError(401, "invalid_api_key", "Incorrect API key provided.")


def model_not_found(model: str) -> HttpError:
    # The same answer for another tenant's model as for one that does not exist (no oracle).
    return HttpError(404, "model_not_found", f"The model `{model}` does not exist or you do not have access to it.",
                     "model")


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, "invalid_value" if param else None, message, param)


def rate_limited(message: str, retry_after_s: float) -> HttpError:
    return HttpError(429, "rate_limit_exceeded", message, type="requests",
                     headers={"retry-after": str(max(1, round(retry_after_s)))})


def unavailable(message: str) -> HttpError:
    return HttpError(503, "engine_unavailable", message, type="server_error", headers={"retry-after": "1"})


def timeout(seconds: float) -> HttpError:
    return HttpError(504, "timeout", f"engine did not answer within {seconds} s", type="server_error")


def route_error(method: str, path: str, status: int, detail: str, headers: Mapping[str, str] | None) -> HttpError:
    """The router's own refusal (Starlette's `HTTPException`: no such route, the wrong method) in
    the gateway's shape, keeping its headers (`Allow` for a 405)."""
    if status == 404:
        code, message = "unknown_url", f"Invalid URL ({method} {path})"
    elif status == 405:
        code, message = "method_not_allowed", f"Method {method} is not allowed on {path}"
    else:
        code, message = None, str(detail)
    return HttpError(status, code, message, type="server_error" if status >= 500 else None,
                     headers=dict(headers) if headers else None)
