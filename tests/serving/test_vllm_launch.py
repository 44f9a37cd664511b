"""The replica hook's shared-memory spin limit (`clora.serving.vllm_launch.limit_shm_spin`): on
vLLM's own queue class, and through the hook in a fresh interpreter, as vLLM's spawned
EngineCore and worker run it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types

import pytest

from clora.serving.vllm_launch import limit_shm_spin, write_site_hook


class _Condition:
    def __init__(self, is_reader: bool):
        self.is_reader, self.busy_loop_s = is_reader, 1.0


def test_readers_get_the_limit_writers_keep_theirs_and_a_second_patch_changes_nothing():
    module = types.SimpleNamespace(SpinCondition=type("SpinCondition", (_Condition,), {}))
    assert limit_shm_spin(module, 0.0) and limit_shm_spin(module, 0.5)
    assert module.SpinCondition(True).busy_loop_s == 0.0          # the first limit stays
    assert module.SpinCondition(False).busy_loop_s == 1.0
    assert not limit_shm_spin(types.SimpleNamespace(), 0.0)       # a vLLM without the class: untouched


def test_vllm_s_reader_sleeps_until_its_writer_pings_it(monkeypatch):
    zmq = pytest.importorskip("zmq")
    shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    monkeypatch.setattr(shm.SpinCondition, "__init__", shm.SpinCondition.__init__)   # undone after the test
    assert limit_shm_spin(shm, 0.0)
    context, address = zmq.Context(), "inproc://clora-spin-test"
    writer = shm.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm.SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        assert reader.busy_loop_s == 0.0 and writer.busy_loop_s == 0
        reader.record_read()              # it just read: vLLM would now spin for a second
        began = time.monotonic()
        reader.wait(timeout_ms=300)       # nothing written: it waits on the socket the whole time
        assert time.monotonic() - began >= 0.25
        woke = threading.Event()
        waiter = threading.Thread(target=lambda: (reader.wait(timeout_ms=60_000), woke.set()))
        waiter.start()
        while not woke.wait(0.05):        # a ping sent before the subscription joins is lost: send until heard
            writer.notify()
        waiter.join()
    finally:
        for sock in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket,
                     writer.local_notify_socket):
            sock.close(linger=0)
        context.term()


def test_the_hook_limits_the_spin_in_a_fresh_interpreter(tmp_path):
    pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    hook = write_site_hook(tmp_path / "site")
    code = ("import zmq\n"
            "from vllm.distributed.device_communicators import shm_broadcast as m\n"
            "c = m.SpinCondition(is_reader=True, context=zmq.Context(), notify_address='inproc://x')\n"
            "print('busy_loop_s', c.busy_loop_s)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *sys.path]), "CLORA_VLLM_SHM_SPIN_S": "0.002",
           "CLORA_VLLM_CPU_LORA_OPS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "busy_loop_s 0.002" in out.stdout
    assert "shared-memory queue readers spin 0.002 s" in out.stderr
    unset = subprocess.run([sys.executable, "-c", code], env={**env, "CLORA_VLLM_SHM_SPIN_S": ""},
                           capture_output=True, text=True, timeout=300)
    assert unset.returncode == 0 and "busy_loop_s 1" in unset.stdout   # vLLM's own without the variable


def test_a_cpu_replica_limits_the_spin_and_a_gpu_one_keeps_vllm_s_unless_set(tmp_path, monkeypatch):
    from clora.serving import replica as replica_mod
    from clora.serving.replica import LocalReplica
    from clora.serving.settings import EngineSettings

    monkeypatch.setenv("CLORA_VLLM_SHM_SPIN_S", "7")        # a stray variable is not passed on as it is
    env = {}
    for cpu in (True, False):
        monkeypatch.setattr(replica_mod, "cpu_build", lambda cpu=cpu: cpu)
        for spin in (None, 0.25):
            got = LocalReplica(0, 1, EngineSettings(model=str(tmp_path), log_dir=tmp_path, shm_spin_s=spin)).env()
            env[cpu, spin] = got.get("CLORA_VLLM_SHM_SPIN_S"), str(tmp_path / "vllm-site") in got.get("PYTHONPATH", "")
    assert env[True, None] == ("0", True) and env[True, 0.25] == ("0.25", True)
    assert env[False, None] == (None, False) and env[False, 0.25] == ("0.25", True)   # the hook only where it patches
