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


@pytest.mark.parametrize("bad", ["acme\n", "acme\r\n", "\nacme", "acme\x00"])
def test_a_tenant_id_is_matched_whole_so_a_final_newline_is_refused(bad):
    with pytest.raises(ValueError, match="tenant id must be 1-63 chars"):
        validate_tenant_id(bad)


@pytest.mark.parametrize("model", ["acme@v7\n", "acme\n@v7", "acme@v\u0667", "acme@v\uff17"])
def test_a_served_name_is_matched_whole_and_its_version_is_ascii_digits(model):
    """A final newline or another script's digit ('٧', '７': `int` reads both as 7) is no pin."""
    assert parse_served_name(model) == (model, None)


def test_the_id_pattern_refuses_a_final_newline():
    from pydantic import TypeAdapter, ValidationError

    from clora.ids import Id

    ids = TypeAdapter(Id)
    assert ids.validate_python("chatcmpl-1:a@b.c_d") == "chatcmpl-1:a@b.c_d"
    for bad in ["chatcmpl-1\n", "chatcmpl-1\r", "a b"]:
        with pytest.raises(ValidationError, match="should match pattern"):
            ids.validate_python(bad)


def test_the_base_models_name_is_reserved():
    from clora.ids import RESERVED_TENANT_IDS

    assert "base" in RESERVED_TENANT_IDS
    assert all(validate_tenant_id(name) for name in RESERVED_TENANT_IDS)   # reserved, so a valid id


def test_a_derived_id_is_the_same_for_the_same_parts_and_shaped_like_a_fresh_one():
    from clora.ids import derived_id

    assert derived_id("fb", "sha256=ab", "0") == derived_id("fb", "sha256=ab", "0")
    assert len({derived_id("fb", "sha256=ab", "0"), derived_id("fb", "sha256=ab", "1"),
                derived_id("fb", "sha256=ac", "0"), derived_id("fb", "sha256=a", "b0")}) == 4
    assert re.fullmatch(r"fb-[0-9a-f]{32}", derived_id("fb", "x"))


def test_choice_ids_are_the_response_id_for_one_choice_and_indexed_for_more():
    from clora.ids import choice_ids

    assert choice_ids("chatcmpl-1", 1) == ["chatcmpl-1"]
    assert choice_ids("chatcmpl-1", 3) == ["chatcmpl-1-0", "chatcmpl-1-1", "chatcmpl-1-2"]
