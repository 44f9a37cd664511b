"""Registered vs resident adapters (clora.serving.residency): LRU eviction never takes a pinned
adapter, and a full set of pinned adapters is a capacity error quoting both numbers."""

from __future__ import annotations

import pytest

from clora.serving.residency import CapacityError, ResidentSet


def test_lru_evicts_least_recently_used_idle_adapter():
    rs = ResidentSet(3)
    for n in "abc":
        rs.add(n, "/" + n)
    rs.pin("a")
    rs.unpin("a")  # a is now the most recent
    assert rs.full() and rs.victim() == "b"
    rs.pin("b")  # in use: never evicted
    assert rs.victim() == "c"
    rs.pin("c")
    rs.pin("a")
    with pytest.raises(CapacityError, match="all 3 resident adapters"):
        rs.victim()
    with pytest.raises(CapacityError, match="3 of 3"):
        rs.add("d", "/d")
