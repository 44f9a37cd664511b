"""The fair queue (`clora.serving.fair_queue`) on its own: the order it sends requests in, weights,
the charge corrected to what a request generated, cancellation while waiting, no starvation,
no burst credit for idle time. Every test drives the event loop step by step; nothing is timed."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from clora.serving.fair_queue import FairQueue, TenantWeights, Ticket


async def settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(10):
        await asyncio.sleep(0)


class Clients:
    """Admit requests as tasks and keep what was sent, in order."""

    def __init__(self, q: FairQueue):
        self.q = q
        self.sent: list[Ticket] = []
        self.tasks: list[asyncio.Task] = []

    def offer(self, tenant: str, sequences: int = 1, cost: float = 10.0, weight: float = 1.0) -> asyncio.Task:
        async def one() -> Ticket:
            t = await self.q.admit(tenant, sequences, cost, weight)
            self.sent.append(t)
            return t
        task = asyncio.create_task(one())
        self.tasks.append(task)
        return task

    def order(self) -> list[str]:
        return [t.tenant for t in self.sent]

    async def finish_oldest(self, generated: int | None = None) -> Ticket:
        t = next(t for t in self.sent if not getattr(t, "released", False))
        t.generated = generated
        t.released = True
        self.q.release(t)
        await settle()
        return t


def test_a_light_tenant_goes_before_a_heavy_tenants_backlog():
    """The module docstring's example: capacity 2, A sends 4 then B 1; B is sent third."""
    async def go():
        c = Clients(FairQueue(2))
        for _ in range(4):
            c.offer("a")
        await settle()
        c.offer("b")
        await settle()
        assert c.order() == ["a", "a"] and c.q.waiting() == 3
        for _ in range(3):
            await c.finish_oldest()
        return c.order()

    assert asyncio.run(go()) == ["a", "a", "b", "a", "a"]


def test_backlogged_tenants_alternate_whatever_they_offer():
    async def go():
        c = Clients(FairQueue(1))
        for _ in range(30):
            c.offer("heavy")
        for _ in range(3):
            c.offer("light")
        await settle()
        for _ in range(8):
            await c.finish_oldest()
        return c.order()

    order = asyncio.run(go())
    assert order[:7] == ["heavy", "light", "heavy", "light", "heavy", "light", "heavy"], order


def test_sends_follow_weights_among_backlogged_tenants():
    async def go():
        c = Clients(FairQueue(1))
        for _ in range(100):
            c.offer("big", weight=3.0)
            c.offer("small", weight=1.0)
        await settle()
        for _ in range(79):
            await c.finish_oldest()
        return Counter(c.order()[:80])

    picks = asyncio.run(go())
    assert picks == {"big": 60, "small": 20}, picks


def test_a_tenant_is_charged_the_tokens_it_generated_not_its_max_tokens():
    """Both ask for up to 100 tokens; a's requests generate 10: a gets ~10x the requests."""
    async def go():
        c = Clients(FairQueue(1))
        for _ in range(60):
            c.offer("a", cost=100)
            c.offer("b", cost=100)
        await settle()
        tokens = Counter()
        for _ in range(55):
            t = c.sent[-1]
            generated = 10 if t.tenant == "a" else 100
            tokens[t.tenant] += generated
            await c.finish_oldest(generated)
        return Counter(c.order()), tokens

    picks, tokens = asyncio.run(go())
    assert picks["a"] >= 8 * picks["b"] > 0, picks
    assert abs(tokens["a"] - tokens["b"]) <= 100, tokens  # tokens, not requests, are what is shared


def test_a_request_cancelled_while_waiting_frees_its_place():
    async def go():
        c = Clients(FairQueue(1))
        c.offer("a")
        await settle()
        doomed = c.offer("b")
        c.offer("c")
        await settle()
        assert c.q.waiting() == 2
        doomed.cancel()
        await settle()
        assert doomed.cancelled() and c.q.waiting("b") == 0 and c.q.waiting() == 1
        await c.finish_oldest()
        return c.order(), c.q

    order, q = asyncio.run(go())
    assert order == ["a", "c"] and q.in_flight == 1 and q.waiting() == 0


