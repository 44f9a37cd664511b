"""`Coalesced`: the calls of one key that arrive while its call is in flight share the next
call, each caller gets its own items' answers, and a key's error reaches only its callers."""

from __future__ import annotations

import asyncio

import pytest

from clora.ingest.webhook import Coalesced


def test_calls_share_per_key_and_errors_stay_with_their_key():
    calls: list[tuple[str, list]] = []
    gate = asyncio.Event()

    async def run(key: str, items: list) -> list:
        calls.append((key, list(items)))
        await gate.wait()
        if key == "bad":
            raise RuntimeError("bad key")
        return [f"{key}:{i}" for i in items]

    async def main():
        c = Coalesced(run)
        first = asyncio.create_task(c([1], key="a"))            # in flight until the gate opens
        await asyncio.sleep(0)
        rest = [asyncio.create_task(c([i, i + 10], key="a")) for i in (2, 3)]
        other = asyncio.create_task(c([7], key="b"))
        bad = [asyncio.create_task(c([i], key="bad")) for i in (8, 9)]
        await asyncio.sleep(0)
        gate.set()
        assert await first == ["a:1"]
        assert [await t for t in rest] == [["a:2", "a:12"], ["a:3", "a:13"]]
        assert await other == ["b:7"]
        for t in bad:
            with pytest.raises(RuntimeError, match="bad key"):
                await t
        assert await c([], key="a") == []

    asyncio.run(main())
    # a's three callers cost two calls; b and bad one each
    assert sorted(calls) == [("a", [1]), ("a", [2, 12, 3, 13]), ("b", [7]), ("bad", [8, 9])]
