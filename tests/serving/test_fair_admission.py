"""Fair admission in the gateway (`fair_admission`, `serving/fair_queue.py`) against a fake vLLM
(tests/serving/gateway_harness.py) that answers only when a test lets it: requests beyond
`fair_sequences` wait in the gateway and reach the engine in fair order across tenants; a
waiting request still counts against its tenant's quota and pinned versions; one cancelled while
it waits frees its place and its quota slot; each tenant is charged the tokens it generated."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serving.gateway_harness import Harness, default_vllm

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def harness(tmp_path):
    made: list[Harness] = []

    def make(*args, **kw) -> Harness:
        h = Harness(tmp_path / f"h{len(made)}", *args, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


class HeldEngine:
    """A fake vLLM whose completions each wait for one `let_one()`."""

    def __init__(self) -> None:
        self.go = asyncio.Semaphore(0)

    def __call__(self, request: httpx.Request):
        if not request.url.path.endswith("completions"):
            return default_vllm(request)

        async def answer() -> httpx.Response:
            await self.go.acquire()
            return default_vllm(request)
        return answer()

    def let_one(self) -> None:
        self.go.release()


async def until(cond, what: str) -> None:
    """Wait (on the event loop, a bounded number of turns) until `cond()` holds."""
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def tenants_upstream(h: Harness) -> list[str]:
    """The tenant of each completion the engine got, in order (from the served model name)."""
    return [body["model"].split("@")[0] for _, body, _ in h.upstream]


def call(h: Harness, tenant: str, **extra) -> asyncio.Task:
    return asyncio.create_task(h.call({"model": extra.pop("model", tenant), "messages": MSGS, **extra}, tenant=tenant))


def test_a_light_tenant_reaches_the_engine_before_a_heavy_tenants_backlog(harness):
    engine = HeldEngine()
    h = harness(engine, fair_sequences=1, max_n=1, tenant_engine_share=1.0, engine={"max_num_seqs": 4})

    async def go():
        heavy = [call(h, "heavy") for _ in range(4)]
        await until(lambda: h.gateway.fair.waiting("heavy") == 3, "heavy's backlog waits")
        light = call(h, "light")
        await until(lambda: h.gateway.fair.waiting("light") == 1, "light waits")
        for sent in range(2, 6):
            engine.let_one()
            await until(lambda: len(h.upstream) == sent, f"request {sent} reaches the engine")
        engine.let_one()
        return [r.status for r in await asyncio.gather(*heavy, light)]

    assert asyncio.run(go()) == [200] * 5
    assert tenants_upstream(h) == ["heavy", "light", "heavy", "heavy", "heavy"]


def test_with_fair_admission_off_requests_go_straight_to_the_engine(harness):
    engine = HeldEngine()
    h = harness(engine, fair_admission=False, fair_sequences=1, max_n=1, tenant_engine_share=1.0,
                engine={"max_num_seqs": 4})

    async def go():
        calls = [call(h, "heavy") for _ in range(3)]
        await until(lambda: len(h.upstream) == 3, "every request reaches the engine")
        for _ in calls:
            engine.let_one()
        return [r.status for r in await asyncio.gather(*calls)]

    assert asyncio.run(go()) == [200] * 3


def test_a_request_cancelled_while_it_waits_frees_its_place_and_its_quota_slot(harness):
    engine = HeldEngine()
    h = harness(engine, fair_sequences=1, max_n=1, tenant_engine_share=1.0, engine={"max_num_seqs": 4})

    async def go():
        first = call(h, "acme")
        await until(lambda: len(h.upstream) == 1, "the first request reaches the engine")
        doomed = call(h, "globex")
        await until(lambda: h.gateway.fair.waiting("globex") == 1, "globex waits")
        assert h.held("globex")["quota_slots"] == 1
        doomed.cancel()
        await until(lambda: doomed.done(), "the cancelled request ends")
        after = h.held("globex"), h.gateway.fair.waiting()
        later = call(h, "globex")
        engine.let_one()
        await until(lambda: len(h.upstream) == 2, "the next request reaches the engine")
        engine.let_one()
        return after, [r.status for r in await asyncio.gather(first, later)]

    (held, waiting), statuses = asyncio.run(go())
    assert held["quota_slots"] == 0 and waiting == 0
    assert statuses == [200, 200] and tenants_upstream(h) == ["acme", "globex"]
    assert h.gateway.fair.in_flight == 0 and h.held("globex") == h.held("acme") == {
        "quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}


async def call_and_leave(h: Harness, tenant: str, leave: asyncio.Event) -> int:
    """POST a chat completion through the app whose client hangs up when `leave` is set; the
    status the app answered (0: none)."""
    raw = json.dumps({"model": tenant, "messages": MSGS}).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "root_path": "", "scheme": "http", "query_string": b"",
             "server": ("test", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"authorization", f"Bearer clk_{tenant}".encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    status = 0

    async def receive():
        if messages:
            return messages.pop()
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await h.app(scope, receive, send)
    return status


def test_a_request_whose_client_leaves_while_it_waits_never_reaches_the_engine(harness):
    engine = HeldEngine()
    h = harness(engine, fair_sequences=1, max_n=1, tenant_engine_share=1.0, engine={"max_num_seqs": 4})

    async def go():
        first = call(h, "acme")
        await until(lambda: len(h.upstream) == 1, "the first request reaches the engine")
        leave = asyncio.Event()
        left = asyncio.create_task(call_and_leave(h, "globex", leave))
        await until(lambda: h.gateway.fair.waiting("globex") == 1, "globex waits")
        leave.set()
        status = await left
        after = h.held("globex"), h.gateway.fair.waiting()
        engine.let_one()
        await first
        return status, after

    status, (held, waiting) = asyncio.run(go())
    assert status == 499 and held["quota_slots"] == 0 and waiting == 0
    assert tenants_upstream(h) == ["acme"] and h.gateway.fair.in_flight == 0


def test_a_waiting_request_counts_against_its_tenants_requests_and_pinned_versions(harness):
    engine = HeldEngine()
    h = harness(engine, fair_sequences=1, max_n=1, tenant_engine_share=1.0, tenant_concurrency=2,
                tenant_pinned_versions=1, engine={"max_num_seqs": 4})

    async def go():
        blocker = call(h, "globex")
        await until(lambda: len(h.upstream) == 1, "globex holds the engine")
        pinned = call(h, "acme", model="acme@v1")
        await until(lambda: h.gateway.fair.waiting("acme") == 1, "acme@v1 waits")
        other_version = await h.call({"model": "acme@v3", "messages": MSGS}, tenant="acme")
        live = call(h, "acme")
        await until(lambda: h.gateway.fair.waiting("acme") == 2, "acme's live request waits")
        over = await h.call({"model": "acme", "messages": MSGS}, tenant="acme")
        for _ in range(3):
            engine.let_one()
        return other_version, over, [r.status for r in await asyncio.gather(blocker, pinned, live)]

    other_version, over, statuses = asyncio.run(go())
    assert other_version.status == 429 and "versions" in other_version.json()["error"]["message"], other_version.body
    assert over.status == 429 and "requests in flight" in over.json()["error"]["message"], over.body
    assert statuses == [200, 200, 200]


def test_a_request_that_waits_past_fair_wait_s_answers_503_and_holds_nothing(harness):
    engine = HeldEngine()
    h = harness(engine, fair_sequences=1, max_n=1, fair_wait_s=0.2, tenant_engine_share=1.0, engine={"max_num_seqs": 4})

    async def go():
        blocker = call(h, "globex")
        await until(lambda: len(h.upstream) == 1, "globex holds the engine")
        late = await h.call({"model": "acme", "messages": MSGS}, tenant="acme")
        engine.let_one()
        await blocker
        return late

    late = asyncio.run(go())
    assert late.status == 503 and "fair turn" in late.json()["error"]["message"], late.body
    assert late.headers.get("retry-after") == "1"
    assert h.held("acme")["quota_slots"] == 0 and h.gateway.fair.waiting() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_each_tenant_is_charged_the_tokens_it_generated_not_its_max_tokens(harness, stream):
    h = harness(fair_sequences=4, tenant_engine_share=1.0, engine={"max_num_seqs": 4})
    r = asyncio.run(h.call({"model": "acme", "messages": MSGS, "max_tokens": 100, "stream": stream}))
    assert r.status == 200
    lane = h.gateway.fair.lane("acme")
    assert lane is not None and lane.pass_ == 2.0 and lane.in_flight == 0  # the fake engine generates 2 tokens


def test_a_fair_queue_narrower_than_the_largest_n_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="fair_sequences 2"):
        Harness(tmp_path, fair_sequences=2, max_n=4, tenant_engine_share=1.0, engine={"max_num_seqs": 8})
