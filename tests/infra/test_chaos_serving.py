"""Chaos for serving under `clora up`'s supervision: nothing served is unrecorded.

Several clients send short completions (chat and text, whole and streamed) to the gateway of a
supervised serving process running the suite's tiny model. The gateway answers a completion
only once its interaction event is acknowledged by the broker or fsync'd to its disk spool. So
that the kill finds answered events that exist only in the spool, the broker is frozen
(SIGSTOP) for a few seconds first: answers keep coming, from the spool. Then kill -9 hits the
serving process while requests are in flight, the broker thaws, the supervisor restarts serving,
the restarted process resends its spool, and the clients carry on.

Every completion a client was answered (200, or a stream that reached `[DONE]` with no error
event) must then have its interaction event on `clora.interactions`, with the text the client
saw. Resending is at least once (a batch whose ack timed out is spooled and sent again), so an
interaction may appear more than once, but only as identical copies of one event: the same
`event_id` (the ingest worker de-duplicates on it) and the same fields; no event id is shared
by two interactions. Requests the kill cut may or may not be recorded: nothing is asserted
about them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from clora.ingest.schemas import TOPIC_INTERACTIONS
from clora.procs import free_port, http_ok
from clora.registry import Registry
from tests.infra.harness import FAST, running_platform
from tests.kafka_read import read_keyed

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("clora_chaos_tiny", Path(__file__).parents[1] / "serving" / "tiny.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

CLIENTS = 4
BEFORE_FREEZE = 40
"""Completions answered before the broker is frozen (their events, as a rule, acknowledged by it)."""
SPOOLED = 8
"""Completions answered while the broker is frozen, before the kill (their events only spooled)."""
AFTER_RESTART = 20
"""Completions answered by the restarted process before the clients stop."""
SUPERVISION = FAST.model_copy(update={"unresponsive_after_s": 60.0, "broker_unresponsive_after_s": 120.0})
"""Only the kill restarts anything: not a gateway slow to answer /health on this loaded machine,
nor the frozen broker (a restarted broker would come back without its topics)."""


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it. `answered`: a 200 with a completion, or a stream that
    reached `[DONE]` with no error event; then `id` is the response id and `text` what was served."""

    route: str
    stream: bool
    started: float
    ended: float
    answered: bool
    id: str | None = None
    text: str = ""
    error: str = ""


