"""Serving over remote vLLM replicas, against fake vLLM servers (one httpx mock transport that
answers per host): attaching by URL with no local replica, the remote API key, each version's
canary (`clora.canary`) taking one replica out of rotation for one adapter only, a dead remote
replica leaving and rejoining rotation, and resident-first routing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import pytest

from clora.canary import AdapterCanary
from clora.serving.aliases import AdapterRef
from clora.serving.engine import AdapterLoadError, EngineManager
from clora.serving.metrics import GatewayMetrics
from clora.serving.replica import RemoteReplica
from clora.serving.settings import EngineSettings, GatewaySettings, tenant_limits
from tests.serving.gateway_harness import Harness

PROMPT = [1, 5, 9, 14, 3]
BASE = [-2.0, -1.5, -3.0, -0.5]
WEIGHTS = {"/adapters/acme/v1": [-1.0, -0.5, -2.0, -0.4], "/adapters/beta/v1": [-2.5, -1.0, -1.0, -1.5]}
"""What each adapter folder makes the model answer for `PROMPT`, as the learner computed it."""
URLS = ["http://vllm-0.vllm:8000", "http://vllm-1.vllm:8000"]
KEY = "remote-secret"


def ref(tenant: str, *, canary: bool = True) -> AdapterRef:
    path = f"/adapters/{tenant}/v1"
    return AdapterRef(tenant, 1, path, AdapterCanary(prompt_token_ids=PROMPT, logprobs=WEIGHTS[path],
                                                     base_logprobs=BASE) if canary else None)


@dataclass
class FakeVllm:
    """One vLLM server: its health, the adapters it holds (name -> folder) and what each folder
    holds on its host (`folders`: a folder whose files differ there answers other numbers)."""

    healthy: bool = True
    loaded: dict[str, str] = field(default_factory=dict)
    folders: dict[str, list[float]] = field(default_factory=lambda: dict(WEIGHTS))
    calls: list[tuple[str, str | None]] = field(default_factory=list)
    """(path, authorization header) of every call."""

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.url.path, request.headers.get("authorization")))
        if not self.healthy:
            raise httpx.ConnectError("connection refused", request=request)
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        body = json.loads(request.read())
        if path == "/v1/load_lora_adapter":
            if body["lora_name"] in self.loaded:
                return httpx.Response(400, json={"error": {"message": f"The lora adapter '{body['lora_name']}' has "
                                                                       "already been loaded."}})
            self.loaded[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="ok")
        if path == "/v1/unload_lora_adapter":
            return httpx.Response(200 if self.loaded.pop(body["lora_name"], None) else 404)
        if body["model"] != "base" and body["model"] not in self.loaded:
            return httpx.Response(404, json={"error": {"message": f"The model `{body['model']}` does not exist.",
                                                       "type": "NotFoundError", "code": 404}})
        lps = BASE if body["model"] == "base" else self.folders[self.loaded[body["model"]]]
        if "prompt_logprobs" in body:                                   # the canary
            per_token = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(body["prompt"][1:], lps)]
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x", "prompt_logprobs": per_token}]})
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "model": body["model"],
                                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                      "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})


class Fleet:
    def __init__(self, n: int = 2):
        self.servers = {httpx.URL(u).host: FakeVllm() for u in URLS[:n]}

    def __getitem__(self, i: int) -> FakeVllm:
        return self.servers[httpx.URL(URLS[i]).host]

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(lambda request: self.servers[request.url.host].answer(request))


def engine(tmp_path, fleet: Fleet, n: int = 2, live: list[AdapterRef] | None = None, **settings) -> EngineManager:
    es = EngineSettings(model=str(tmp_path), remote_urls=URLS[:n], remote_api_key=KEY, base_via_zero_adapter=False,
                        log_dir=tmp_path, max_loras=2, max_cpu_loras=4, **settings)
    eng = EngineManager(es, live_refs=lambda: list(live or []), adapter_wait_s=0.5)
    eng.http = httpx.AsyncClient(transport=fleet.transport())
    return eng


# --- attaching by URL --------------------------------------------------------------------

def test_remote_urls_alone_start_no_local_replica_and_count_for_each_tenants_share():
    es = EngineSettings(remote_urls=[URLS[0] + "/"], max_num_seqs=32)
    assert es.ports == [] and es.remote_urls == [URLS[0]] and es.replica_count == 1
    assert tenant_limits(es, GatewaySettings(tenant_engine_share=0.5)).sequences == 16
    both = EngineSettings(remote_urls=URLS, ports=[8100])          # local ones too, when asked for
    assert both.replica_count == 3
    with pytest.raises(ValueError, match="no engine replica"):
        EngineSettings(ports=[])
    for bad in (["vllm:8000"], ["http://vllm:8000/v1"], [URLS[0], URLS[0]]):
        with pytest.raises(ValueError, match="base URL|twice"):
            EngineSettings(remote_urls=bad)


def test_a_gateway_with_only_a_remote_replica_starts_nothing_and_serves_through_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CLORA_ENGINE_REMOTE_URLS", json.dumps(URLS[:1]))
    monkeypatch.setenv("CLORA_ENGINE_REMOTE_API_KEY", KEY)
    fleet = Fleet(1)
    eng = engine(tmp_path, fleet, n=1)
    assert [type(r) for r in eng.replicas] == [RemoteReplica]
    assert EngineSettings().remote_api_key.get_secret_value() == KEY and EngineSettings().ports == []

    async def run():
        await eng.start()                                # nothing to spawn: attaches and checks health
        assert eng.healthy() == eng.replicas
        async with eng.lease(ref("acme")) as lease:
            assert (lease.replica.url, lease.model) == (URLS[0], "acme@v1")
        await eng.stop()

    asyncio.run(run())
    assert fleet[0].loaded == {"acme@v1": "/adapters/acme/v1"}


def test_every_call_to_a_remote_replica_carries_the_remote_key(tmp_path):
    """The load, the canary, the client's completion, the health check: all with
    `CLORA_ENGINE_REMOTE_API_KEY` (the remote vLLM's `VLLM_API_KEY`), none with the local key."""
    fleet = Fleet(1)
    h = Harness(tmp_path, engine={"remote_urls": URLS[:1], "remote_api_key": KEY, "ports": []})
    h.engine.http = httpx.AsyncClient(transport=fleet.transport())
    fleet[0].folders["/adapters/acme/v2"] = WEIGHTS["/adapters/acme/v1"]

    async def go():
        r = await h.call({"model": "acme", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 200, r.body
        await h.engine.replicas[0].check_health(h.engine.http)

    try:
        asyncio.run(go())
    finally:
        h.close()
    paths = [p for p, _ in fleet[0].calls]
    assert {"/v1/load_lora_adapter", "/v1/completions", "/v1/chat/completions", "/health"} <= set(paths)
    assert {auth for _, auth in fleet[0].calls} == {f"Bearer {KEY}"} and h.engine.api_key not in KEY


def test_an_adapter_another_gateway_unloaded_is_loaded_again_and_the_request_answered(tmp_path):
    """Gateways share remote replicas: one retiring a version unloads it for all. The next
    request here meets vLLM's 404; the gateway loads and verifies the adapter again and asks
    once more, so the client gets its answer, not the 404."""
    fleet = Fleet(1)
    fleet[0].folders["/adapters/acme/v2"] = WEIGHTS["/adapters/acme/v1"]
    h = Harness(tmp_path, engine={"remote_urls": URLS[:1], "remote_api_key": KEY, "ports": []})
    h.engine.http = httpx.AsyncClient(transport=fleet.transport())
    chat = {"model": "acme", "messages": [{"role": "user", "content": "hi"}]}

    async def go():
        assert (await h.call(chat)).status == 200
        del fleet[0].loaded["acme@v2"]                                # the other gateway retired it
        assert (await h.call(chat)).status == 200
        assert (await h.call({**chat, "stream": True})).status == 200  # and streamed
        del fleet[0].loaded["acme@v2"]
        assert (await h.call({**chat, "stream": True})).status == 200

    try:
        asyncio.run(go())
    finally:
        h.close()
    assert [p for p, _ in fleet[0].calls].count("/v1/load_lora_adapter") == 3
    assert [p for p, _ in fleet[0].calls].count("/v1/chat/completions") == 6  # the canary's not among them


# --- the canary --------------------------------------------------------------------------

def test_a_canary_mismatch_takes_that_replica_out_for_that_adapter_only(tmp_path):
    """Replica 1's copy of acme@v1's folder holds other weights: it fails acme's canary, leaves
    rotation for acme (counted, reported) and is retried later; beta still routes to it."""
    fleet = Fleet()
    fleet[1].folders["/adapters/acme/v1"] = [-1.3, -0.2, -2.4, -0.9]
    eng = engine(tmp_path, fleet, adapter_retry_s=0.3, adapter_retry_max_s=1.0)
    metrics = GatewayMetrics()
    metrics.watch(eng)
    for r in eng.replicas:
        r.healthy = True
    acme, beta = ref("acme"), ref("beta")

    async def run():
        await eng.preload(acme)                                       # replica 0 took it: the swap goes on
        assert "acme@v1" in eng.replicas[0].resident and "acme@v1" not in eng.replicas[1].resident
        assert "acme@v1" not in fleet[1].loaded                       # unloaded, so that a retry loads afresh
        eng.replicas[0].in_flight = 50                                # far busier: acme still avoids replica 1
        async with eng.lease(acme) as lease:
            assert lease.replica.index == 0
        async with eng.lease(beta) as lease:                          # another adapter: replica 1 is fine
            assert lease.replica.index == 1
        eng.replicas[0].in_flight = 0
        report = eng.report()[1]["refused"]
        assert [(x["adapter"], x["reason"]) for x in report] == [("acme@v1", "canary_mismatch")]
        assert "nats/token from the version's canary" in report[0]["detail"]
        sample = metrics.registry.get_sample_value
        assert sample("clora_engine_adapter_load_failures_total", {"replica": "1", "reason": "canary_mismatch"}) == 1
        assert sample("clora_engine_adapters_out_of_rotation", {"replica": "1"}) == 1
        assert sample("clora_engine_adapters_out_of_rotation", {"replica": "0"}) == 0
        fleet[1].folders["/adapters/acme/v1"] = WEIGHTS["/adapters/acme/v1"]   # its cache mended
        await asyncio.sleep(0.35)                                     # past the retry wait
        eng.replicas[0].in_flight = 50
        async with eng.lease(acme) as lease:
            assert lease.replica.index == 1                           # verified now: back in rotation
        assert eng.report()[1]["refused"] == []
        assert sample("clora_engine_adapters_out_of_rotation", {"replica": "1"}) == 0
        await eng.http.aclose()

    asyncio.run(run())


def test_an_adapter_the_replica_does_not_apply_fails_and_no_replica_left_is_a_load_error(tmp_path):
    """vLLM answers the base's numbers under the adapter's name on both replicas: `not_applied`
    on each, and a request has nowhere to go (503 at the gateway), while the base still serves."""
    fleet = Fleet()
    for i in (0, 1):
        fleet[i].folders["/adapters/acme/v1"] = list(BASE)
    eng = engine(tmp_path, fleet)
    for r in eng.replicas:
        r.healthy = True

    async def run():
        with pytest.raises(AdapterLoadError, match="not applied"):
            await eng.preload(ref("acme"))
        with pytest.raises(AdapterLoadError, match="every healthy replica is out of rotation for acme@v1"):
            async with eng.lease(ref("acme")):
                pass
        async with eng.lease(None) as lease:
            assert lease.model == "base"
        await eng.http.aclose()

    asyncio.run(run())
    assert [dict(r.load_failures) for r in eng.replicas] == [{"not_applied": 1}, {"not_applied": 1}]


def test_an_adapter_another_gateway_loaded_is_verified_not_refused(tmp_path):
    """Two gateways share the remote fleet: vLLM answers 400 "already loaded" to the second one's
    load. That is no failure; the canary decides whether what is loaded under the name is right."""
    fleet = Fleet(1)
    fleet[0].loaded["acme@v1"] = "/adapters/acme/v1"                  # loaded by the other gateway
    fleet[0].loaded["beta@v1"] = "/adapters/acme/v1"                  # ... and a wrong one
    eng = engine(tmp_path, fleet, n=1)
    eng.replicas[0].healthy = True

    async def run():
        async with eng.lease(ref("acme")):
            pass
        with pytest.raises(AdapterLoadError, match="another adapter under this name"):
            async with eng.lease(ref("beta")):
                pass
        await eng.http.aclose()

    asyncio.run(run())
    assert "acme@v1" in eng.replicas[0].resident and "beta@v1" not in fleet[0].loaded


def test_a_version_without_a_canary_is_served_when_it_changes_the_base_and_when_it_cannot_tell(tmp_path, caplog):
    fleet = Fleet(1)
    fleet[0].folders["/adapters/beta/v1"] = list(BASE)                # answers as the base: unverifiable
    eng = engine(tmp_path, fleet, n=1)
    eng.replicas[0].healthy = True

    async def run():
        for tenant in ("acme", "beta"):
            async with eng.lease(ref(tenant, canary=False)):
                pass
        await eng.http.aclose()

    with caplog.at_level("INFO", logger="clora.serving.engine"):
        asyncio.run(run())
    assert eng.replicas[0].resident.names() == ["acme@v1", "beta@v1"] and not eng.replicas[0].load_failures
    assert "no canary; the adapter differs from the base" in caplog.text
    assert "not verified: no canary, and the adapter answers as the base does" in caplog.text


# --- health ------------------------------------------------------------------------------

def test_a_dead_remote_replica_leaves_rotation_and_rejoins_with_the_live_adapters(tmp_path):
    """Never restarted (there is no process to restart): it leaves when its health check fails
    and, once it answers again (as a fresh server: it lost its adapters), it rejoins only after
    every live adapter is loaded and verified there."""
    fleet = Fleet()
    live = [ref("acme")]
    eng = engine(tmp_path, fleet, live=live, health_interval_s=0.05)

    async def wait_for(cond, what: str):
        for _ in range(100):
            if cond():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"not {what} within 2 s: {eng.report()}")

    async def run():
        await eng.start()
        await wait_for(lambda: all(r.healthy for r in eng.replicas), "both attached")
        fleet[1].healthy = False
        fleet[1].loaded.clear()                                       # it restarts empty
        await wait_for(lambda: not eng.replicas[1].healthy, "out of rotation")
        for _ in range(3):
            async with eng.lease(ref("acme")) as lease:
                assert lease.replica.index == 0
        fleet[1].healthy = True
        await wait_for(lambda: eng.replicas[1].healthy, "back in rotation")
        assert fleet[1].loaded == {"acme@v1": "/adapters/acme/v1"} and "acme@v1" in eng.replicas[1].resident
        await eng.stop()

    asyncio.run(run())
    assert [r.restarts for r in eng.replicas] == [0, 0]


def test_a_remote_replica_down_at_start_joins_when_it_answers(tmp_path):
    fleet = Fleet()
    fleet[1].healthy = False
    eng = engine(tmp_path, fleet, health_interval_s=0.05)

    async def run():
        await eng.start()                                             # does not wait for replica 1
        assert [r.healthy for r in eng.replicas] == [True, False]
        fleet[1].healthy = True
        for _ in range(100):
            if eng.replicas[1].healthy:
                break
            await asyncio.sleep(0.02)
        healthy = eng.replicas[1].healthy
        await eng.stop()
        return healthy

    assert asyncio.run(run())


# --- routing -----------------------------------------------------------------------------

def test_requests_prefer_the_replica_where_the_adapter_is_resident_within_the_slack(tmp_path):
    fleet = Fleet()
    eng = engine(tmp_path, fleet, resident_slack=2)
    a, b = eng.replicas
    a.healthy = b.healthy = True
    acme = ref("acme")

    async def run():
        await eng._make_resident(b, acme, pin=False)                  # resident on replica 1 only
        b.in_flight = 2
        async with eng.lease(acme) as lease:                          # 2 more than replica 0: still resident-first
            assert lease.replica is b
        b.in_flight = 3
        async with eng.lease(acme) as lease:                          # 3 more: the least loaded loads it
            assert lease.replica is a
        assert "acme@v1" in a.resident
        a.in_flight, b.in_flight = 1, 0
        async with eng.lease(acme) as lease:                          # resident on both: least loaded
            assert lease.replica is b
        async with eng.lease(None) as lease:                          # the base: least loaded
            assert lease.replica is b
        await eng.http.aclose()

    asyncio.run(run())
    assert fleet[0].loaded.keys() == fleet[1].loaded.keys() == {"acme@v1"}
