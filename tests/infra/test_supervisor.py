"""The supervisor restarts a child that dies, and one that is still running but shows no sign of
life: a heartbeat that stops, a liveness check that stops answering. Real child processes (small
Python scripts), no broker or Redis."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import pytest

from clora.infra.supervisor import ManagedProcess

# beats its heartbeat `n` times (n from argv), then hangs without exiting, as a worker blocked
# in a group join does
HANGS_AFTER_BEATS = """
import os, sys, time
from clora.procs import Heartbeat
beat = Heartbeat.from_env()
beat.min_interval_s = 0
for _ in range(int(sys.argv[1])):
    beat.beat()
    time.sleep(0.1)
time.sleep(3600)
"""


def child(tmp_path, name: str, script: str, *args: str, **kw) -> ManagedProcess:
    return ManagedProcess(name=name, argv=[sys.executable, "-c", script, *args], log_path=tmp_path / f"{name}.log",
                          healthy=lambda: True, restart=True, liveness_interval_s=0.2, **kw)


def test_a_child_whose_heartbeat_stops_is_killed_restarted_and_logged(tmp_path, wait_for, caplog):
    proc = child(tmp_path, "worker", HANGS_AFTER_BEATS, "5", heartbeat=True, unresponsive_after_s=1.5)
    events = []
    proc.on_event = events.append
    with caplog.at_level(logging.ERROR, logger="clora.infra.supervisor"):
        proc.start()
        try:
            first = proc.pid
            wait_for(lambda: proc.restarts >= 1 and proc.alive(), timeout=30, what="the hung child's restart")
            assert proc.pid != first
            assert [e.kind for e in events[:2]] == ["unresponsive", "restarted"]
            assert events[0].service == "worker" and "no sign of life" in events[0].detail
            assert any("hung" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
        finally:
            proc.stop()
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(first, 0)                              # the hung one was killed, not left behind


def test_a_child_that_keeps_beating_is_left_alone(tmp_path, wait_for):
    proc = child(tmp_path, "busy", HANGS_AFTER_BEATS, "40", heartbeat=True, unresponsive_after_s=1.5).start()
    try:
        beats = proc.heartbeat_path
        wait_for(lambda: beats.exists(), what="the first beat")
        ended = threading.Event()
        threading.Timer(3.0, ended.set).start()       # 40 beats at 0.1 s: alive for ~4 s
        while not ended.is_set():
            assert proc.restarts == 0, proc.events
            ended.wait(0.1)
    finally:
        proc.stop()


def test_a_child_whose_liveness_check_fails_is_restarted(tmp_path, wait_for):
    answering = threading.Event()
    answering.set()
    proc = child(tmp_path, "http", "import time; time.sleep(3600)", liveness=answering.is_set,
                 unresponsive_after_s=1.0).start()
    try:
        first = proc.pid
        answering.clear()                             # stops answering (a frozen event loop, say)
        wait_for(lambda: proc.restarts == 1, timeout=20, what="a restart after the check stopped answering")
        answering.set()
        wait_for(lambda: proc.alive() and proc.pid != first, what="the new child")
        assert [e.kind for e in proc.events] == ["unresponsive", "restarted"]
    finally:
        proc.stop()


def test_a_child_that_dies_is_restarted_and_runs_its_restart_hook(tmp_path, wait_for):
    hooked = []
    proc = child(tmp_path, "dies", "import time; time.sleep(3600)", on_restart=hooked.append).start()
    try:
        proc.signal(signal.SIGKILL)
        wait_for(lambda: hooked == [proc], timeout=20, what="the restart hook")
        assert proc.alive() and proc.restarts == 1
        assert proc.events[0].kind == "exited" and "-9" in proc.events[0].detail
    finally:
        proc.stop()
    assert not proc.alive()


def test_stop_during_a_restart_leaves_nothing_running(tmp_path, wait_for):
    slow = threading.Event()
    proc = child(tmp_path, "slow", "import time; time.sleep(3600)")
    proc.start()
    proc.healthy = slow.is_set                        # the next start never becomes healthy
    proc.start_timeout_s = 60
    proc.signal(signal.SIGKILL)
    wait_for(lambda: proc.restarts == 1, what="a restart to begin")
    proc.stop()
    assert not proc.alive()
