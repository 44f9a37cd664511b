"""Tenant leases with fencing tokens on the real Redis (`clora.learner.leases`): acquire, renew,
expire, taken over after expiry with a larger token; a stale holder's checkpoint and version are
refused; tenants spread fairly among 2-3 learners and move when one leaves or joins; a Tinker
run follows its tenant's lease."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from clora.checkpoint_storage import LocalCheckpoints
from clora.fencing import FencedOut
from clora.registry import LearningPolicy, Tenant
from clora.learner.adapter_store import AdapterState
from clora.learner.base_model import load_base_model
from clora.learner.checkpoint import Checkpoints, tenant_checkpoint
from clora.learner.leases import RedisLeases, fair_share, lease_key
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.process import Learner
from clora.learner.publish import Publisher
from clora.learner.scheduler import TenantView
from clora.learner.settings import LearnerSettings

from .helpers import FakeBuffer, FakeRegistry

TTL_S = 0.4
"""Short, for the tests that wait for a lease to lapse: they wait for its key to go, not for time."""
RENEWED_TTL_S = 3.0
"""For the test that renews by hand: its checks come TTL / 12 apart, so only a stall of most of
3 s between two of them could lapse the lease it holds."""


@pytest.fixture()
def pool() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture()
def tenants() -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"t{run}-{i}" for i in range(7)]


def _leases(redis_client, pool: str, *names: str, ttl_s: float = TTL_S) -> list[RedisLeases]:
    return [RedisLeases(redis_client, name, ttl_s, pool=pool) for name in names]


def _lapsed(redis_client, *tenants: str, within_s: float = 60.0) -> None:
    """Wait until every one of `tenants`' lease keys has expired in Redis (an event, not a time;
    `within_s` only bounds a hang)."""
    deadline = time.monotonic() + within_s
    while redis_client.exists(*(lease_key(t) for t in tenants)):
        assert time.monotonic() < deadline, f"the leases of {tenants} never lapsed"
        time.sleep(0.02)


def _settle(learners: list[RedisLeases], tenants: list[str], rounds: int = 3) -> dict[str, list[str]]:
    """Tick every learner's lease work `rounds` times (handing surplus back as the learner does);
    returns each learner's tenants."""
    for learner in learners:
        learner.beat()        # every learner is counted before any takes a tenant
    for _ in range(rounds):
        for learner in learners:
            learner.release(learner.sync(tenants).surplus)
    return {learner.learner_id: sorted(learner.fences) for learner in learners}


def test_a_lease_is_renewed_while_its_holder_works_and_taken_over_with_a_larger_token_after_it_expires(
        redis_client, pool, tenant_id):
    a, b = _leases(redis_client, pool, "a", "b", ttl_s=RENEWED_TTL_S)
    first = a.acquire(tenant_id)
    assert first is not None and first.holder == "a"
    assert b.acquire(tenant_id) is None and b.holder(tenant_id) == first
    acquired = time.monotonic()
    while time.monotonic() - acquired < RENEWED_TTL_S * 1.5:   # renewed for longer than one TTL
        time.sleep(RENEWED_TTL_S / 12)
        assert a.check(tenant_id) == first
        assert redis_client.pttl(lease_key(tenant_id)) > RENEWED_TTL_S * 1000 / 2   # the check restarted it
    assert b.acquire(tenant_id) is None
    _lapsed(redis_client, tenant_id)       # a stops renewing (a hang, a kill -9): the lease lapses
    second = b.acquire(tenant_id)
    assert second is not None and second.holder == "b" and second.token > first.token
    with pytest.raises(FencedOut, match="a no longer holds"):
        a.check(tenant_id)
    assert not a.holds(tenant_id) and a.sync([tenant_id]).lost == (tenant_id,)
    a.release([tenant_id])                 # releasing what it no longer holds leaves b's lease alone
    assert b.holder(tenant_id) == second
    b.close()
    assert b.holder(tenant_id) is None and a.acquire(tenant_id).token > second.token


