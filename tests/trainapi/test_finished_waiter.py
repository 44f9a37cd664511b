"""Held `retrieve_future` calls are woken by their request finishing (a Redis pub/sub message
published in the transaction that records the outcome), not by reading Redis every few
milliseconds; on the suite's real Redis."""

from __future__ import annotations

import asyncio
import threading
import uuid

import httpx
import pytest

from clora.ingest.webhook import async_redis_client
from clora.trainapi import queue

pytestmark = pytest.mark.integration


def test_a_finished_request_wakes_its_waiter_and_no_other(stack):
    import redis

    async def go() -> None:
        r = async_redis_client(stack.redis_url)
        waiter = queue.FinishedWaiter(r)
        await asyncio.wait_for(waiter.subscribed(), 30)
        sync = redis.Redis.from_url(stack.redis_url)
        run, rid, other = f"acme/tinker/{uuid.uuid4().hex}:train:0", f"req-{uuid.uuid4().hex}", f"req-{uuid.uuid4().hex}"
        await asyncio.to_thread(sync.hset, queue.request_key(rid), mapping={"tenant": "acme", "state": "pending"})
        await asyncio.to_thread(sync.rpush, queue.queue_key(run), rid)
        with waiter.watch(rid) as woken, waiter.watch(other) as not_woken:
            await asyncio.to_thread(queue.finish, sync, run, rid, 60, result_json={"ok": 1})
            await asyncio.wait_for(woken.wait(), 30)
            assert not not_woken.is_set()
            await queue.complete(r, other, 60, result_json={"ok": 2})      # a sampling future's finish
            await asyncio.wait_for(not_woken.wait(), 30)
        assert waiter._waiting == {}                                       # nothing left behind
        assert (await queue.outcome(r, rid)).result_json == {"ok": 1}
        waiter.close()
        sync.delete(queue.request_key(rid), queue.request_key(other), queue.run_meta_key(run))
        sync.close()
        await r.aclose()

    asyncio.run(go())


def test_a_held_retrieve_is_answered_when_its_request_finishes_not_at_its_next_poll(service, monkeypatch):
    """With the fallback poll at 30 s and the hold at 25 s, the answer can only come in time
    from the wake-up: the client gives up after 20 s. Redis is read twice, not every 20 ms."""
    tinker = pytest.importorskip("tinker")
    from .conftest import RANK

    service.stop_api()
    service.api_settings = service.settings.model_copy(update={"retrieve_hold_s": 25.0, "retrieve_poll_s": 30.0})
    service.serve_api()
    client = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK).result()
    service.stop_learner()
    rid, run = f"req-{uuid.uuid4().hex}", f"acme/tinker/{training.model_id}"
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    asyncio.run(_enqueue(service.redis_url, run, rid, training.model_id, adam))   # as the API enqueues one
    reads: list[str] = []
    real_outcome = queue.outcome

    async def counted(r, request_id):
        reads.append(request_id)
        return await real_outcome(r, request_id)

    monkeypatch.setattr(queue, "outcome", counted)
    answer: list[httpx.Response] = []
    held = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{service.url}/api/v1/retrieve_future", json={"request_id": rid}, timeout=20,
        headers={"X-API-Key": service.keys["acme"]})))
    held.start()
    while rid not in reads:                                  # the call is held now
        assert held.is_alive(), "retrieve_future answered before its request ran"
        threading.Event().wait(0.05)
    service.start_learner(service.new_learner())             # runs the request and finishes it
    held.join(60)
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    assert reads.count(rid) == 2


async def _enqueue(redis_url: str, run: str, rid: str, model_id: str, adam: dict) -> None:
    r = async_redis_client(redis_url)
    await queue.enqueue(r, run, rid, "acme", model_id, "json", "optim_step", {"adam": adam})
    await r.aclose()
