"""The interaction logger (clora.serving.interactions) against fake producers: it spools through a
broker outage and sends in order later, sets aside what the broker refuses for good, outlives
unexpected errors, and spools what a silent broker did not take when it stops."""

from __future__ import annotations

import json

from clora.ingest.producer import BrokerUnavailable, RecordRefused
from clora.ingest.schemas import InteractionEvent, Message
from clora.serving.interactions import InteractionLogger
from clora.serving.spool import DiskSpool


class FlakyProducer:
    def __init__(self):
        self.up = False
        self.got: list[str] = []

    def send(self, topic, key, value):
        if not self.up:
            raise BrokerUnavailable("could not queue a record for clora.interactions: the producer's queue is full")
        self.got.append(json.loads(value)["interaction_id"])
        return _Done()

    def close(self):
        pass


class _Done:
    def get(self, timeout=None):
        return None


def _event(i: int) -> InteractionEvent:
    return InteractionEvent(tenant="acme", interaction_id=f"i{i}", messages=[Message(role="user", content="q")],
                            response=Message(role="assistant", content="a"))


def test_logger_spools_while_broker_down_and_sends_in_order_later(tmp_path):
    import time

    prod = FlakyProducer()
    lg = InteractionLogger(lambda: prod, DiskSpool(tmp_path), retry_s=0.05).start()
    for i in range(5):
        lg.submit(_event(i))
    deadline = time.time() + 5
    while lg.spool.count() < 5 and time.time() < deadline:
        time.sleep(0.02)
    assert lg.spool.count() == 5 and prod.got == []
    prod.up = True
    lg.submit(_event(5))
    deadline = time.time() + 5
    while len(prod.got) < 6 and time.time() < deadline:
        time.sleep(0.02)
    assert prod.got == [f"i{i}" for i in range(6)]
    assert lg.spool.count() == 0
    lg.stop()


class PickyProducer(FlakyProducer):
    """Refuses for good what `EventProducer` does: a record too large to queue (at `send`) or
    one the broker rejects (at the ack)."""

    def send(self, topic, key, value):
        iid = json.loads(value)["interaction_id"]
        if iid == "i1":
            raise RecordRefused("could not queue a record: Message size too large (MSG_SIZE_TOO_LARGE)")
        if iid == "i2":
            return _Refused()
        return super().send(topic, key, value)


class _Refused:
    def get(self, timeout=None):
        raise RecordRefused("broker did not store a write: Broker: Invalid record (INVALID_RECORD)")


def _wait(predicate, timeout_s=5.0):
    import time

    deadline = time.time() + timeout_s
    while not predicate() and time.time() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_record_the_broker_refuses_for_good_is_set_aside_and_the_rest_flow(tmp_path):
    prod = PickyProducer()
    lg = InteractionLogger(lambda: prod, DiskSpool(tmp_path), retry_s=0.05).start()
    for i in range(4):  # broker down: all four go to the spool
        lg.submit(_event(i))
    assert _wait(lambda: lg.spool.count() == 4)
    prod.up = True
    lg.submit(_event(4))
    assert _wait(lambda: prod.got == ["i0", "i3", "i4"]), prod.got
    assert _wait(lambda: lg.spool.empty()) and lg.rejected == 2
    rejected = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert [json.loads(r["value"])["interaction_id"] for r in rejected] == ["i1", "i2"]
    assert "MSG_SIZE_TOO_LARGE" in rejected[0]["error"]
    lg.submit(_event(5))  # not blocked behind them
    assert _wait(lambda: prod.got[-1:] == ["i5"])
    lg.stop()


class _FailingOnceSpool(DiskSpool):
    def __init__(self, dir):
        super().__init__(dir)
        self.failures = 1

    def append(self, records):
        if self.failures:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        super().append(records)


