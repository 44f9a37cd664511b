"""A gateway in one process against a fake vLLM (httpx mock transport), a fake registry and
a fake broker: the real `Gateway`, `EngineManager` (leases, pins), `TenantQuota` and
`InteractionLogger`, no replica processes. Requests go through the ASGI app itself, so that a
test can also hang up mid-stream (`Harness.call(..., disconnect_after=1)`)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import httpx

from clora.ids import choice_ids
from clora.registry import AdapterVersion, ApiKeyPrincipal
from clora.serving.aliases import AdapterRef
from clora.serving.canary import FALLBACK_PROMPT
from clora.serving.engine import EngineManager
from clora.serving.gateway import Gateway, create_app
from clora.serving.interactions import InteractionLogger
from clora.serving.quota_store import QuotaStore
from clora.serving.settings import EngineSettings, GatewaySettings
from clora.serving.spool import DiskSpool

LIVE = 2
"""Each tenant's live version; `tenant@v1` is an older, pinned one."""


class FakeRegistry:
    """Keys `clk_<tenant>`; every tenant has versions 1 and 2."""

    def authenticate(self, key: str) -> ApiKeyPrincipal | None:
        return ApiKeyPrincipal(tenant=key[4:], key_id="k") if key.startswith("clk_") else None

    def claim_response(self, response_id: str, tenant: str, choices: int) -> list[str]:
        return choice_ids(response_id, choices)

    def adapter_version(self, tenant: str, version: int) -> AdapterVersion:
        return AdapterVersion(version=version, path=f"/adapters/{tenant}/v{version}", base_model="tiny")

    def claim_first_served(self, tenant: str, version: int, at: float) -> bool:
        return False  # as if another gateway had served it first: nothing to measure here


@dataclass
class FakeSwapper:
    """Every tenant's alias on version `live`; `reconcile` reads it again from `registry_live`
    (the registry's live version, which a test moves on)."""

    live: int = LIVE
    registry_live: int | None = None
    reconciled: list[str] = field(default_factory=list)

    async def live_ref(self, tenant: str) -> AdapterRef:
        return AdapterRef(tenant, self.live, f"/adapters/{tenant}/v{self.live}")

    async def reconcile(self, tenant: str) -> None:
        self.reconciled.append(tenant)
        if self.registry_live is not None:
            self.live = self.registry_live


class FakeFuture:
    def __init__(self, get: Callable[[], None]):
        self._get = get

    def get(self, timeout: float | None = None) -> None:
        self._get()


@dataclass
class FakeProducer:
    """Acknowledges each record after `ack_delay_s` (the broker's round trip)."""

    ack_delay_s: float = 0.0
    acked: list[tuple[str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, topic: str, key: str, value: str) -> FakeFuture:
        def get() -> None:
            time.sleep(self.ack_delay_s)
            with self.lock:
                self.acked.append((topic, key, value))
        return FakeFuture(get)

    def close(self) -> None:
        pass

    def interaction_ids(self) -> list[str]:
        with self.lock:
            return [json.loads(v)["interaction_id"] for _, _, v in self.acked]


def chat_response(body: dict[str, Any]) -> dict[str, Any]:
    n = body.get("n") or 1
    return {"id": "x", "object": "chat.completion", "model": body["model"], "prompt_token_ids": [1, 2],
            "choices": [{"index": i, "message": {"role": "assistant", "content": "ok"}, "token_ids": [5, 6],
                         "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}, "finish_reason": "stop"}
                        for i in range(n)],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}


def completion_response(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "x", "object": "text_completion", "model": body["model"], "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "text": "ok", "token_ids": [5, 6], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.1, -0.2]}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}


STREAM = [{"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [1],
                                   "logprobs": {"content": [{"logprob": -0.1}]}}], "prompt_token_ids": [7]},
          {"id": "x", "choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [2],
                                   "logprobs": {"content": [{"logprob": -0.2}]}, "finish_reason": "stop"}]}]


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def canary_request(request: httpx.Request, prompts: tuple[list[int], ...] = (FALLBACK_PROMPT,)) -> dict[str, Any] | None:
    """The body of the engine's canary request (`Replica.prompt_logprobs`) for one of `prompts`
    (default: the one a version without a canary gets), None for any other request."""
    if request.url.path != "/v1/completions":
        return None
    body = json.loads(request.read())
    return body if "prompt_logprobs" in body and body.get("prompt") in prompts else None


