"""EngineManager routing, LRU residency and drain logic against a fake vLLM (httpx mock
transport): no processes are started."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from clora.serving.aliases import AdapterRef
from clora.serving.engine import AdapterLoadError, EngineManager, EngineUnavailable
from clora.serving.metrics import GatewayMetrics
from clora.serving.settings import EngineSettings
from tests.serving.gateway_harness import canary_request, canary_response


def _engine(tmp_path, cap: int, calls: list) -> EngineManager:
    def handler(request: httpx.Request) -> httpx.Response:
        if (canary := canary_request(request)) is not None:
            return canary_response(canary)
        body = request.read().decode()
        calls.append((request.url.path, body))
        return httpx.Response(200, text="ok")

    es = EngineSettings(model=str(tmp_path), ports=[1], max_loras=1, max_cpu_loras=cap, base_via_zero_adapter=False,
                        max_registered_loras=None, log_dir=tmp_path)
    eng = EngineManager(es, adapter_wait_s=0.5)
    eng.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    for r in eng.replicas:
        r.healthy = True
    return eng


def test_lru_load_on_demand_evicts_idle_and_never_pinned(tmp_path):
    async def run():
        calls: list = []
        eng = _engine(tmp_path, 2, calls)
        a, b, c = (AdapterRef(t, 1, f"/{t}") for t in "abc")
        async with eng.lease(a) as lease:
            assert lease.model == "a@v1"
            async with eng.lease(b):
                # both slots pinned: c waits for a slot and then gives up with both numbers
                with pytest.raises(AdapterLoadError, match="2 resident adapters"):
                    async with eng.lease(c):
                        pass
        async with eng.lease(a):
            pass
        async with eng.lease(c):  # b is now the least recently used idle adapter
            pass
        assert eng.resident_names()[0] == ["a@v1", "c@v1"]
        unloaded = [body for p, body in calls if p == "/v1/unload_lora_adapter"]
        assert len(unloaded) == 1 and "b@v1" in unloaded[0]
        async with eng.lease(b):  # evicted, then asked for again: reloaded, not refused
            pass
        assert "b@v1" in eng.resident_names()[0]
        await eng.http.aclose()

    asyncio.run(run())


def test_retire_waits_for_in_flight_requests(tmp_path):
    async def run():
        calls: list = []
        eng = _engine(tmp_path, 4, calls)
        old = AdapterRef("a", 1, "/a1")
        release = asyncio.Event()

        async def in_flight():
            async with eng.lease(old):
                await release.wait()

        task = asyncio.create_task(in_flight())
        await asyncio.sleep(0.05)
        retire = asyncio.create_task(eng.retire(old, drain_timeout_s=30))
        await asyncio.sleep(0.3)
        assert not retire.done() and "a@v1" in eng.resident_names()[0]
        release.set()
        await asyncio.wait_for(retire, 5)
        await task
        assert "a@v1" not in eng.resident_names()[0]
        await eng.http.aclose()

    asyncio.run(run())


def test_a_request_during_an_unload_reloads_instead_of_pinning_the_leaving_adapter(tmp_path):
    """While vLLM is unloading a retired version, a request for it by its pinned name must not
    be sent to that replica as if it were still loaded (vLLM would answer 404): it waits for
    the unload and loads the adapter again."""
    async def run():
        calls: list = []
        unloading, finish = asyncio.Event(), asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            if (canary := canary_request(request)) is not None:
                return canary_response(canary)
            calls.append(request.url.path)
            if request.url.path == "/v1/unload_lora_adapter":
                unloading.set()
                await finish.wait()
            return httpx.Response(200, text="ok")

        eng = _engine(tmp_path, 4, [])
        eng.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        old = AdapterRef("a", 1, "/a1")
        async with eng.lease(old):
            pass
        retire = asyncio.create_task(eng.retire(old, drain_timeout_s=30))
        await asyncio.wait_for(unloading.wait(), 5)

        async def request():
            async with eng.lease(old) as lease:
                return lease.model, calls.count("/v1/load_lora_adapter")

        req = asyncio.create_task(request())
        await asyncio.sleep(0.2)
        assert not req.done()                       # not served on a name vLLM is removing
        finish.set()
        await asyncio.wait_for(retire, 5)
        assert await asyncio.wait_for(req, 5) == ("a@v1", 2)   # loaded again before it was served
        await eng.http.aclose()

    asyncio.run(run())


def test_no_healthy_replica_is_unavailable(tmp_path):
    async def run():
        eng = _engine(tmp_path, 2, [])
        eng.replicas[0].healthy = False
        with pytest.raises(EngineUnavailable, match="0 of 1"):
            async with eng.lease(None):
                pass
        await eng.http.aclose()

    asyncio.run(run())


def test_a_version_that_fails_to_load_is_retried_with_growing_waits():
    """A version the engine refuses is not reloaded on every poll (each attempt may evict
    another tenant's idle adapter first); an adapter event retries at once; faults that are not
    the adapter's (no replica up, no slot free) are retried on the next poll."""
    from types import SimpleNamespace

    from clora.serving import hotswap
    from clora.serving.aliases import AliasTable

    class Registry:
        def live_version(self, tenant):
            return 2

        def adapter_version(self, tenant, version):
            return SimpleNamespace(version=version, path=f"/adapters/{tenant}/v{version}", canary=None)

    class Engine:
        def __init__(self):
            self.tries, self.fail = 0, AdapterLoadError("no such folder")

        async def preload(self, ref):
            self.tries += 1
            if self.fail:
                raise self.fail

    now = [0.0]
    engine, aliases = Engine(), AliasTable()
    metrics = GatewayMetrics()
    swapper = hotswap.HotSwapper(Registry(), aliases, engine, clock=lambda: now[0], metrics=metrics)

    async def polls(n):
        for _ in range(n):
            await swapper.reconcile("acme")

    async def run():
        await polls(5)
        assert engine.tries == 1                              # failed once, then waits
        now[0] += hotswap.LOAD_RETRY_S
        await polls(5)
        assert engine.tries == 2                              # one retry; the wait doubles
        now[0] += hotswap.LOAD_RETRY_S
        await polls(1)
        assert engine.tries == 2
        await swapper.reconcile("acme", retry_now=True)       # an adapter event: at once
        assert engine.tries == 3
        now[0] += hotswap.LOAD_RETRY_MAX_S
        for fault in (EngineUnavailable("replica down"), AdapterLoadError("no slot", transient=True)):
            engine.fail = fault
            await polls(3)
        assert engine.tries == 9                              # not the adapter's fault: every poll
        engine.fail = None
        await polls(1)
        assert aliases.get("acme").version == 2 and engine.tries == 10
        assert metrics.registry.get_sample_value("clora_gateway_swaps_total", {"tenant": "acme"}) == 1  # failures not

    asyncio.run(run())


def test_the_gateway_drops_idle_engine_connections_before_the_replica_does(tmp_path):
    es = EngineSettings(model=str(tmp_path), ports=[1], base_via_zero_adapter=False, log_dir=tmp_path, keep_alive_s=30)
    eng = EngineManager(es)
    assert eng.replicas[0].env()["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "30"
    assert eng.http._transport._pool._keepalive_expiry == 15  # httpx keeps no public accessor
    asyncio.run(eng.http.aclose())


def test_an_unload_that_fails_while_freeing_a_slot_is_a_transient_load_error(tmp_path):
    """Not a ReplicaError, which would be a 500 on the request path and would end the hot-swap
    poller when a preload hit it."""
    def handler(request: httpx.Request) -> httpx.Response:
        if (canary := canary_request(request)) is not None:
            return canary_response(canary)
        return httpx.Response(500 if request.url.path.endswith("unload_lora_adapter") else 200, text="boom")

    es = EngineSettings(model=str(tmp_path), ports=[1], max_loras=1, max_cpu_loras=1, base_via_zero_adapter=False,
                        max_registered_loras=None, log_dir=tmp_path)
    eng = EngineManager(es, adapter_wait_s=0.5)
    eng.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    eng.replicas[0].healthy = True
    a, b = AdapterRef("a", 1, "/a"), AdapterRef("b", 1, "/b")

    async def run():
        async with eng.lease(a):
            pass
        with pytest.raises(AdapterLoadError, match="freeing a slot for b@v1") as e:
            async with eng.lease(b):
                pass
        return e.value

    err = asyncio.run(run())
    assert err.transient and not eng.replicas[0].healthy  # no process behind it: marked failed
    assert eng.resident_names()[0] == ["a@v1"]  # put back: vLLM still holds it
