"""Process helpers any part may use: is a port open, does a URL answer, a free port for a
service about to start, children that die with their parent, the heartbeat a long-running
service gives its supervisor, and `ServerThread` (an app on uvicorn in a thread, for tests and
in-process benchmarks), and `tune_gc` for a service's hot path.

    beat = Heartbeat.from_env()       # the file `clora up` named in CLORA_HEARTBEAT_FILE, if any
    beat.start_watchdog(60.0)         # exit (code 70) if the loop below stalls for 60 s
    while running:
        beat.beat()                   # once per pass of the main loop
        ...
"""

from __future__ import annotations

import gc
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
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


def http_answers(url: str, timeout: float = 2.0) -> bool:
    """True when GET `url` gets any HTTP answer, an error status included (a server that answers
    503 while its engine restarts is alive); False when nothing answers in time."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
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


HEARTBEAT_ENV = "CLORA_HEARTBEAT_FILE"
"""The environment variable through which a supervisor names a child's heartbeat file."""

WATCHDOG_EXIT_CODE = 70
"""A service's exit code when its own watchdog found its main loop stalled."""


class Heartbeat:
    """The liveness signal of one service: each `beat()` (one per pass of its main loop) records
    the time in-process and, at most every `min_interval_s`, touches the heartbeat file, whose
    modification time the supervisor watches. A loop blocked in a call that never returns stops
    beating, and the supervisor kills and restarts the process.

    `start_watchdog` adds the in-process half: a daemon thread that logs every thread's stack
    and exits the process when no beat came for `stall_s`, for services run without a supervisor.
    """

    def __init__(self, path: Path | None, *, min_interval_s: float = 0.5):
        self.path = path
        self.min_interval_s = min_interval_s
        self.last = time.monotonic()
        self._touched = 0.0

    @classmethod
    def from_env(cls) -> "Heartbeat":
        """The heartbeat the supervisor asked for (`CLORA_HEARTBEAT_FILE`); without it, beats
        are only seen by the watchdog."""
        path = os.environ.get(HEARTBEAT_ENV)
        return cls(Path(path) if path else None)

    def beat(self) -> None:
        self.last = now = time.monotonic()
        if self.path is not None and now - self._touched >= self.min_interval_s:
            self.path.touch()
            self._touched = now

    def start_watchdog(self, stall_s: float, on_stall: Callable[[float], None] | None = None,
                       stop: threading.Event | None = None) -> threading.Thread:
        """Watch the beats from a daemon thread: when none came for `stall_s`, log the stacks and
        call `on_stall(seconds_since_last_beat)`, by default exiting with `WATCHDOG_EXIT_CODE`.
        Setting `stop` ends the watch (a service watches until it exits)."""
        import faulthandler
        import logging

        def exit_now(silent_s: float) -> None:
            os._exit(WATCHDOG_EXIT_CODE)

        stopped = stop or threading.Event()

        def watch() -> None:
            while not stopped.is_set():
                silent = time.monotonic() - self.last
                if silent > stall_s:
                    logging.getLogger(__name__).error(
                        "main loop made no progress for %.0f s (watchdog limit %.0f s): a call is blocked; "
                        "the stacks follow, then the process exits for its supervisor to restart it", silent, stall_s)
                    faulthandler.dump_traceback(all_threads=True)
                    (on_stall or exit_now)(silent)
                    return
                stopped.wait(min(1.0, stall_s / 4))

        thread = threading.Thread(target=watch, name="watchdog", daemon=True)
        thread.start()
        return thread


def heartbeat_mtime(path: Path) -> float | None:
    """When `path` was last beaten (its modification time), None before the first beat."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


class ServerThread:
    """uvicorn serving an app on a free port (or `port`) in a daemon thread; `start()`/`stop()`,
    or `with`. For tests and in-process benchmarks.

    `lifespan="off"` for the test fakes (they have no startup work); the real apps run theirs
    (`lifespan="auto"`, uvicorn's default)."""

    def __init__(self, app, lifespan: str = "off", port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout_s: float = 20.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not port_open("127.0.0.1", self.port, timeout=0.2):
            if time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn on port {self.port} did not start within {timeout_s:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


GC_THRESHOLDS = (50_000, 20, 100)
"""The cyclic collector's thresholds in a service that called `tune_gc` (Python's default is
(700, 10, 10))."""


def tune_gc() -> None:
    """Make the cyclic garbage collector cheap for a long-running service, once its imports and
    connections are made: those objects go to the permanent generation (`gc.freeze`), so no
    collection traverses them again, and a young collection waits for 50,000 net allocations
    instead of 700. A batch of a few thousand parsed events otherwise survives young
    collections over and over, each of which walks every object still alive: profiled on the
    ingest worker's join-and-store path, the collector took ~40% of its CPU. Reference counting
    still frees everything acyclic at once; cycles wait a little longer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
