"""More adapters in use than a replica keeps in memory (`clora bench tenants`' subject), against a
fake vLLM (httpx mock transport): resident vs cached bookkeeping (`ResidentSet.warm`), vLLM's own
cache behind `max_registered_loras`, and the canary run once per version per replica incarnation.
No processes are started."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from clora.serving.aliases import AdapterRef
from clora.serving.engine import AdapterLoadError, EngineManager
from clora.serving.residency import CapacityError, ResidentSet
from clora.serving.settings import EngineSettings
from tests.serving.gateway_harness import canary_request, canary_response


class FakeVllm:
    """Answers adapter calls and canaries, and records them: `calls` is [(path, lora_name)], a
    canary recorded as ("canary", model)."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.already_loaded: set[str] = set()
        """Names whose next load answers vLLM's 400 `has already been loaded` (another gateway)."""
        self.malformed: set[str] = set()
        """Adapters whose canary answer lacks a log-probability (the canary fails: `malformed`)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if (canary := canary_request(request)) is not None:
            self.calls.append(("canary", canary["model"]))
            if canary["model"] in self.malformed:
                return canary_response(canary | {"prompt": canary["prompt"][:-1]})
            return canary_response(canary)
        name = json.loads(request.read()).get("lora_name", "")
        self.calls.append((request.url.path, name))
        if request.url.path == "/v1/load_lora_adapter" and name in self.already_loaded:
            self.already_loaded.discard(name)
            return httpx.Response(400, text=f"The lora adapter '{name}' has already been loaded.")
        return httpx.Response(200, text="ok")

    def count(self, what: str, name: str | None = None) -> int:
        path = {"load": "/v1/load_lora_adapter", "unload": "/v1/unload_lora_adapter"}.get(what, what)
        return sum(p == path and (name is None or n == name) for p, n in self.calls)

    def canaries(self, name: str) -> int:
        """Canaries run for adapter `name` (its request under the adapter's name)."""
        return self.count("canary", name)


def _engine(tmp_path, vllm: FakeVllm, *, cpu: int, registered: int | None = None, remote: bool = False
            ) -> EngineManager:
    where = {"remote_urls": ["http://vllm-0:8000"]} if remote else {"ports": [1]}
    es = EngineSettings(model=str(tmp_path), max_loras=1, max_cpu_loras=cpu, max_registered_loras=registered,
                        base_via_zero_adapter=False, log_dir=tmp_path, **where)
    eng = EngineManager(es, adapter_wait_s=0.5)
    eng.http = httpx.AsyncClient(transport=httpx.MockTransport(vllm))
    for r in eng.replicas:
        r.healthy = True
    return eng


def _refs(*tenants: str) -> list[AdapterRef]:
    return [AdapterRef(t, 1, f"/adapters/{t}/v1") for t in tenants]


async def _use(eng: EngineManager, *refs: AdapterRef) -> None:
    for ref in refs:
        async with eng.lease(ref) as lease:
            assert lease.model == ref.name


# --- ResidentSet: resident (loaded) vs cached (in vLLM's memory) ---------------------------------


def test_more_resident_than_cached_keeps_only_the_most_recently_used_warm():
    rs = ResidentSet(6, cached=2)
    for name in "abcdef":
        rs.add(name, f"/{name}")
    assert len(rs) == 6 and rs.full()                     # six resident, two of them in vLLM's memory
    assert [n for n in "abcdef" if rs.warm(n)] == ["e", "f"]
    rs.pin("a")                                           # used again: warm, and "e" no longer is
    assert [n for n in "abcdef" if rs.warm(n)] == ["a", "f"]
    assert not rs.warm("zzz")
    assert rs.victim() == "b"                             # the least recently used idle one of the six
    rs.unpin("a")


def test_a_full_resident_set_of_pinned_adapters_quotes_both_capacities():
    rs = ResidentSet(3, cached=2)
    for name in "abc":
        rs.add(name, f"/{name}")
        rs.pin(name)
    with pytest.raises(CapacityError, match=r"capacity 3, 2 cached in memory"):
        rs.victim()
    with pytest.raises(CapacityError, match=r"3 of 3 slots resident \(2 of them cached"):
        rs.add("d", "/d")


def test_cached_must_fit_in_the_resident_capacity():
    with pytest.raises(ValueError, match="cached must be in"):
        ResidentSet(2, cached=3)
    assert ResidentSet(4).cached == 4                     # default: everything resident is cached


def test_a_version_stays_verified_across_its_eviction_until_the_replica_is_cleared():
    rs = ResidentSet(2)
    rs.add("a@v1", "/a/v1")
    rs.mark_verified("a@v1", "/a/v1")
    rs.remove("a@v1")                                     # evicted: still verified on this incarnation
    assert rs.verified("a@v1", "/a/v1")
    assert not rs.verified("a@v1", "/elsewhere/v1")       # the same name from another folder is not
    rs.clear()                                            # restarted or rejoined: a new incarnation
    assert not rs.verified("a@v1", "/a/v1")
    rs.mark_verified("b@v1", "/b/v1")
    rs.forget_verified("b@v1")
    assert not rs.verified("b@v1", "/b/v1")


def test_registered_loras_must_not_be_below_what_vllm_caches(tmp_path):
    with pytest.raises(ValueError, match=r"max_registered_loras \(4\) must be >= max_cpu_loras \(8\)"):
        EngineSettings(model=str(tmp_path), max_cpu_loras=8, max_registered_loras=4)
    assert EngineSettings(model=str(tmp_path), max_cpu_loras=8).registered_loras == 256   # the default
    assert EngineSettings(model=str(tmp_path), max_cpu_loras=512).registered_loras == 512
    assert EngineSettings(model=str(tmp_path), max_cpu_loras=8, max_registered_loras=None).registered_loras == 8
    assert EngineSettings(model=str(tmp_path), max_cpu_loras=8, max_registered_loras=64).registered_loras == 64


# --- the engine ------------------------------------------------------------------------------------


def test_with_more_registered_than_cached_the_gateway_loads_each_adapter_once(tmp_path):
    """Six adapters, vLLM caching two: the gateway loads and verifies each once and then leaves
    swapping to vLLM's own cache (no unload, no second load, no second canary)."""
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=2, registered=8)
        refs = _refs(*"abcdef")
        await _use(eng, *refs, *refs, *reversed(refs))
        assert vllm.count("load") == 6 and vllm.count("unload") == 0
        assert all(vllm.canaries(r.name) == 1 for r in refs)
        replica = eng.replicas[0]
        assert {r.name for r in refs if replica.resident.warm(r.name)} == {"a@v1", "b@v1"}   # used last
        assert replica.adapter_ops == {"load": 6, "canary": 6}
        await eng.http.aclose()

    asyncio.run(run())


