"""Versioned hot swap under load: tenant A's adapter is replaced again and again while tenant
B keeps sending requests; B sees no error and no change; each new A version gets served (its
publish-to-serving time is printed; `benchmarks/bench_serving.py` measures it, a test on a
loaded CI machine cannot); a request that started on the old version finishes on it; the old
version is unloaded once drained; rollback switches back."""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.integration

SERVED_WITHIN_S = 60.0
"""A liveness bound, not a speed claim: a version that is not served after this is a bug."""

LONG_STREAM_TOKENS = 480
"""A stream that fills the test engine's 512-token context, so it outlasts a swap."""


def _chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "swap"}],
                                          temperature=0, **{"max_tokens": 12, **kw})


def _wait_serving(client, tenant, version, timeout_s=SERVED_WITHIN_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if _chat(client, tenant, max_tokens=1).model == f"{tenant}@v{version}":
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{tenant}@v{version} not served after {timeout_s} s")


async def _pinned_and_resident(engine, name: str) -> tuple[bool, bool]:
    """Read on the gateway's loop, so that both answers are of the same moment."""
    return engine.pins(name) > 0, name in engine.resident_names()[0]


@pytest.mark.slow
def test_hot_swap_under_load(serving, tenants, client_for, interactions):
    a, key_a = tenants.create(11)
    b, key_b = tenants.create(12)
    ca, cb = client_for(key_a), client_for(key_b)
    b_expected = _chat(cb, b).choices[0].message.content
    stop = threading.Event()
    b_results: list[tuple[str, str | Exception]] = []

    def b_traffic():
        while not stop.is_set():
            try:
                r = _chat(cb, b)
                b_results.append((r.model, r.choices[0].message.content))
            except Exception as e:  # noqa: BLE001 - any failure is what this test looks for
                b_results.append(("error", e))

    threads = [threading.Thread(target=b_traffic) for _ in range(2)]
    for t in threads:
        t.start()
    swapper = serving.gateway.swapper
    try:
        delays = []
        for i, seed in enumerate([13, 14, 13, 14]):
            published = time.time()
            version = tenants.publish(a, seed)
            _wait_serving(ca, a, version)
            swap = next(s for s in reversed(swapper.swaps) if s.tenant == a and s.new and s.new.version == version)
            delays.append(swap.switched - published)
            assert _chat(ca, a).choices[0].message.content == _chat(ca, f"{a}@v{version}").choices[0].message.content
        # A request that starts on one version finishes on it, even though the alias moves on.
        # The stream must still be generating on the server when the new version takes over, so it
        # runs to the context limit (ignore_eos): a short one could finish server-side first and
        # rightly be unpinned and unloaded before the check.
        old = tenants.registry.live_version(a)
        long = {"max_tokens": LONG_STREAM_TOKENS, "extra_body": {"ignore_eos": True}}
        expected_old = _chat(ca, f"{a}@v{old}", **long).choices[0].message.content
        stream = ca.chat.completions.create(model=a, messages=[{"role": "user", "content": "swap"}],
                                            temperature=0, stream=True, **long)
        it = iter(stream)
        first = next(it)
        t_first = time.monotonic()
        new = tenants.publish(a, 15)
        _wait_serving(ca, a, new)
        t_swapped = time.monotonic()
        # While the gateway still relays the stream, its version stays loaded. (A fast engine can
        # finish the stream server-side before the swap; then it is rightly unpinned and may go.)
        pinned, resident = serving.call(_pinned_and_resident(serving.gateway.engine, f"{a}@v{old}"))
        assert resident or not pinned, "a version an in-flight stream uses was unloaded"
        rest = list(it)
        print(f"stream: swapped {t_swapped - t_first:.2f} s after its first chunk (still relayed: {pinned}), "
              f"ended after {time.monotonic() - t_first:.2f} s")
        chunks = [first, *rest]
        assert {c.model for c in chunks} == {f"{a}@v{old}"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_old
        ev = interactions([first.id])[first.id]
        assert ev["adapter_version"] == old
        # Drained: the old version is unloaded.
        deadline = time.monotonic() + 10
        while f"{a}@v{old}" in serving.gateway.engine.resident_names()[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"{a}@v{old}" not in serving.gateway.engine.resident_names()[0]
        # Rollback switches straight back.
        tenants.registry.set_live_version(a, 1)
        _wait_serving(ca, a, 1)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    errors = [r for r in b_results if r[0] == "error"]
    assert not errors, errors[:3]
    assert len(b_results) >= 10
    assert all(m == f"{b}@v1" and text == b_expected for m, text in b_results)
    print(f"publish-to-serving delays: {[round(d, 2) for d in delays]} s")
