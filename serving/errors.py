"""Errors the gateway answers, in OpenAI's JSON shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error answered to the client with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


def model_not_found(model: str) -> ApiError:
    # The same answer for another tenant's model as for one that does not exist (no oracle).
    return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    code="model_not_found", param="model")


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, code="invalid_value" if param else None, param=param)


def rate_limited(message: str, retry_after_s: float) -> ApiError:
    return ApiError(429, message, type="requests", code="rate_limit_exceeded",
                    headers={"retry-after": str(max(1, round(retry_after_s)))})


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="engine_unavailable", headers={"retry-after": "1"})


async def handle_api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