def test_the_logger_outlives_an_unexpected_error_and_keeps_the_batch(tmp_path):
    prod = FlakyProducer()
    lg = InteractionLogger(lambda: prod, _FailingOnceSpool(tmp_path), retry_s=0.05).start()
    lg.submit(_event(0))  # broker down, and the spool's first write fails
    assert _wait(lambda: lg.spool.count() == 1)  # kept and spooled on the next round
    prod.up = True
    lg.submit(_event(1))
    assert _wait(lambda: prod.got == ["i0", "i1"]), prod.got
    lg.stop()


class _FailingOnceReadSpool(DiskSpool):
    def __init__(self, dir):
        super().__init__(dir)
        self.failures = 0

    def pending(self, limit=1000):
        if self.failures:
            self.failures -= 1
            raise OSError(5, "Input/output error")
        return super().pending(limit)


def test_a_batch_already_spooled_is_not_spooled_again_when_the_drain_fails(tmp_path):
    prod = FlakyProducer()
    lg = InteractionLogger(lambda: prod, _FailingOnceReadSpool(tmp_path), retry_s=0.05).start()
    lg.submit(_event(0))  # broker down: spooled
    assert _wait(lambda: lg.spool.count() == 1)
    lg.spool.failures = 1
    lg.submit(_event(1))  # appended to the spool, then the drain's read fails once
    assert _wait(lambda: lg.spool.failures == 0 and lg.spool.count() == 2)
    prod.up = True
    assert _wait(lambda: prod.got == ["i0", "i1"]), prod.got  # each once
    lg.stop()


class _Hanging:
    def get(self, timeout=None):
        import time

        time.sleep(timeout)
        raise BrokerUnavailable("no acknowledgement within 0.5 s")


class HangingProducer(FlakyProducer):
    """A broker that takes records and never acknowledges them."""

    def send(self, topic, key, value):
        return _Hanging()


def test_stop_spools_what_a_silent_broker_did_not_take_in_time(tmp_path):
    lg = InteractionLogger(lambda: HangingProducer(), DiskSpool(tmp_path), retry_s=0.05, ack_timeout_s=0.5).start()
    for i in range(3):
        lg.submit(_event(i))
    lg.stop(timeout_s=0.1)  # the thread is still waiting for acks: stop gives the broker up, then closes
    assert not lg._thread.is_alive()
    assert [json.loads(r.value)["interaction_id"] for r in DiskSpool(tmp_path).pending()] == ["i0", "i1", "i2"]


class FreezingProducer(FlakyProducer):
    """Down (refuses at once) until `freeze`; then takes records and holds every ack until
    `thaw`, like a SIGSTOPped broker whose connections stay open."""

    def __init__(self):
        super().__init__()
        import threading

        self.frozen, self.thawed, self.blocked = False, threading.Event(), threading.Event()

    def send(self, topic, key, value):
        if not self.frozen:
            return super().send(topic, key, value)
        self.got.append(json.loads(value)["interaction_id"])
        return _Held(self)


class _Held:
    def __init__(self, producer):
        self.producer = producer

    def get(self, timeout=None):
        self.producer.blocked.set()
        if not self.producer.thawed.wait(timeout):
            raise BrokerUnavailable("no acknowledgement within 0.5 s")


def test_new_events_never_wait_behind_a_drain_to_a_frozen_broker(tmp_path):
    prod = FreezingProducer()
    lg = InteractionLogger(lambda: prod, DiskSpool(tmp_path), retry_s=0.05, ack_timeout_s=60).start()
    lg.submit(_event(0)).result(timeout=10)  # broker down: spooled
    assert lg.spool.count() == 1
    prod.frozen = True
    assert prod.blocked.wait(10), "the drain never tried the frozen broker"
    for i in (1, 2, 3):  # the drain is stuck for up to 60 s: these are spooled meanwhile
        lg.submit(_event(i)).result(timeout=10)
    assert lg.spool.count() == 4 and not prod.thawed.is_set()
    prod.thawed.set()
    assert _wait(lambda: lg.spool.empty())
    assert prod.got == ["i0", "i1", "i2", "i3"]  # in order, each once
    lg.stop()