def test_the_keep_alive_holds_a_lease_through_a_step_longer_than_its_ttl_but_not_through_a_hung_loop(
        redis_client, pool, tenant_id):
    """The loop neither ticks nor checks here (one long step, or a hang): only the keep-alive
    thread renews. Each renewal round asks whether the loop ticked lately; the test waits for
    rounds, not for time: 4 rounds of TTL/3 outlast the TTL."""
    import threading

    def rounds_of(working: bool):
        asked = threading.Semaphore(0)

        def ticked_within(max_silence_s: float) -> bool:
            assert max_silence_s == 60.0
            asked.release()
            return working
        return ticked_within, asked

    a, b = _leases(redis_client, pool, "a", "b")
    first = a.acquire(tenant_id)
    stop = threading.Event()
    working, asked = rounds_of(True)
    renewing = a.keep_alive(working, 60.0, stop)
    for _ in range(4):
        assert asked.acquire(timeout=30)
    assert b.acquire(tenant_id) is None and a.check(tenant_id) == first   # a step of > 1 TTL kept it
    stop.set()
    renewing.join(timeout=30)               # its last renewal is in before the hung rounds count
    assert not renewing.is_alive()

    hung, asked = rounds_of(False)
    a.keep_alive(hung, 60.0, stop := threading.Event())
    for _ in range(4):                      # no renewal in 4 rounds: past the TTL since a's check
        assert asked.acquire(timeout=30)
    stop.set()
    second = b.acquire(tenant_id)
    assert second is not None and second.token > first.token
    with pytest.raises(FencedOut, match="a no longer holds"):
        a.check(tenant_id)


def test_a_learner_restarted_under_its_id_takes_its_leases_back_at_once(redis_client, pool, tenants):
    before, other = _leases(redis_client, pool, "gpu-1-learner", "gpu-2", ttl_s=30)
    _settle([before, other], tenants[:4])
    mine = sorted(before.fences)
    restarted, = _leases(redis_client, pool, "gpu-1-learner", ttl_s=30)      # same id, a new process
    assert restarted.sync(tenants[:4]).gained and sorted(restarted.fences) == mine   # no 30 s wait
    assert all(restarted.fences[t].token > before.fences[t].token for t in mine)
    with pytest.raises(FencedOut):         # the old process's fences are stale
        before.check(mine[0])
    assert all(other.acquire(t) is None for t in mine)


def test_a_stale_holder_can_neither_checkpoint_nor_publish_over_the_new_one(redis_client, pool, tenant_id, tmp_path,
                                                                             tiny_model_dir):
    a, b = _leases(redis_client, pool, "a", "b")
    layout = LoraModel(load_base_model(tiny_model_dir)[0], LoraSpec(rank=4, alpha=8)).layout
    shared = Checkpoints(LocalCheckpoints(tmp_path / "ckpt"), layout.numel)
    old_state = AdapterState(tenant=tenant_id, seed=1, buffer=torch.zeros(4, layout.numel),
                             rng_state=torch.Generator().get_state(), step=3, cursor=12)
    old = a.acquire(tenant_id)
    shared.save(tenant_checkpoint(tenant_id), old_state, old.token)
    _lapsed(redis_client, tenant_id)       # a pauses past its lease
    new = b.acquire(tenant_id)
    resumed = shared.load(tenant_checkpoint(tenant_id))
    assert (resumed.step, resumed.cursor) == (3, 12)
    resumed.step, resumed.cursor = 4, 16
    shared.save(tenant_checkpoint(tenant_id), resumed, new.token)
    # a wakes up and writes what it trained meanwhile, with the token it holds (it did not check)
    with pytest.raises(FencedOut, match="stale"):
        shared.save(tenant_checkpoint(tenant_id), old_state, old.token)
    assert shared.load(tenant_checkpoint(tenant_id)).cursor == 16
    registry = FakeRegistry()
    publisher = Publisher(tmp_path / "adapters", registry, lambda e: None, "tiny", layout, fence=a.check)
    with pytest.raises(FencedOut):
        publisher.publish(tenant_id, torch.zeros(layout.numel), step=4, examples_seen=16, eval_scores={})
    assert registry.adapter_versions(tenant_id) == [] and not (tmp_path / "adapters" / tenant_id).exists()
    ours = Publisher(tmp_path / "adapters", registry, lambda e: None, "tiny", layout, fence=b.check)
    assert ours.publish(tenant_id, torch.zeros(layout.numel), step=4, examples_seen=16, eval_scores={}).version == 1


