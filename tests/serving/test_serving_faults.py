"""Faults serving survives. They disturb the session's shared engine and broker, so they are
marked `disrupts_shared_stack` and run after every other test (tests/serving/conftest.py).

- The broker is frozen (SIGSTOP; the embedded Tansu keeps its data in memory, so it is not
  killed): serving continues, events are spooled to disk and arrive after SIGCONT.
- A vLLM replica is killed mid-traffic: the gateway answers 503 quickly, restarts the replica
  and reloads every live adapter at its version.
"""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.disrupts_shared_stack]


def test_broker_stopped_serving_continues_and_spool_drains(serving, stack, tenants, client_for, interactions):
    tenant, key = tenants.create(11)
    c = client_for(key)
    c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "warm"}], max_tokens=2)
    logger = serving.gateway.logger
    broker = stack.processes["broker"]
    ids = []
    # Each answer waits for its interaction to be durable: the broker's ack, or the spool once the
    # ack is `ack_timeout_s` late. Blocking on the frozen broker instead would take the gateway's
    # `record_timeout_s` (30 s) and end in a 503; the bound sits far from both, whatever the load.
    bound = logger.ack_timeout_s + 8.0
    assert bound < serving.gateway.settings.record_timeout_s / 2
    broker.signal(signal.SIGSTOP)
    try:
        for i in range(6):
            t0 = time.monotonic()
            r = c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": f"q{i}"}],
                                          max_tokens=4, temperature=0)
            took = time.monotonic() - t0
            assert took < bound, f"answer {i} took {took:.1f} s with the broker frozen: it waited on the broker"
            ids.append(r.id)
        deadline = time.monotonic() + 30
        while logger.spool.count() == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert logger.spool.count() > 0, "events were neither spooled nor (impossibly) acknowledged"
    finally:
        broker.signal(signal.SIGCONT)
    found = interactions(ids, timeout_s=90)
    assert set(found) == set(ids)
    deadline = time.monotonic() + 30
    while logger.spool.count() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert logger.spool.count() == 0


def test_replica_killed_answers_503_then_recovers_with_live_adapters(serving, tenants, client_for):
    a, key_a = tenants.create(11, 12)  # live v2
    b, key_b = tenants.create(13)
    ca, cb = client_for(key_a, timeout=30), client_for(key_b, timeout=30)
    msgs = [{"role": "user", "content": "before"}]
    before_a = ca.chat.completions.create(model=a, messages=msgs, max_tokens=8, temperature=0)
    before_b = cb.chat.completions.create(model=b, messages=msgs, max_tokens=8, temperature=0)
    results: list[tuple[float, int]] = []
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ca.chat.completions.create(model=a, messages=msgs, max_tokens=8, temperature=0)
                results.append((time.monotonic() - t0, 200))
            except openai.APIStatusError as e:
                results.append((time.monotonic() - t0, e.status_code))
                time.sleep(0.2)

    th = threading.Thread(target=traffic)
    th.start()
    replica = serving.gateway.engine.replicas[0]
    restarts = replica.restarts
    time.sleep(1)
    replica.kill(signal.SIGKILL)
    try:
        deadline = time.monotonic() + 400
        while replica.restarts == restarts or not replica.healthy:
            assert time.monotonic() < deadline, "replica not restarted"
            time.sleep(0.5)
        time.sleep(1)
    finally:
        stop.set()
        th.join(60)
    codes = [c for _, c in results]
    assert 503 in codes, codes[:20]
    assert set(codes) <= {200, 503}
    assert all(dt < 3 for dt, c in results if c == 503), "503 must come quickly"
    assert codes[-1] == 200
    # The live adapters used last are resident again at their versions before traffic resumes
    # (any others are reloaded on demand, see test_more_tenants_than_slots_reload_on_demand).
    resident = serving.gateway.engine.resident_names()[0]
    assert f"{a}@v2" in resident and f"{b}@v1" in resident, resident
    after_a = ca.chat.completions.create(model=a, messages=msgs, max_tokens=8, temperature=0)
    after_b = cb.chat.completions.create(model=b, messages=msgs, max_tokens=8, temperature=0)
    assert after_a.model == f"{a}@v2" and after_a.choices[0].message.content == before_a.choices[0].message.content
    assert after_b.choices[0].message.content == before_b.choices[0].message.content
