"""Fakes for the agents and infra unit tests: an OpenAI-compatible chat server whose "model"
is a scripted python policy, and a feedback webhook that records what it got. The fixtures
that serve them (`fake_openai`, `openai_client`, `fake_webhook`) are in tests/conftest.py.

The fake server turns the policy's raw text into `tool_calls` with
`tests.chat_template.parse_tool_calls`, as vLLM's hermes parser does behind the
real gateway. Unit tests only: the real gateway and webhook are exercised by the
platform's integration and end-to-end tests.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tests.chat_template import parse_tool_calls
from clora.procs import ServerThread, free_port, port_open  # noqa: F401 - ServerThread: the fixtures' server
from clora.ingest.schemas import FeedbackBatchIn, FeedbackIn

Policy = Callable[[dict[str, Any], int], str]
"""(request body, choice index) -> the text the model generates."""


class FakeOpenAI:
    """`POST /v1/chat/completions` answered by `policy`; every request body is kept in `requests`."""

    def __init__(self):
        self.policy: Policy = lambda body, i: "I don't know."
        self.requests: list[dict[str, Any]] = []
        self.response_ids: list[str] = []
        self.fail_next: int = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._complete)

    async def _complete(self, request: Request):
        body = await request.json()
        with self._lock:
            self.requests.append(body)
            rid = f"chatcmpl-{next(self._ids)}"
            self.response_ids.append(rid)
            if self.fail_next:
                self.fail_next -= 1
                return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}},
                                    status_code=400)
        choices = []
        for i in range(int(body.get("n") or 1)):
            text = self.policy(body, i)
            content, calls = parse_tool_calls(text) if body.get("tools") else (text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"id": f"call-{rid}-{i}-{k}", "type": "function", "function": c}
                                         for k, c in enumerate(calls)]
            choices.append({"index": i, "message": message, "logprobs": None,
                            "finish_reason": "tool_calls" if calls else "stop"})
        usage = {"prompt_tokens": 10, "completion_tokens": 5 * len(choices), "total_tokens": 10 + 5 * len(choices)}
        return {"id": rid, "object": "chat.completion", "created": 0, "model": body["model"], "choices": choices,
                "usage": usage}


class FakeWebhook:
    """`POST /v1/feedback[/batch]`: answers the statuses queued in `script` first (503 with
    Retry-After), then validates like the real webhook and records accepted records."""

    def __init__(self, api_key: str = "key-1"):
        self.api_key = api_key
        self.script: list[int] = []
        self.attempts: list[dict[str, Any]] = []
        """Every request body, accepted or not, in arrival order."""
        self.accepted: list[FeedbackIn] = []
        self._lock = threading.Lock()
        self.app = FastAPI()
        self.app.post("/v1/feedback")(self._one)
        self.app.post("/v1/feedback/batch")(self._batch)

    def _gate(self, request: Request, body: dict[str, Any]) -> JSONResponse | None:
        with self._lock:
            self.attempts.append(body)
            status = self.script.pop(0) if self.script else None
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": {"code": "unauthorized", "message": "bad API key"}}, status_code=401)
        if status == 503:
            return JSONResponse({"error": {"code": "broker_unavailable", "message": "retry"}}, status_code=503,
                                headers={"Retry-After": "0"})
        if status is not None:
            return JSONResponse({"error": {"code": "scripted", "message": f"scripted {status}"}}, status_code=status)
        return None

    def _accept(self, records: list[FeedbackIn]) -> JSONResponse:
        with self._lock:
            known = {r.event_id for r in self.accepted}
            self.accepted += [r for r in records if r.event_id not in known]
        return JSONResponse({"accepted": len(records), "event_ids": [r.event_id for r in records]}, status_code=202)

    async def _one(self, request: Request):
        body = await request.json()
        if (early := self._gate(request, body)) is not None:
            return early
        try:
            return self._accept([FeedbackIn.model_validate(body)])
        except ValidationError as e:
            return JSONResponse({"error": {"code": "invalid_request", "message": str(e), "field": "body"}},
                                status_code=422)

    async def _batch(self, request: Request):
        body = await request.json()
        if (early := self._gate(request, body)) is not None:
            return early
        try:
            return self._accept(FeedbackBatchIn.model_validate(body).records)
        except ValidationError as e:
            return JSONResponse({"error": {"code": "invalid_request", "message": str(e), "field": "records"}},
                                status_code=422)


def as_text(message: dict[str, Any]) -> str:
    """An assistant message as the model would write it (hermes tool-call text)."""
    import json

    from tests.chat_template import tool_call_text

    parts = [message["content"]] if message.get("content") else []
    parts += [tool_call_text(c["function"]["name"], json.loads(c["function"]["arguments"]))
              for c in message.get("tool_calls") or []]
    return "\n".join(parts)


def oracle(env, problems) -> Policy:
    """A policy that always writes what the environment's operator would correct to."""
    by_key = {p.key: p for p in problems}

    def policy(body: dict[str, Any], i: int) -> str:
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        return as_text(env.correction(by_key[user], body["messages"]))

    return policy
