"""Bad input gets a clear 4xx naming the field, and changes no training state."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

pb = pytest.importorskip("tinker.proto.tinker_public_pb2")

from .conftest import RANK  # noqa: E402

ACME: dict[str, str] = {}
"""acme's Tinker key header (set for each test from the service's registry)."""


@pytest.fixture(autouse=True)
def _acme_key(service):
    ACME["X-API-Key"] = service.keys["acme"]


def post(url, path, body, headers=ACME, **kw):
    return httpx.post(f"{url}/api/v1/{path}", json=body, headers=headers, timeout=30, **kw)


def result(url, request_id, headers=ACME):
    while True:
        r = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers,
                       timeout=30)
        if r.status_code != 408:
            return r


def new_model(url, rank=RANK) -> str:
    session = post(url, "create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
    r = post(url, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                   "lora_config": {"rank": rank, "train_unembed": True}})
    assert r.status_code == 200, r.text
    assert result(url, r.json()["request_id"]).json()["model_id"] == r.json()["model_id"]
    return r.json()["model_id"]


def fwdbwd_body(model_id: str, seq_id: int, loss_fn: str = "cross_entropy") -> bytes:
    req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.array([5, 6, 7], dtype="<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].dense = np.array([6, 7, 8], dtype="<i8").tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    d.loss_fn_inputs["weights"].dense = np.array([0, 1, 1], dtype="<f4").tobytes()
    d.loss_fn_inputs["weights"].dtype = pb.DTYPE_FLOAT32
    return req.SerializeToString()


def fwdbwd(url, body: bytes, headers=ACME):
    return httpx.post(f"{url}/api/v1/forward_backward", content=body, timeout=30,
                      headers={**headers, "Content-Type": "application/x-protobuf"})


def state(backend, model_id):
    st = backend.store.peek(f"acme/tinker/{model_id}")
    backend.store.flush()
    return st.step, st.buffer.clone()


def assert_error(r, status: int, field: str):
    assert r.status_code == status, r.text
    assert r.content and r.json()["error"]["field"] == field, r.text


def test_a_wrong_or_foreign_key_is_401(service):
    url = service.url
    for key in ("", "tml-nope", "clk_abc_def"):
        assert_error(post(url, "client/config", {"sdk_version": "0.38.0"}, headers={"X-API-Key": key}), 401,
                     "X-API-Key")


def test_another_tenants_model_is_404_and_untouched(service):
    url, backend = service.url, service.work.backend
    model_id = new_model(url)
    before = state(backend, model_id)
    beta = {"X-API-Key": service.keys["beta"]}
    assert_error(post(url, "get_info", {"model_id": model_id}, headers=beta), 404, "model_id")
    assert_error(fwdbwd(url, fwdbwd_body(model_id, 1), headers=beta), 404, "model_id")
    assert_error(post(url, "optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {
        "learning_rate": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}}, headers=beta), 404, "model_id")
    after = state(backend, model_id)
    assert after[0] == before[0] and torch.equal(after[1], before[1])


def test_a_seq_gap_is_400_and_the_next_in_order_still_runs(service):
    url, backend = service.url, service.work.backend
    model_id = new_model(url)
    before = state(backend, model_id)
    assert_error(fwdbwd(url, fwdbwd_body(model_id, 2)), 400, "seq_id")
    assert torch.equal(state(backend, model_id)[1], before[1])
    r = fwdbwd(url, fwdbwd_body(model_id, 1))
    assert r.status_code == 200, r.text
    again = fwdbwd(url, fwdbwd_body(model_id, 1))   # a retried POST: the same request
    assert again.json()["request_id"] == r.json()["request_id"]
    out = result(url, r.json()["request_id"], headers={**ACME, "Accept": "application/x-protobuf"})
    msg = pb.ForwardBackwardOutput.FromString(out.content)
    assert msg.metrics["loss:sum"] > 0 and msg.loss_fn_outputs[0].num_datums == 1
    assert_error(fwdbwd(url, fwdbwd_body(model_id, 5)), 400, "seq_id")


def test_malformed_protobuf_and_unknown_loss_are_400_with_no_state_change(service):
    url, backend = service.url, service.work.backend
    model_id = new_model(url)
    before = state(backend, model_id)
    assert_error(fwdbwd(url, b"\xff\xff\xff not protobuf"), 400, "body")
    assert_error(fwdbwd(url, fwdbwd_body(model_id, 1, loss_fn="dro")), 400, "loss_fn")
    body = pb.ForwardBackwardRequest.FromString(fwdbwd_body(model_id, 2))
    del body.data[0].loss_fn_inputs["weights"]
    assert_error(fwdbwd(url, body.SerializeToString()), 400, "data.0.loss_fn_inputs.weights")
    assert_error(fwdbwd(url, b"\x00" * (64 * 1024 + 1)), 413, None)
    after = state(backend, model_id)
    assert after[0] == before[0] and torch.equal(after[1], before[1])
    assert backend.store.peek(f"acme/tinker/{model_id}").micro_steps == 0


def test_an_unsupported_rank_or_module_set_is_400_and_creates_nothing(service):
    url, backend = service.url, service.work.backend
    session = post(url, "create_session", {"tags": []}).json()["session_id"]
    registered = set(backend.store.tenants())
    assert_error(post(url, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                            "lora_config": {"rank": 32}}), 400, "lora_config.rank")
    assert_error(post(url, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                            "lora_config": {"rank": RANK, "train_mlp": False}}), 400,
                 "lora_config.train_mlp")
    assert_error(post(url, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "other",
                                            "lora_config": {"rank": RANK}}), 400, "base_model")
    assert set(backend.store.tenants()) == registered


def test_an_unknown_future_is_410(service):
    url = service.url
    assert_error(post(url, "retrieve_future", {"request_id": "nope"}), 410, "request_id")


def test_an_oversized_json_body_is_413_before_any_route_reads_it(service):
    huge = {"session_id": "x", "tags": ["a" * 1024] * 80}   # over the fixture's 64 KiB max_body_bytes
    r = post(service.url, "create_session", huge)
    assert r.status_code == 413 and r.json()["error"]["code"], r.text
    assert not service.work.runs   # nothing was created
