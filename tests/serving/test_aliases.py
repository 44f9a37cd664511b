"""Tenant aliases (clora.serving.aliases): a switch returns the ref it replaced, and a ref is
served under its version's served name."""

from __future__ import annotations

from clora.ids import served_name
from clora.serving.aliases import AdapterRef, AliasTable


def test_alias_switch_returns_previous():
    t = AliasTable()
    v1, v2 = AdapterRef("a", 1, "/p1"), AdapterRef("a", 2, "/p2")
    assert t.switch("a", v1) is None and t.get("a") == v1
    assert t.switch("a", v2) == v1 and t.get("a").name == "a@v2"
    assert t.switch("a", None) == v2 and t.get("a") is None


def test_a_ref_is_served_under_its_versions_served_name():
    assert AdapterRef("acme", 7, "/p").name == served_name("acme", 7) == "acme@v7"