def test_cancelling_a_blocked_head_lets_the_next_request_through():
    """A head needing 2 sequences blocks the queue while 1 is free; cancelled, the next one goes."""
    async def go():
        c = Clients(FairQueue(2))
        c.offer("a")
        await settle()
        wide = c.offer("b", sequences=2)
        await settle()
        c.offer("a")
        await settle()
        assert c.order() == ["a"]  # the second "a" fits but does not overtake b's head
        wide.cancel()
        await settle()
        return c.order()

    assert asyncio.run(go()) == ["a", "a"]


def test_a_request_sent_just_as_it_is_cancelled_gives_its_sequences_back():
    async def go():
        c = Clients(FairQueue(1))
        c.offer("a")
        await settle()
        late = c.offer("b")
        await settle()
        await asyncio.sleep(0)
        c.q.release(c.sent[0])  # b's ticket is set here ...
        late.cancel()             # ... and b is cancelled before it could run
        await settle()
        return late, c.q

    late, q = asyncio.run(go())
    assert late.cancelled() and q.in_flight == 0 and q.waiting() == 0


def test_a_request_cancelled_just_before_a_release_is_skipped_not_sent():
    """Cancelling a waiting request cancels its future at once, but it leaves the queue only when
    its task next runs. A release in between (another request ending) must pass it over, not
    send it: sending it raised in the releasing request and kept the sequence in flight forever,
    shrinking the queue for every tenant."""
    async def go():
        c = Clients(FairQueue(1))
        c.offer("a")
        await settle()
        gone, other = c.offer("b"), c.offer("c")
        await settle()
        gone.cancel()             # b's future is cancelled now, its task has not run yet ...
        c.q.release(c.sent[0])    # ... when a's request ends
        await settle()
        assert gone.cancelled() and c.order() == ["a", "c"] and c.q.in_flight == 1 and c.q.waiting() == 0
        await c.finish_oldest()
        return other, c.q

    other, q = asyncio.run(go())
    assert other.done() and q.in_flight == 0 and q.waiting() == 0 and q.free == q.capacity


def test_many_requests_cancelled_at_once_leave_the_queue_whole():
    """Every waiting request cancelled in one go (a shutdown, many clients gone), with releases
    among them: nothing raises, and every sequence comes back."""
    async def go():
        c = Clients(FairQueue(2))
        for tenant in "aabbccdd":
            c.offer(tenant)
        await settle()
        waiting = [t for t in c.tasks if not t.done()]
        for task in waiting[:3]:
            task.cancel()
        await c.finish_oldest()
        for task in waiting[3:]:
            task.cancel()
        await c.finish_oldest()
        await c.finish_oldest()
        await settle()
        errors = [t.exception() for t in c.tasks if t.done() and not t.cancelled() and t.exception()]
        return errors, c.q

    errors, q = asyncio.run(go())
    assert errors == [] and q.in_flight == 0 and q.waiting() == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def in_flight(q: FairQueue) -> dict[str, int]:
    return {tenant: lane.in_flight for tenant, lane in q._lanes.items() if lane.in_flight}


def finish(c: Clients, tenant: str, generated: int | None = None) -> None:
    """End `tenant`'s oldest request in flight (no settle: the caller decides what runs next)."""
    t = next(t for t in c.sent if t.tenant == tenant and not getattr(t, "released", False))
    t.generated, t.released = generated, True
    c.q.release(t)


def test_while_both_want_more_neither_holds_more_than_its_share_however_long_its_requests():
    """a's long requests took every slot while it was alone; once b waits too, each slot a frees
    goes to b until both hold their share (2 of 4), and a's next requests wait for a's own slots."""
    async def go():
        c = Clients(FairQueue(4, clock=FakeClock(), grace_s=1.0))
        for _ in range(6):
            c.offer("a", cost=100)
        await settle()
        assert in_flight(c.q) == {"a": 4}          # alone: the whole engine
        for _ in range(6):
            c.offer("b", cost=10)
        await settle()
        shares = []
        for _ in range(3):
            finish(c, "a", 100)
            await settle()
            shares.append(in_flight(c.q))
        return shares

    assert asyncio.run(go()) == [{"a": 3, "b": 1}, {"a": 2, "b": 2}, {"a": 2, "b": 2}]


