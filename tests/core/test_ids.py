"""Ids every part shares (clora.ids): the served name of an adapter version round-trips,
tenant ids are short slugs, and fresh ids are distinct and carry their prefix."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clora.ids import TENANT_ID_PATTERN, new_id, parse_served_name, served_name, validate_tenant_id

tenant_ids = st.from_regex(rf"\A{TENANT_ID_PATTERN}\Z")


def test_served_name_spells_tenant_at_v_version():
    assert served_name("acme", 7) == "acme@v7"
    assert served_name("a-b_c", 123) == "a-b_c@v123"


@given(tenant=tenant_ids, version=st.integers(0, 10**9 - 1))
@settings(max_examples=100, deadline=None)
def test_parse_served_name_reads_back_what_served_name_built(tenant, version):
    assert parse_served_name(served_name(tenant, version)) == (tenant, version)


@pytest.mark.parametrize("model", ["acme", "base", "acme@", "acme@v", "acme@7", "acme@vx", "acme@v-1",
                                   "Acme@v7", "acme@v7@v8", "acme@v1234567890", "@v7"])
def test_anything_but_a_served_name_is_a_bare_model_with_no_version(model):
    """A tenant id (its live version), the base model, or a malformed pin: never a version."""
    assert parse_served_name(model) == (model, None)


@pytest.mark.parametrize("good", ["acme", "a", "0", "t-1234abcd", "a_b-c", "x" * 63])
def test_tenant_ids_are_short_lowercase_slugs(good):
    assert validate_tenant_id(good) == good


@pytest.mark.parametrize("bad", ["", "UPPER", "has space", "x" * 64, "../etc", "-lead", "_lead", "a@v1", "a.b",
                                 "a/b", "a:b"])
def test_anything_else_is_refused_saying_what_a_tenant_id_looks_like(bad):
    with pytest.raises(ValueError, match="tenant id must be 1-63 chars"):
        validate_tenant_id(bad)


def test_new_ids_carry_their_prefix_and_never_repeat():
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"ev-[0-9a-f]{32}", i) for i in ids)
    assert re.fullmatch(r"fb-[0-9a-f]{32}", new_id("fb"))