class Clients:
    """`CLIENTS` threads, each sending one request after another (max_tokens 1-4, cycling through
    chat/text x whole/streamed) until `stop`; every request's `Outcome` lands in `outcomes`."""

    ROUTES = (("chat/completions", False), ("chat/completions", True), ("completions", False), ("completions", True))

    def __init__(self, gateway: str, model: str, key: str):
        self.gateway, self.model, self.key = gateway, model, key
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in range(CLIENTS)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "a client did not finish"
        assert not self.errors, self.errors

    def answered(self, after: float = 0.0, before: float = float("inf")) -> list[Outcome]:
        with self.lock:
            return [o for o in self.outcomes if o.answered and after < o.started and o.ended < before]

    def _run(self, client: int) -> None:
        try:
            with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {self.key}"}) as http:
                i = 0
                while not self.stop.is_set():
                    route, stream = self.ROUTES[(client + i) % len(self.ROUTES)]
                    with self.lock:
                        self.in_flight += 1
                    try:
                        outcome = self._request(http, route, stream, f"c{client}-q{i}", 1 + (client + i) % 4)
                    except BaseException:
                        with self.lock:
                            self.in_flight -= 1
                        raise
                    with self.lock:
                        self.in_flight -= 1
                        self.outcomes.append(outcome)
                    if not outcome.answered:
                        time.sleep(0.25)                 # a client's back-off, not a wait for an event
                    i += 1
        except BaseException as e:  # noqa: BLE001 - handed to the test, which fails with it
            self.errors.append(e)

    def _request(self, http: httpx.Client, route: str, stream: bool, prompt: str, max_tokens: int) -> Outcome:
        body = {"model": self.model, "max_tokens": max_tokens, "stream": stream}
        if route == "chat/completions":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        started = time.monotonic()
        done = lambda answered, **kw: Outcome(route, stream, started, time.monotonic(), answered, **kw)
        try:
            if not stream:
                r = http.post(f"{self.gateway}/v1/{route}", json=body)
                if r.status_code != 200:
                    return done(False, error=f"{r.status_code}: {r.text[:200]}")
                out = r.json()
                choice = out["choices"][0]
                return done(True, id=out["id"], text=(choice["message"]["content"] if "message" in choice
                                                      else choice["text"]) or "")
            rid, text, finished = None, [], False
            with http.stream("POST", f"{self.gateway}/v1/{route}", json=body) as r:
                if r.status_code != 200:
                    return done(False, error=f"{r.status_code}: {r.read()[:200]!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line[6:].strip() == "[DONE]":
                        finished = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return done(False, error=f"error event: {chunk['error']}")
                    rid = chunk["id"]
                    for choice in chunk["choices"]:
                        text.append((choice.get("delta", {}).get("content") if "delta" in choice
                                     else choice.get("text")) or "")
            if not finished:
                return done(False, error="the stream ended without [DONE]")
            return done(True, id=rid, text="".join(text))
        except (httpx.HTTPError, ValueError) as e:  # cut by the kill (a torn chunk's JSON included)
            return done(False, error=repr(e))


def serving_child() -> psutil.Process:
    """The serving process `clora up` started: this process's child running `clora.infra.cli serve`."""
    found = [p for p in psutil.Process().children() if p.cmdline()[-3:] == ["-m", "clora.infra.cli", "serve"]]
    assert len(found) == 1, f"expected one serving child, found {found}"
    return found[0]


def test_a_killed_serving_process_loses_no_answered_interaction(tmp_path, wait_for):
    model = tiny.make_model(tmp_path / "model")
    gateway_port = free_port()
    gateway = f"http://127.0.0.1:{gateway_port}"
    with running_platform(tmp_path / "data", ["serving"], supervision=SUPERVISION,
                          CLORA_ENGINE_MODEL=str(model), CLORA_ENGINE_PORTS=json.dumps([free_port()]),
                          CLORA_ENGINE_MAX_MODEL_LEN="512", CLORA_ENGINE_MAX_LORA_RANK="8",
                          CLORA_ENGINE_HEALTH_INTERVAL_S="0.5", CLORA_ENGINE_KEEP_ALIVE_S="8",
                          CLORA_ENGINE_START_TIMEOUT_S="300", CLORA_GATEWAY_PORT=str(gateway_port),
                          CLORA_GATEWAY_METRICS_PORT="0", CLORA_GATEWAY_TENANT_RATE_PER_S="1000",
                          CLORA_GATEWAY_TENANT_BURST="1000", CLORA_GATEWAY_TENANT_REFRESH_S="1") as platform:
        client = redis.Redis.from_url(platform.stack.redis_url)
        tenant, key = Registry(client).create_tenant("chaos")
        supervised, broker = platform.services["serving"], platform.stack.processes["broker"]
        clients = Clients(gateway, tenant.id, key)
        clients.start()
        try:
            wait_for(lambda: len(clients.answered()) >= BEFORE_FREEZE, timeout=120,
                     what=f"{BEFORE_FREEZE} answered completions with the broker up")
            victim = serving_child()
            assert victim.pid == supervised.pid
            frozen_at = time.monotonic()
            broker.signal(signal.SIGSTOP)
            try:
                wait_for(lambda: len(clients.answered(after=frozen_at)) >= SPOOLED, timeout=60,
                         what=f"{SPOOLED} completions answered from the spool")
                wait_for(lambda: clients.in_flight >= 2, timeout=30, interval=0.01, what="requests in flight")
                killed_at = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
            finally:
                broker.signal(signal.SIGCONT)
            wait_for(lambda: supervised.restarts >= 1 and http_ok(gateway + "/health"), timeout=240, interval=0.5,
                     what=f"serving's restart (its log ends:\n{supervised.tail(30)})")
            wait_for(lambda: len(clients.answered(after=killed_at)) >= AFTER_RESTART, timeout=120,
                     what=f"{AFTER_RESTART} completions answered by the restarted process")
        finally:
            clients.finish()

        # the kill happened mid-traffic: answers before it (with the broker up, then only spooled),
        # requests it cut, answers after it
        broker_up, after = clients.answered(before=frozen_at), clients.answered(after=killed_at)
        spooled = clients.answered(after=frozen_at, before=killed_at)
        cut = [o for o in clients.outcomes if o.started < killed_at < o.ended and not o.answered]
        assert len(broker_up) >= BEFORE_FREEZE and len(spooled) >= SPOOLED and len(after) >= AFTER_RESTART
        assert cut, "no request in flight was cut by the kill"
        assert supervised.restarts == 1 and supervised.pid != victim.pid
        assert [e.kind for e in supervised.events][:2] == ["exited", "restarted"]
        assert "code -9" in supervised.events[0].detail
        assert broker.restarts == 0, "the broker was restarted: what it had acknowledged is gone"

        # every answered interaction is on the topic, with what its client was served
        answered = {o.id: o for o in clients.answered()}
        assert len(answered) == len(clients.answered()), "a response id was answered twice"
        ids_in = lambda values: {json.loads(v)["interaction_id"] for v in values}
        values = read_keyed(platform.stack.kafka_bootstrap, TOPIC_INTERACTIONS, tenant.id,
                            done=lambda values: answered.keys() <= ids_in(values), timeout_s=120)
        events = [json.loads(v) for v in values]
        recorded = defaultdict(list)
        for ev in events:
            recorded[ev["interaction_id"]].append(ev)
        lost = sorted(answered.keys() - recorded.keys())
        assert not lost, (f"{len(lost)} of {len(answered)} answered interactions are not on {TOPIC_INTERACTIONS}: "
                          f"{[answered[i] for i in lost[:5]]}")
        for rid, outcome in answered.items():
            assert (recorded[rid][0]["response"]["content"] or "") == outcome.text, (rid, recorded[rid][0], outcome)

        # a resend may duplicate an event, but only as a copy: the copies of one interaction are
        # the same event (one event id, which ingest de-duplicates on), and no event id is shared
        # by two interactions
        copies = {rid: evs for rid, evs in recorded.items() if any(ev != evs[0] for ev in evs)}
        assert not copies, f"interactions recorded as different events: {copies}"
        owners = defaultdict(set)
        for ev in events:
            owners[ev["event_id"]].add(ev["interaction_id"])
        assert all(len(ids) == 1 for ids in owners.values()), {e: ids for e, ids in owners.items() if len(ids) > 1}
        duplicated = sum(len(evs) - 1 for evs in recorded.values())
        print(f"answered {len(answered)} ({len(broker_up)} with the broker up, {len(spooled)} spooled before the kill, "
              f"{len(after)} after it), cut {len(cut)}, "
              f"failed {sum(not o.answered for o in clients.outcomes)}, events {len(events)} "
              f"for {len(recorded)} interactions, {duplicated} duplicated by a resend")
        client.close()
