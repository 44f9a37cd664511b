"""Process helpers any part may use: is a port open, does a URL answer, a free port for a
service about to start, and children that die with their parent.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
from pathlib import Path


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET `url` answers 200 (e.g. a service's /health); False on any other answer
    or a connection error."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


_PORTS = random.Random(int.from_bytes(os.urandom(8), "little"))  # not the global one: tests seed that
_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' local ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, for a service about to start, picked *below* the kernel's ephemeral range.

    A port from bind(("", 0)) is an ephemeral one, the range every outgoing connection's local
    port is also drawn from: between the pick and the service's bind, any client connection on
    the machine can take it (CI saw redis abort on "Address already in use" that way). Below the
    range only another service can take it. Not the same port twice in one process."""
    lo = _ephemeral_low()
    low = 10_000 if lo > 12_000 else 1024
    for _ in range(500):
        port = _PORTS.randrange(low, lo)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # no free port below the range: fall back to the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate_with_parent():
    """A `preexec_fn` that, on Linux, asks for SIGTERM when the spawning process dies, so a
    SIGKILLed parent (`clora up`, the demo, the serving process) never leaves orphaned
    services holding ports and memory. None elsewhere. libc is looked up here, in the
    parent; the child only makes the one call before exec."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