def test_past_the_registered_capacity_the_least_recently_used_idle_adapter_is_unloaded(tmp_path):
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=1, registered=3)
        a, b, c, d = _refs(*"abcd")
        async with eng.lease(a):                          # pinned: never the one unloaded
            await _use(eng, b, c, d)
        assert vllm.calls.count(("/v1/unload_lora_adapter", "b@v1")) == 1
        assert sorted(eng.resident_names()[0]) == ["a@v1", "c@v1", "d@v1"]
        await eng.http.aclose()

    asyncio.run(run())


def test_a_reload_after_eviction_skips_the_canary_on_the_same_replica_incarnation(tmp_path):
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=1)
        a, b = _refs("a", "b")
        await _use(eng, a, b, a, b)                       # one slot: every lease evicts the other
        assert vllm.count("load", "a@v1") == 2 and vllm.count("load", "b@v1") == 2
        assert vllm.canaries("a@v1") == 1 and vllm.canaries("b@v1") == 1
        assert eng.replicas[0].adapter_ops["canary_skipped"] == 2
        await eng.http.aclose()

    asyncio.run(run())


def test_a_rejoined_replica_verifies_every_version_again(tmp_path):
    """A remote replica that failed a health check and answers again may be a restarted server
    (even on another base): what it verified before counts for nothing."""
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=1, remote=True)
        a, b = _refs("a", "b")
        await _use(eng, a, b)
        await eng._rejoin(eng.replicas[0])               # the monitor's path back into rotation
        await _use(eng, a)
        assert vllm.canaries("a@v1") == 2
        await eng.http.aclose()

    asyncio.run(run())


def test_a_404_for_a_resident_adapter_makes_the_replica_verify_everything_again(tmp_path):
    """A 404 may mean the replica restarted between two health checks: a new incarnation."""
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=1)
        a, b = _refs("a", "b")
        await _use(eng, a, b)                             # a verified, then evicted
        async with eng.lease(b) as lease:
            eng.adapter_missing(lease)                    # what the gateway does on vLLM's 404
        await _use(eng, a, b)
        assert vllm.canaries("a@v1") == 2 and vllm.canaries("b@v1") == 2
        await eng.http.aclose()

    asyncio.run(run())


def test_a_name_another_gateway_loaded_is_verified_even_if_verified_before(tmp_path):
    """vLLM answering `already loaded` means whatever it holds under that name was not loaded by
    this call: the canary checks it."""
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=1)
        a, b = _refs("a", "b")
        await _use(eng, a, b)
        vllm.already_loaded.add("a@v1")
        await _use(eng, a)
        assert vllm.canaries("a@v1") == 2
        await eng.http.aclose()

    asyncio.run(run())


def test_a_retired_version_is_verified_again_if_it_comes_back(tmp_path):
    """A rollback to a retired version loads it afresh: its canary runs again."""
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=2)
        (a,) = _refs("a")
        await _use(eng, a)
        await eng.retire(a, drain_timeout_s=5)
        await _use(eng, a)
        assert vllm.count("unload", "a@v1") == 1 and vllm.canaries("a@v1") == 2
        await eng.http.aclose()

    asyncio.run(run())


def test_a_failed_canary_is_never_remembered_as_verified(tmp_path):
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=1)
        replica = eng.replicas[0]
        (a,) = _refs("a")
        vllm.malformed.add("a@v1")
        with pytest.raises(AdapterLoadError, match="log-probabilities"):
            await _use(eng, a)
        assert not replica.resident.verified("a@v1", a.path)
        vllm.malformed.clear()
        replica.refused.clear("a@v1")                     # its retry wait is over
        await _use(eng, a)
        assert vllm.canaries("a@v1") == 2 and replica.resident.verified("a@v1", a.path)
        await eng.http.aclose()

    asyncio.run(run())


def test_canary_every_load_verifies_each_reload_again(tmp_path):
    async def run():
        vllm = FakeVllm()
        eng = _engine(tmp_path, vllm, cpu=1)
        eng.settings.canary_every_load = True
        a, b = _refs("a", "b")
        await _use(eng, a, b, a)
        assert vllm.canaries("a@v1") == 2 and eng.replicas[0].adapter_ops["canary_skipped"] == 0
        await eng.http.aclose()

    asyncio.run(run())