def canary_response(body: dict[str, Any], logprob: float = -1.0) -> httpx.Response:
    """vLLM's answer to a canary request: each prompt token after the first at `logprob`."""
    ids = body["prompt"]
    return httpx.Response(200, json={
        "id": "c", "object": "text_completion", "model": body["model"],
        "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                     "prompt_logprobs": [None] + [{str(t): {"logprob": logprob, "rank": 1}} for t in ids[1:]]}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}})


def default_vllm(request: httpx.Request) -> httpx.Response:
    """A healthy vLLM: adapter calls and /health answer 200, completions answer `chat_response`."""
    if request.url.path in ("/health", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        return httpx.Response(200, text="ok")
    body = json.loads(request.read())
    if body.get("stream"):
        return httpx.Response(200, content=sse(STREAM), headers={"content-type": "text/event-stream"})
    make = chat_response if request.url.path.endswith("/chat/completions") else completion_response
    return httpx.Response(200, json=make(body))


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error_param(self) -> str | None:
        return self.json()["error"]["param"]


class Harness:
    def __init__(self, tmp_path: Path, vllm: Callable[[httpx.Request], Any] = default_vllm, *,
                 producer: FakeProducer | None = None, engine: dict[str, Any] | None = None,
                 quota_store: QuotaStore | None = None, swapper: FakeSwapper | None = None, **gateway: Any):
        """`quota_store`: where the quotas count (Redis, shared with other harnesses; default:
        this gateway's memory)."""
        self.upstream: list[tuple[str, dict[str, Any], httpx.Headers]] = []

        def handler(request: httpx.Request):
            if (canary := canary_request(request)) is not None:   # the load's canary: not a client's request
                return canary_response(canary)
            if request.url.path.startswith("/v1/") and "completions" in request.url.path:
                self.upstream.append((request.url.path, json.loads(request.read()), request.headers))
            return vllm(request)

        es = EngineSettings(**{"model": str(tmp_path), "ports": [1], "max_cpu_loras": 4, "base_via_zero_adapter": False,
                               "log_dir": tmp_path, **(engine or {})})
        self.settings = GatewaySettings(spool_dir=tmp_path / "spool", **gateway)
        self.engine = EngineManager(es, adapter_wait_s=0.5)
        self.engine.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        for r in self.engine.replicas:
            r.healthy = True
        self.producer = producer or FakeProducer()
        self.logger = InteractionLogger(lambda: self.producer, DiskSpool(tmp_path / "spool"), ack_timeout_s=2.0,
                                        retry_s=0.05).start()
        self.swapper = swapper or FakeSwapper()
        self.gateway = Gateway(self.settings, FakeRegistry(), self.engine, self.swapper, self.logger,
                               quota_store=quota_store)
        self.app = create_app(self.gateway)

    def close(self) -> None:
        self.logger.stop(2.0)

    async def call(self, body: dict[str, Any] | bytes, *, tenant: str = "acme", path: str = "/v1/chat/completions",
                   disconnect_after: int | None = None) -> Reply:
        """POST `body`; `disconnect_after`: hang up once that many body chunks came back."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path, "raw_path": path.encode(),
                 "root_path": "", "scheme": "http", "query_string": b"", "server": ("test", 80),
                 "client": ("127.0.0.1", 1), "headers": [(b"authorization", f"Bearer clk_{tenant}".encode()),
                                                         (b"content-type", b"application/json"),
                                                         (b"content-length", str(len(raw)).encode())]}
        sent = {"body": False}
        hang_up = asyncio.Event()
        reply = Reply(0, {}, b"")
        chunks = 0

        async def receive():
            if not sent["body"]:
                sent["body"] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await hang_up.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal chunks
            if message["type"] == "http.response.start":
                reply.status = message["status"]
                reply.headers = {k.decode(): v.decode() for k, v in message["headers"]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    reply.body += message["body"]
                    chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    hang_up.set()
                    await asyncio.sleep(0.05)  # let the server notice before it sends more

        await self.app(scope, receive, send)
        return reply

    def held(self, tenant: str = "acme") -> dict[str, int]:
        """Everything the tenant's requests hold: quota slots, engine leases, adapter pins,
        version holds. All zero once every request is over."""
        return {"quota_slots": self.gateway.quota.in_flight(tenant),
                "leases": sum(r.in_flight for r in self.engine.replicas),
                "pins": sum(r.resident.pins(f"{tenant}@v{v}") for r in self.engine.replicas for v in (1, LIVE)),
                "version_holds": self.gateway.quota.pinned_in_flight(tenant)}


def run(coro_fn: Callable[..., Any], *args: Any) -> Any:
    return asyncio.run(coro_fn(*args))


def noop_future() -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(None)
    return f


NS = SimpleNamespace
