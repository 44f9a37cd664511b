"""The replica hook's shared-memory queue polling (`clora.serving.vllm_launch.poll_shm_queues`):
on a stand-in, on vLLM's own queue class, and through the hook in a fresh interpreter, as
vLLM's spawned EngineCore and worker run it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import types

import pytest

from clora.serving.vllm_launch import poll_shm_queues, write_site_hook


class _Condition:
    """vLLM's `SpinCondition` as far as the patch reads it: the busy window after a read."""

    def __init__(self, is_reader: bool):
        self.is_reader, self.last_read, self.busy_loop_s, self.idle_waits = is_reader, time.monotonic(), 60.0, 0

    def wait(self, timeout_ms=None):
        self.idle_waits += 1


def test_a_reader_in_its_busy_window_sleeps_and_past_it_waits_as_vllm_does():
    module = types.SimpleNamespace(SpinCondition=type("SpinCondition", (_Condition,), {}))
    assert poll_shm_queues(module, 0.05) and poll_shm_queues(module, 9.0)   # the second changes nothing
    reader = module.SpinCondition(True)
    reader.last_read -= 30                    # inside its window, long enough for the longest sleep
    began = time.monotonic()
    reader.wait()
    assert time.monotonic() - began >= 0.05 and reader.idle_waits == 0
    reader.last_read = time.monotonic()       # it just read: a short sleep, not the longest
    began = time.monotonic()
    reader.wait()
    assert time.monotonic() - began < 0.05 and reader.idle_waits == 0
    reader.last_read -= 120                                                 # past its busy window
    reader.wait()
    assert reader.idle_waits == 1
    writer = module.SpinCondition(False)
    writer.wait()
    assert writer.idle_waits == 1                                           # not a reader: vLLM's own
    assert not poll_shm_queues(types.SimpleNamespace(), 0.05)               # a vLLM without the class


@contextlib.contextmanager
def _queue_condition(shm, zmq, address: str):
    """vLLM's writer and reader `SpinCondition` on one inproc address; closed and terminated after.
    The writer binds first, as in vLLM: libzmq 4.3.5 can hang or abort terminating a context whose
    SUB socket connected to an inproc address nobody bound (CI hung in term())."""
    context = zmq.Context()
    writer = shm.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm.SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        yield writer, reader
    finally:
        for sock in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket,
                     writer.local_notify_socket):
            sock.close(linger=0)
        context.term()


def test_vllm_s_reader_blocks_between_checks_instead_of_yielding(monkeypatch):
    zmq = pytest.importorskip("zmq")
    shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    monkeypatch.setattr(shm.SpinCondition, "wait", shm.SpinCondition.wait)    # undone after the test
    yields = []
    monkeypatch.setattr(shm, "sched_yield", lambda: yields.append(1))
    assert poll_shm_queues(shm, 0.05)
    with _queue_condition(shm, zmq, "inproc://clora-poll-test") as (_, reader):
        reader.record_read()                 # it read 0.8 s ago: vLLM would yield and return at once
        reader.last_read -= 0.8
        began = time.monotonic()
        for _ in range(3):
            reader.wait(timeout_ms=60_000)
        assert time.monotonic() - began >= 0.15 and yields == []


def test_vllm_s_reader_wakes_on_the_writer_s_ping_not_at_its_timeout(monkeypatch):
    zmq = pytest.importorskip("zmq")
    shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    monkeypatch.setattr(shm.SpinCondition, "wait", shm.SpinCondition.wait)    # undone after the test
    monkeypatch.setattr(shm, "sched_yield", lambda: pytest.fail("the patched reader yielded"))
    assert poll_shm_queues(shm, 600.0)
    with _queue_condition(shm, zmq, "inproc://clora-ping-test") as (writer, reader):
        reader.busy_loop_s = 3600.0
        reader.last_read -= 480              # in its window: a timeout of 60 s, an eighth of that
        woke = threading.Event()

        def ping() -> None:                  # until the reader is woken (a PUB socket drops pings before
            while not woke.wait(0.01):       # the subscription reaches it)
                writer.notify()

        pinger = threading.Thread(target=ping, daemon=True)
        try:
            pinger.start()
            began = time.monotonic()
            reader.wait(timeout_ms=60_000)
            woke.set()
            assert time.monotonic() - began < 30   # woken by a ping: sleeping would take 60 s
        finally:
            woke.set()
            pinger.join()


def test_the_hook_patches_the_queue_in_a_fresh_interpreter(tmp_path):
    pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    hook = write_site_hook(tmp_path / "site")
    code = ("from vllm.distributed.device_communicators import shm_broadcast as m\n"
            "print('poll', getattr(m.SpinCondition.wait, 'clora_poll_s', None))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *sys.path]), "CLORA_VLLM_SHM_POLL_S": "0.002",
           "CLORA_VLLM_CPU_LORA_OPS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "poll 0.002" in out.stdout and "shared-memory queue readers poll at most every 0.002 s" in out.stderr
    unset = subprocess.run([sys.executable, "-c", code], env={**env, "CLORA_VLLM_SHM_POLL_S": ""},
                           capture_output=True, text=True, timeout=300)
    assert unset.returncode == 0 and "poll None" in unset.stdout          # vLLM's own without the variable


def test_a_cpu_replica_polls_and_a_gpu_one_keeps_vllm_s_loop_unless_set(tmp_path, monkeypatch):
    from clora.serving import replica as replica_mod
    from clora.serving.replica import CPU_SHM_POLL_S, LocalReplica
    from clora.serving.settings import EngineSettings

    monkeypatch.setenv("CLORA_VLLM_SHM_POLL_S", "7")        # a stray variable is not passed on as it is
    env = {}
    for cpu in (True, False):
        monkeypatch.setattr(replica_mod, "cpu_build", lambda cpu=cpu: cpu)
        for poll in (None, 0.001):
            got = LocalReplica(0, 1, EngineSettings(model=str(tmp_path), log_dir=tmp_path, shm_poll_s=poll)).env()
            env[cpu, poll] = got.get("CLORA_VLLM_SHM_POLL_S"), str(tmp_path / "vllm-site") in got.get("PYTHONPATH", "")
    assert env[True, None] == (f"{CPU_SHM_POLL_S:g}", True) and env[True, 0.001] == ("0.001", True)
    assert env[False, None] == (None, False) and env[False, 0.001] == ("0.001", True)   # the hook only where it patches
