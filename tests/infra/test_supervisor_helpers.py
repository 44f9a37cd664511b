"""Small helpers of the supervisor: is a service answering?"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

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
