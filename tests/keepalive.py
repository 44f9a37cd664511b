"""Does a server keep an idle HTTP/1.1 connection open as long as its clients may reuse it?

A client that sends a request on a pooled connection just as the server closes it for being
idle gets a reset (vLLM, uvicorn, httpx and the openai SDK all default to 5 s, so the race is
real). The platform's servers keep connections open longer than their clients reuse them."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit


def closed_after_idle(urls: list[str], idle_s: float) -> list[str]:
    """GET each URL on a fresh connection, leave every connection idle for `idle_s`, GET again on
    the same connection; returns the URLs whose server closed it meanwhile."""
    conns = []
    for url in urls:
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.request("GET", u.path or "/")
        r = conn.getresponse()
        r.read()
        assert r.status == 200 and not r.will_close, (url, r.status)
        conns.append((url, conn, conn.sock))
    time.sleep(idle_s)
    closed = []
    for url, conn, sock in conns:
        try:
            conn.request("GET", urlsplit(url).path or "/")
            conn.getresponse().read()
            reused = conn.sock is sock
        except (OSError, http.client.HTTPException):
            reused = False
        finally:
            conn.close()
        if not reused:
            closed.append(url)
    return closed
