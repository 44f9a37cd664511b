"""Gateways that share replicas (`clora.infra.cluster`, a fleet): each keeps its own book of what
every replica holds, and a peer that swaps a tenant to a newer version first retires the old
one, unloading it from every replica. A gateway that has not swapped yet still routes to the old
version, and its book is then wrong on every replica at once. Its requests must still be
answered: one for the tenant's alias by the live version, read again; one pinned to the retired
version by loading it again (tests/serving/gateway_harness.py's real gateway and engine against a
fake vLLM that keeps what each replica holds)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest

from clora.serving.aliases import AdapterRef
from clora.serving.gateway import ADAPTER_MISSING_TRIES
from tests.serving.gateway_harness import FakeSwapper, Harness, chat_response

MSGS = [{"role": "user", "content": "hi"}]
PORTS = [1, 2]


class Replicas:
    """vLLM on each port: the adapters it holds, 404 for a completion under any other."""

    def __init__(self) -> None:
        self.held: dict[int, set[str]] = {p: set() for p in PORTS}
        self.answered: Counter[tuple[int, str]] = Counter()
        self.lost: set[str] = set()
        """Names whose completions are refused even just after a load."""
        self.refused = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        port, path = request.url.port, request.url.path
        if path == "/health":
            return httpx.Response(200, text="ok")
        body = json.loads(request.read())
        if path == "/v1/load_lora_adapter":
            self.held[port].add(body["lora_name"])
            return httpx.Response(200, text="ok")
        if path == "/v1/unload_lora_adapter":
            self.held[port].discard(body["lora_name"])
            return httpx.Response(200, text="ok")
        if body["model"] not in self.held[port] or body["model"] in self.lost:
            self.refused += 1
            return httpx.Response(404, json={"error": {"message": f"The model `{body['model']}` does not exist.",
                                                       "type": "NotFoundError", "param": "model", "code": 404}})
        self.answered[port, body["model"]] += 1
        return httpx.Response(200, json=chat_response(body))

    def peer_retires(self, name: str) -> None:
        """What another gateway's `EngineManager.retire` does: unload `name` from every replica."""
        for held in self.held.values():
            held.discard(name)


def _ref(version: int) -> AdapterRef:
    return AdapterRef("acme", version, f"/adapters/acme/v{version}")


@pytest.fixture
def gateway(tmp_path):
    replicas = Replicas()
    h = Harness(tmp_path, replicas, engine={"ports": PORTS}, swapper=FakeSwapper(live=1))
    asyncio.run(h.engine.preload(_ref(1)))            # v1 live and resident on both replicas
    assert replicas.held == {1: {"acme@v1"}, 2: {"acme@v1"}}
    yield h, replicas
    h.close()


def test_the_alias_is_answered_by_the_live_version_after_a_peer_retired_the_old_one(gateway):
    h, replicas = gateway
    replicas.peer_retires("acme@v1")
    h.swapper.registry_live = 2                         # the peer retired v1 because v2 went live

    r = asyncio.run(h.call({"model": "acme", "messages": MSGS}))

    assert r.status == 200, r.body
    assert h.swapper.reconciled == ["acme"]
    assert sum(n for (_, name), n in replicas.answered.items() if name == "acme@v2") == 1
    assert h.held() == {"quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_a_pinned_version_a_peer_retired_from_every_replica_is_loaded_again(gateway, stream):
    """The first try's 404 is from one replica; the book must not then trust the other one."""
    h, replicas = gateway
    replicas.peer_retires("acme@v1")

    r = asyncio.run(h.call({"model": "acme@v1", "messages": MSGS, "stream": stream}))

    assert r.status == 200, r.body
    assert sum(1 for held in replicas.held.values() if "acme@v1" in held) == 1
    assert not h.swapper.reconciled                     # a pinned version is not the alias
    assert h.held() == {"quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}


def test_a_version_no_replica_can_serve_is_the_clients_404_after_every_try(gateway):
    """Every load succeeds and every completion under the version is refused (as if each replica
    lost it at once): the client gets vLLM's 404 after `ADAPTER_MISSING_TRIES`, not a loop."""
    h, replicas = gateway
    replicas.lost.add("acme@v1")

    r = asyncio.run(h.call({"model": "acme@v1", "messages": MSGS}))

    assert r.status == 404 and r.error_param() == "model"
    assert replicas.refused == ADAPTER_MISSING_TRIES
    assert h.held() == {"quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}
