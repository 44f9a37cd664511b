"""Process supervision for the embedded stack: start a child, wait for health, restart it
if it dies *or stops showing signs of life*, stop it cleanly (SIGTERM, then SIGKILL), and keep
its log in one known file.

A child's liveness signal is either its heartbeat file (`heartbeat=True`: the child beats
`clora.procs.Heartbeat` once per pass of its main loop) or a `liveness` check such as its HTTP
health. One that shows no sign of life for `unresponsive_after_s` is hung: it is SIGKILLed and
restarted, at ERROR level. Each exit, hang and restart is also a `SupervisorEvent` handed to
`on_event` (the platform records them where the console reads them).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from clora.procs import HEARTBEAT_ENV, heartbeat_mtime, terminate_with_parent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisorEvent:
    """Something the supervisor did about one child, e.g.
    `SupervisorEvent(time=1767225600.0, service="ingest-0", kind="unresponsive",
    detail="no heartbeat for 31 s; killed (pid 4242)")`."""

    time: float
    service: str
    kind: Literal["exited", "unresponsive", "restarted", "restart_failed", "data_lost", "stalled"]
    detail: str


class ServiceStartError(RuntimeError):
    """A supervised service did not become healthy in time."""


@dataclass
class ManagedProcess:
    """One child process of the platform.

    `healthy` is polled after start until it returns True or `start_timeout_s` passes.
    With `restart=True` a watcher thread restarts the process when it exits unexpectedly, and,
    when it has a liveness signal (`heartbeat` or `liveness`), when that signal stops for
    `unresponsive_after_s` (it is SIGKILLed first). `on_restart` runs after each restart
    became healthy (the broker's re-creates its topics).
    """

    name: str
    argv: Sequence[str]
    log_path: Path
    healthy: Callable[[], bool]
    start_timeout_s: float = 30.0
    env: dict[str, str] | None = None
    cwd: Path | None = None
    restart: bool = False
    stop_timeout_s: float = 10.0
    """How long `stop` waits after SIGTERM before SIGKILL (a service stopping children needs more)."""
    heartbeat: bool = False
    """Give the child a heartbeat file (`CLORA_HEARTBEAT_FILE`, next to its log); a beat is a sign of life."""
    liveness: Callable[[], bool] | None = None
    """A check that is True while the child answers (its HTTP health, a ping); True is a sign of life."""
    unresponsive_after_s: float = 30.0
    """A child with a liveness signal that shows no sign of life for this long is killed and restarted."""
    liveness_interval_s: float = 2.0
    """How often the signal is checked."""
    on_restart: Callable[["ManagedProcess"], None] | None = None
    on_event: Callable[[SupervisorEvent], None] | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)
    restarts: int = field(default=0, init=False)
    events: list[SupervisorEvent] = field(default_factory=list, init=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)
    _watcher: threading.Thread | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _last_sign: float = field(default=0.0, init=False)
    _last_beat: float | None = field(default=None, init=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def heartbeat_path(self) -> Path:
        return self.log_path.with_name(f"{self.name}.heartbeat")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "ManagedProcess":
        self._stopping.clear()
        with self._lock:
            self._spawn()
            self.wait_healthy()
        if self.restart and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True)
            self._watcher.start()
        return self

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        if self.heartbeat:
            self.heartbeat_path.unlink(missing_ok=True)
            env[HEARTBEAT_ENV] = str(self.heartbeat_path.resolve())
        logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            list(self.argv), stdout=logf, stderr=subprocess.STDOUT, env=env,
            cwd=self.cwd, start_new_session=True, preexec_fn=terminate_with_parent(),
        )
        logf.close()
        log.info("started %s (pid %s), log %s", self.name, self.proc.pid, self.log_path)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceStartError(
                    f"{self.name} exited with code {self.proc.returncode} during start; "
                    f"see {self.log_path}:\n{self.tail()}")
            if self._stopping.is_set() and self._watcher is not None:
                raise ServiceStartError(f"{self.name}: stopped while starting")
            if self.healthy():
                self._last_sign, self._last_beat = time.monotonic(), None
                return
            time.sleep(0.1)
        raise ServiceStartError(
            f"{self.name} not healthy after {self.start_timeout_s:.0f} s; see {self.log_path}:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- watching -----------------------------------------------------------------------------

    def _sign_of_life(self) -> bool:
        """A new heartbeat since the last check, or the liveness check answering."""
        if self.heartbeat:
            beat = heartbeat_mtime(self.heartbeat_path)
            if beat is not None and beat != self._last_beat:
                self._last_beat = beat
                return True
        if self.liveness is not None:
            try:
                return bool(self.liveness())
            except Exception as e:  # noqa: BLE001 - a failing check is a missing sign, logged
                log.debug("liveness check of %s failed: %s", self.name, e)
        return False

    def silent_for(self) -> float:
        """Seconds since the child last showed a sign of life (0 without a liveness signal)."""
        if not (self.heartbeat or self.liveness):
            return 0.0
        if self._sign_of_life():
            self._last_sign = time.monotonic()
        return time.monotonic() - self._last_sign

    def _watch(self) -> None:
        next_check = time.monotonic()
        while not self._stopping.wait(0.2):
            with self._lock:
                if self._stopping.is_set():
                    return
                if self.proc is not None and self.proc.poll() is not None:
                    self._restart("exited", f"exited with code {self.proc.returncode}")
                    next_check = time.monotonic() + self.liveness_interval_s
                elif time.monotonic() >= next_check:
                    silent = self.silent_for()
                    if silent > self.unresponsive_after_s:
                        self._kill_hung(silent)
                        self._restart("unresponsive", f"no sign of life for {silent:.0f} s "
                                      f"(limit {self.unresponsive_after_s:.0f} s); killed")
                    next_check = time.monotonic() + self.liveness_interval_s

    def restart_now(self, reason: str) -> None:
        """Kill the child and start it again, for a reason seen from outside (an ingest group
        whose offsets stopped moving while it beats)."""
        with self._lock:
            if self._stopping.is_set() or not self.alive():
                return
            log.error("%s (pid %s): %s; killing it", self.name, self.pid, reason)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self._restart("unresponsive", f"{reason}; killed")

    def _kill_hung(self, silent: float) -> None:
        log.error("%s (pid %s) showed no sign of life for %.0f s: it is hung; killing it", self.name, self.pid, silent)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def _restart(self, kind: str, detail: str) -> None:
        """Called with the lock held, the old process gone: spawn a new one and wait for it."""
        log.error("%s %s; restarting it (restart #%d), see %s", self.name, detail, self.restarts + 1, self.log_path)
        self.emit(kind, detail)
        self.restarts += 1
        try:
            self._spawn()
            self.wait_healthy()
        except ServiceStartError as e:
            if self._stopping.is_set():
                return
            log.exception("restart of %s failed", self.name)
            self.emit("restart_failed", str(e).splitlines()[0])
            self._stopping.wait(1.0)
            return
        self.emit("restarted", f"pid {self.pid}")
        if self.on_restart is not None:
            try:
                self.on_restart(self)
            except Exception:  # noqa: BLE001 - logged; the next check of the service decides
                log.exception("after restarting %s, its restart hook failed", self.name)

    def emit(self, kind: str, detail: str) -> None:
        """Record `kind` (an event of this child) in `events` and hand it to `on_event`."""
        event = SupervisorEvent(time=time.time(), service=self.name, kind=kind, detail=detail)
        self.events.append(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - recording is best effort; the log line stands
                log.exception("recording %s's event %s failed", self.name, kind)

    # --- stopping -----------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float | None = None) -> None:
        timeout = self.stop_timeout_s if timeout is None else timeout
        self._stopping.set()
        with self._lock:            # a restart in progress gives up (wait_healthy sees the stop)
            pass
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.0f s; killing", self.name, timeout)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL without cleanup and without a restart (fault tests use this; to simulate a
        crash the supervisor recovers from, `signal(SIGKILL)`)."""
        self._stopping.set()
        with self._lock:
            pass
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