def test_a_tenant_between_requests_keeps_its_share_for_its_grace_and_no_longer():
    """b (short requests) ends one and has nothing waiting: within its grace the free slot is not
    given to a, which already holds its share; b's next request takes it. Once the grace is over,
    a may take it."""
    async def go():
        clock = FakeClock()
        c = Clients(FairQueue(2, clock=clock, grace_s=1.0))
        c.offer("a", cost=100)
        c.offer("b", cost=10)
        c.offer("a", cost=100)
        await settle()
        assert in_flight(c.q) == {"a": 1, "b": 1} and c.q.waiting("a") == 1
        finish(c, "b", 10)
        await settle()
        held = (in_flight(c.q), c.q.free)            # a waits although a slot is free
        clock.now += 0.5
        c.offer("b", cost=10)                        # b's client is back within its grace
        await settle()
        back = in_flight(c.q)
        finish(c, "b", 10)
        clock.now += 2.0                             # b sends nothing more: its grace runs out
        c.offer("c", cost=10)                        # (any event; the queue's timer also sends)
        await settle()
        return held, back, in_flight(c.q)

    held, back, after = asyncio.run(go())
    assert held == ({"a": 1}, 1)
    assert back == {"a": 1, "b": 1}
    assert after == {"a": 1, "c": 1}, "c came first in fair order; a's second request still waits its turn"


def test_when_a_tenants_grace_runs_out_its_held_slot_is_sent_without_another_event():
    async def go():
        c = Clients(FairQueue(2, grace_s=0.05))       # the real clock: the queue's own timer
        c.offer("a", cost=100)
        c.offer("b", cost=10)
        waiting = c.offer("a", cost=100)
        await settle()
        finish(c, "b", 10)
        await settle()
        assert not waiting.done()                     # held for b
        ticket = await asyncio.wait_for(waiting, timeout=30)
        return ticket, c.q

    ticket, q = asyncio.run(go())
    assert ticket.tenant == "a" and q.in_flight == 2


def test_a_wide_request_is_not_starved_by_narrow_ones():
    async def go():
        c = Clients(FairQueue(4))
        for _ in range(4):
            c.offer("narrow")
        await settle()
        c.offer("wide", sequences=4)
        for _ in range(200):
            c.offer("narrow")
        await settle()
        for _ in range(8):
            await c.finish_oldest()
        return c.order()

    order = asyncio.run(go())
    assert "wide" in order, order


def test_an_idle_tenant_earns_no_burst():
    """a ran alone for 50 requests; b arriving then alternates with a, it does not get 50 in a row."""
    async def go():
        c = Clients(FairQueue(1))
        for _ in range(50):
            c.offer("a")
            await settle()
            await c.finish_oldest()
        for _ in range(10):
            c.offer("a")
            c.offer("b")
        await settle()
        for _ in range(9):
            await c.finish_oldest()
        return c.order()[50:]

    assert asyncio.run(go()) == ["a", "b"] * 5


def test_a_request_wider_than_the_queue_is_refused_at_once():
    with pytest.raises(ValueError, match="never fit"):
        asyncio.run(FairQueue(2).admit("a", 3, 10))


def test_weights_are_read_from_the_registry_and_a_failed_read_keeps_the_last():
    now = [0.0]

    class Registry:
        weight: float | None = 2.0

        def get_tenant(self, tenant):
            if self.weight is None:
                raise ConnectionError("registry down")
            return type("T", (), {"policy": type("P", (), {"weight": self.weight})})

    reg = Registry()
    w = TenantWeights(reg, refresh_s=5.0, clock=lambda: now[0])
    assert asyncio.run(w.get("acme")) == 2.0
    reg.weight = 4.0
    assert asyncio.run(w.get("acme")) == 2.0  # cached
    now[0] = 6.0
    assert asyncio.run(w.get("acme")) == 4.0
    reg.weight, now[0] = None, 12.0
    assert asyncio.run(w.get("acme")) == 4.0
    assert asyncio.run(w.get("new")) == 1.0
