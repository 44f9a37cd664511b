"""Process supervision for the embedded stack: start a child, wait for health, restart it
if it dies, stop it cleanly (SIGTERM, then SIGKILL), and keep its log in one known file.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clora.procs import terminate_with_parent

log = logging.getLogger(__name__)


class ServiceStartError(RuntimeError):
    """A supervised service did not become healthy in time."""


@dataclass
class ManagedProcess:
    """One child process of the platform.

    `healthy` is polled after start until it returns True or `start_timeout_s` passes.
    With `restart=True` a watcher thread restarts the process when it exits unexpectedly.
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
    proc: subprocess.Popen | None = field(default=None, init=False)
    restarts: int = field(default=0, init=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)
    _watcher: threading.Thread | None = field(default=None, init=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "ManagedProcess":
        self._stopping.clear()
        self._spawn()
        self.wait_healthy()
        if self.restart and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True)
            self._watcher.start()
        return self

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        env = {**os.environ, **(self.env or {})}
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
            if self.healthy():
                return
            time.sleep(0.1)
        raise ServiceStartError(
            f"{self.name} not healthy after {self.start_timeout_s:.0f} s; see {self.log_path}:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _watch(self) -> None:
        while not self._stopping.is_set():
            if self.proc is not None and self.proc.poll() is not None and not self._stopping.is_set():
                log.warning("%s exited with %s; restarting", self.name, self.proc.returncode)
                self.restarts += 1
                try:
                    self._spawn()
                    self.wait_healthy()
                except ServiceStartError:
                    log.exception("restart of %s failed", self.name)
                    time.sleep(1.0)
            self._stopping.wait(0.5)

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float | None = None) -> None:
        timeout = self.stop_timeout_s if timeout is None else timeout
        self._stopping.set()
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
        """SIGKILL without cleanup, as a crash would (fault tests use this)."""
        self._stopping.set()
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
