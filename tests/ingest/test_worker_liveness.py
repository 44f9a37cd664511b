"""The ingest worker's liveness: its loop beats a heartbeat, a loop blocked in a Kafka call stops
beating and the watchdog fires, every broker call it makes is bounded by `request_timeout_ms`.
Unit tests: a fake consumer, no broker or Redis."""

from __future__ import annotations

import threading
import time

import pytest

from clora.ingest.consumer import GroupConsumer, consumer_config
from clora.ingest.settings import IngestSettings
from clora.ingest.worker import IngestWorker
from clora.procs import Heartbeat, heartbeat_mtime


class BlockingConsumer:
    """A consumer whose `poll` never returns after `free_polls` polls (a group join that hangs)."""

    def __init__(self, free_polls: int):
        self.free_polls = free_polls
        self.release = threading.Event()

    def poll(self, timeout_s: float = 0):
        if self.free_polls == 0:
            self.release.wait()
        self.free_polls -= 1
        return []

    def assignment(self):
        return []

    def close(self):
        pass


def test_a_worker_blocked_in_poll_stops_beating_and_its_watchdog_fires(tmp_path, monkeypatch):
    consumer = BlockingConsumer(free_polls=3)
    beat = Heartbeat(tmp_path / "ingest.heartbeat", min_interval_s=0)
    worker = IngestWorker(IngestSettings(metrics_port=0), "127.0.0.1:1", "redis://127.0.0.1:1/0", heartbeat=beat)
    monkeypatch.setattr(worker, "consumer", lambda: consumer)
    monkeypatch.setattr(worker, "_update_gauges", lambda c: None)
    stalled = threading.Event()
    silent_for: list[float] = []
    stop = threading.Event()
    loop = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    try:
        loop.start()
        beat.start_watchdog(1.0, on_stall=lambda s: (silent_for.append(s), stalled.set()))
        assert stalled.wait(15), "the watchdog did not notice the blocked poll"
        assert silent_for[0] > 1.0 and consumer.free_polls == 0
        last = heartbeat_mtime(beat.path)
        assert last is not None                       # it beat while polls returned
    finally:
        stop.set()
        consumer.release.set()
        loop.join(5)


def test_a_beating_loop_never_trips_the_watchdog_and_a_stopped_watch_ends():
    beat = Heartbeat(None)
    tripped = threading.Event()
    stop = threading.Event()
    watch = beat.start_watchdog(0.5, on_stall=lambda s: tripped.set(), stop=stop)
    done = threading.Event()
    threading.Timer(2.0, done.set).start()
    while not done.is_set():
        beat.beat()
        done.wait(0.05)
    stop.set()            # without it the watch would trip once the loop above stops beating
    watch.join(5)
    assert not watch.is_alive() and not tripped.is_set()


def test_every_broker_call_is_bounded():
    s = IngestSettings(metrics_port=0, request_timeout_ms=7000)
    config = consumer_config("127.0.0.1:1", s, "w0")
    assert config["socket.timeout.ms"] == 7000 > config["session.timeout.ms"]
    assert config["enable.auto.commit"] is False        # offsets move only after Redis has the batch


def test_the_rebalance_timeout_is_raised_to_the_session_timeout_librdkafka_requires():
    s = IngestSettings(metrics_port=0, max_poll_interval_ms=2000, session_timeout_ms=6000)
    config = consumer_config("127.0.0.1:1", s, "w0")
    assert config["max.poll.interval.ms"] == 6000 == config["session.timeout.ms"]
    GroupConsumer("127.0.0.1:1", s, ["t"], client_id="w0").close()    # librdkafka accepts it


def test_request_timeout_must_exceed_the_session_timeout():
    with pytest.raises(ValueError, match="request_timeout_ms"):
        IngestSettings(session_timeout_ms=6000, request_timeout_ms=5000)


class CountingConsumer:
    """A consumer with nothing to deliver that counts its polls."""

    def __init__(self):
        self.polls = 0

    def poll(self, timeout_s: float = 0):
        self.polls += 1
        threading.Event().wait(0.01)
        return []

    def assignment(self):
        return []

    def close(self):
        pass


def test_a_slow_buffer_depth_scan_never_holds_the_consumer_loop(monkeypatch):
    """The depth gauges' keyspace scan runs on its own thread: while one hangs, polls go on."""
    import clora.ingest.worker as w

    monkeypatch.setattr(w, "GAUGE_INTERVAL_S", 0.05)
    consumer = CountingConsumer()
    worker = IngestWorker(IngestSettings(metrics_port=0), "127.0.0.1:1", "redis://127.0.0.1:1/0")
    monkeypatch.setattr(worker, "consumer", lambda: consumer)
    scanning, release = threading.Event(), threading.Event()
    monkeypatch.setattr(worker.buffers, "tenants_with_data", lambda: (scanning.set(), release.wait(), [])[2])
    stop = threading.Event()
    loop = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    try:
        loop.start()
        assert scanning.wait(15), "the depth scan never started"
        polls, give_up = consumer.polls, time.monotonic() + 15
        while consumer.polls < polls + 20 and time.monotonic() < give_up:
            time.sleep(0.05)
        assert consumer.polls >= polls + 20 and not release.is_set()
    finally:
        stop.set()
        release.set()
        loop.join(5)