def test_tenants_spread_fairly_and_move_when_a_learner_leaves_or_joins(redis_client, pool, tenants):
    a, b, c = _leases(redis_client, pool, "a", "b", "c")
    held = _settle([a, b, c], tenants)
    assert sorted(len(v) for v in held.values()) == [2, 2, 3] and fair_share(7, 3) == 3
    assert sorted(t for v in held.values() for t in v) == sorted(tenants)        # each by exactly one
    c.close()                                                                      # c shuts down cleanly
    held = _settle([a, b], tenants)
    assert sorted(len(v) for v in held.values()) == [3, 4]
    assert sorted(t for v in held.values() for t in v) == sorted(tenants)
    d, = _leases(redis_client, pool, "d")                                          # a new learner joins
    held = _settle([a, b, d], tenants)
    assert sorted(len(v) for v in held.values()) == [2, 2, 3] and len(held["d"]) >= 2
    assert sorted(t for v in held.values() for t in v) == sorted(tenants)


def test_a_dead_learners_tenants_are_taken_at_the_first_tick_after_their_leases_lapse(redis_client, pool, tenants):
    a, b = _leases(redis_client, pool, "a", "b")
    held = _settle([a, b], tenants)
    orphans = held["a"]                    # a is killed: it renews nothing from now on
    assert orphans and not set(orphans) & set(b.fences)
    deadline = time.monotonic() + 60       # bounds a hang only; the bound itself is per tick
    # a's leases lapse up to a few ms apart (renewed or taken at different moments of its last tick), so a tick may fall
    # between two lapses: every orphan free before a tick must be b's after it
    while not set(orphans) <= set(b.fences):
        free = {t for t in orphans if not redis_client.exists(lease_key(t))}
        b.sync(tenants)                    # b's tick
        assert free <= set(b.fences), f"{sorted(free - set(b.fences))} were free and b did not take them"
        assert time.monotonic() < deadline, "a's leases never lapsed"
        time.sleep(0.02)
    assert sorted(b.fences) == sorted(tenants) and b.live == 1
    assert all(b.fences[t].token > a.fences[t].token for t in orphans)


class RunsOf:
    """External work with one Tinker-style run per tenant (`<tenant>/tinker/run`), recording
    which learner ran which run and which tenants it was told to drop."""

    def __init__(self, learner: str, ran: list[tuple[str, str]]):
        self.learner, self.ran, self.dropped = learner, ran, []

    def views(self, registered: dict) -> list[TenantView]:
        return [TenantView(f"{t}/tinker/run", False, 1.0, 0, 1, 1) for t in registered]

    def owns(self, key: str) -> bool:
        return "/tinker/" in key

    def run(self, key: str) -> float:
        self.ran.append((self.learner, key))
        return 0.01

    def wait(self, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def drop(self, tenant: str) -> None:
        self.dropped.append(tenant)

    def close(self) -> None:
        pass


def test_a_tinker_run_follows_its_tenants_lease(redis_client, pool, tenants, tmp_path, tiny_model_dir):
    registry = FakeRegistry([Tenant(id=t, policy=LearningPolicy(algorithm="sft")) for t in tenants[:2]])
    ran: list[tuple[str, str]] = []
    learners = {}
    for name in ("a", "b"):
        settings = LearnerSettings(rank=4, alpha=8, adapters_dir=tmp_path / name / "adapters", max_seq_len=64,
                                   checkpoints_dir=tmp_path / "ckpt", metrics_port=0, idle_sleep_s=0.01, lease_ttl_s=1)
        model, tok = load_base_model(tiny_model_dir)
        lr = Learner(settings, model, tok, registry=registry, buffer=FakeBuffer(), announce=lambda e: None,
                     base_model_name="tiny", leases=RedisLeases(redis_client, name, TTL_S, pool=pool))
        lr.leases.beat()
        lr.external = RunsOf(name, ran)
        learners[name] = lr
    for _ in range(4):
        for lr in learners.values():
            lr.tick()
    holder = {t: name for name, lr in learners.items() for t in lr.leases.fences}
    assert sorted(holder) == sorted(tenants[:2]) and set(holder.values()) == {"a", "b"}
    assert ran and all(holder[key.split("/")[0]] == name for name, key in ran)   # only on its tenant's holder
    a_tenant = next(t for t, name in holder.items() if name == "a")
    ran.clear()                            # a dies: no shutdown, no release
    deadline = time.monotonic() + 60        # bounds a hang: b takes it once a's lease lapses
    while not any(key == f"{a_tenant}/tinker/run" for _, key in ran):
        assert time.monotonic() < deadline, "b never ran a's tenant's run"
        learners["b"].tick()
    assert {name for name, _ in ran} == {"b"}
    assert a_tenant in learners["b"].external.dropped       # taken: b reads the run's state afresh
    learners["b"].shutdown()
