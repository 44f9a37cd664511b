"""Process helpers (clora.procs): is a service answering, which ports are free, and a child
the platform starts (a service, a vLLM replica) never outlives its parent, even a SIGKILLed one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from clora.procs import free_port, http_ok, port_open


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_http_ok_is_true_only_for_a_200():
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert http_ok(base + "/health")
        assert not http_ok(base + "/busy")                      # answers, but not 200
        assert port_open("127.0.0.1", server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    closed = free_port()
    assert not http_ok(f"http://127.0.0.1:{closed}/health", timeout=0.5) and not port_open("127.0.0.1", closed)
    assert not http_ok("not a url")


def test_free_ports_are_distinct_bindable_and_never_ephemeral():
    """Ports for services come from below the kernel's ephemeral range, where no client
    connection's local port can take one between the pick and the service's bind."""
    import socket

    from clora.procs import _ephemeral_low

    lo = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(p < lo for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie reparented to init counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")
def test_child_started_like_a_service_dies_with_a_sigkilled_parent():
    # the "serving process": spawns a long-lived child the way ReplicaProcess.spawn does,
    # prints its pid, then waits to be killed
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        from clora.procs import terminate_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 start_new_session=True, preexec_fn=terminate_with_parent())
        print(child.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its SIGKILLed parent")
