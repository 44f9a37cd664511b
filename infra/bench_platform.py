"""Fresh platforms for the benchmarks that drive the whole platform (`clora bench experiments`,
`clora bench freshness`): `PlatformLauncher` and `Stack`, where a started one answers.

    launcher = PlatformLauncher(model="smollm2", models_dir=".clora/models", slots=3,
                                training_mode="serial", root=Path("/tmp/bench"))
    launcher.prepare_model()                                # once: converts smollm2 (not timed)
    platform, stack = launcher.start("run-0", concurrent=True)
    ...                                                      # clients talk to stack.gateway etc.
    platform.stop()

Each platform gets fresh ports and its own data folder under `root` (its broker, Redis, logs
and adapters), the benchmark's learner settings (new corrections first, a short idle sleep)
and an engine that holds `slots` adapters at once. `concurrent=True` splits the cores between
the learner and the engine (`core_split`). `CpuMeter` reads how many core-seconds the engine,
the learner and everything else used between two points (`CoreSeconds`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil


class PlatformStartError(RuntimeError):
    """A benchmark's platform did not come up (its base model, or its gateway)."""


@dataclass
class Stack:
    """Where a running platform answers, for benchmark clients."""

    gateway: str
    webhook: str
    console: str
    learner_metrics: str
    admin_token: str
    redis_url: str | None = None
    """The platform's Redis (its registry), for benchmarks that read it directly."""


CORE_SPLIT = ("CLORA_LEARNER_NUM_THREADS", "CLORA_ENGINE_RESERVED_CPUS")


def cores_available() -> int:
    """The cores this process may run on (its affinity), what the platform's processes share."""
    return len(os.sched_getaffinity(0))


def core_split(concurrent: bool, cores: int) -> dict[str, str]:
    """The CPU settings of a platform (what the environment sets wins).

    With training and serving busy at once (`concurrent`), the learner and the engine get their
    own cores, half each, as the demo does: two OpenMP teams on the same cores spin against each
    other, which makes a learner step several times slower than on a core of its own
    (`benchmarks/bench_learner.py --threads 1|2` beside a busy thread shows it). Otherwise the
    defaults: rollouts and training take turns, each on every core.
    """
    if not concurrent or cores < 2:
        return {}
    return {"CLORA_LEARNER_NUM_THREADS": str(cores // 2), "CLORA_ENGINE_RESERVED_CPUS": str(cores // 2)}


@dataclass
class PlatformLauncher:
    model: str
    """`smollm2` (converted once into `models_dir`) or a local HF model directory."""
    models_dir: str
    slots: int
    """Adapters the engine batches at once (`CLORA_ENGINE_MAX_LORAS`; twice as many resident) and
    tenants a fused learner trains together: the most tenants the benchmark runs at once."""
    training_mode: str
    root: Path
    """Every platform's data folder is `root / name`."""
    model_env: dict[str, str] = field(default_factory=dict)
    """The base model's settings, once `prepare_model` ran."""
    user_env: dict[str, str] = field(default_factory=lambda: {k: os.environ[k] for k in CORE_SPLIT if k in os.environ})
    """The CPU split the environment set before the benchmark started (it wins over `core_split`)."""

    @contextlib.contextmanager
    def data_kept_on_failure(self, keep: bool, console) -> Iterator[None]:
        """Run the benchmark's platforms: `root` is deleted when the body succeeds (unless
        `keep`), and kept, saying where, when it fails."""
        try:
            yield
        except BaseException:
            console.print(f"[red]failed[/]: platform logs kept under {self.root}")
            raise
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def prepare_model(self) -> dict[str, str]:
        """The base model for every platform: a local HF dir as is, `smollm2` converted once
        into the shared models dir (timed by no benchmark)."""
        if self.model != "smollm2":
            path = str(Path(self.model).resolve())
            self.model_env = {"CLORA_ENGINE_MODEL": path, "CLORA_LEARNER_BASE_MODEL": path}
            return self.model_env
        models = str(Path(self.models_dir).resolve())
        env = {**os.environ, "CLORA_LEARNER_MODELS_DIR": models, "CLORA_LEARNER_BASE_MODEL": "smollm2"}
        out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "prepare-model", "--path-only"], env=env,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise PlatformStartError(f"preparing the base model failed: {out.stderr[-2000:]}")
        self.model_env = {"CLORA_ENGINE_MODEL": out.stdout.strip().splitlines()[-1],
                          "CLORA_LEARNER_BASE_MODEL": "smollm2", "CLORA_LEARNER_MODELS_DIR": models}
        return self.model_env

    def platform_env(self, name: str, concurrent: bool = False) -> None:
        """Point every CLORA_* setting of the next platform at fresh ports and a fresh data dir,
        with the CPU split (`core_split`). Settings read the environment when built, so this runs
        before `Platform(...)`."""
        from clora.procs import free_port

        for k in ("CLORA_KAFKA_BOOTSTRAP", "CLORA_REDIS_URL"):   # always the platform's own broker and Redis
            os.environ.pop(k, None)
        ports = ("BROKER_PORT", "REDIS_PORT", "WEBHOOK_PORT", "INGEST_METRICS_PORT", "CONSOLE_PORT", "GATEWAY_PORT",
                 "LEARNER_METRICS_PORT", "GATEWAY_METRICS_PORT", "TRAINAPI_PORT")
        os.environ.update({f"CLORA_{k}": str(free_port()) for k in ports})
        os.environ.update(self.model_env)
        os.environ.update(
            CLORA_DATA_DIR=str(self.root / name), CLORA_ENGINE_PORTS=json.dumps([free_port()]),
            CLORA_LEARNER_TRAINING_MODE=self.training_mode, CLORA_LEARNER_FUSED_MAX_TENANTS=str(self.slots),
            CLORA_LEARNER_FRESH_FRACTION="1.0", CLORA_LEARNER_IDLE_SLEEP_S="0.2",
            CLORA_ENGINE_MAX_LORAS=str(self.slots), CLORA_ENGINE_MAX_CPU_LORAS=str(2 * self.slots))
        split = self.split(concurrent)
        for k in CORE_SPLIT:
            if k in split:
                os.environ[k] = split[k]
            else:
                os.environ.pop(k, None)

    def split(self, concurrent: bool) -> dict[str, str]:
        """The CPU settings a platform gets: `core_split`'s, overridden by the environment's."""
        return core_split(concurrent, cores_available()) | self.user_env

    def start(self, name: str, concurrent: bool = False):
        """Start a fresh platform; returns (platform, Stack) once the gateway answers /health."""
        from clora.infra.platform import Platform
        from clora.procs import http_ok
        from clora.settings import PlatformSettings

        self.platform_env(name, concurrent)
        platform = Platform(PlatformSettings()).start()
        urls = platform.urls()
        deadline = time.monotonic() + 600
        while not http_ok(urls["gateway"] + "/health"):
            if time.monotonic() > deadline:
                platform.stop()
                raise PlatformStartError(f"gateway {urls['gateway']} never became healthy; logs in {self.root / name}")
            time.sleep(0.5)
        stack = Stack(urls["gateway"], urls["webhook"], urls["console"],
                      f"http://127.0.0.1:{os.environ['CLORA_LEARNER_METRICS_PORT']}/metrics", platform.admin_token(),
                      platform.stack.redis_url)
        return platform, stack


@dataclass(frozen=True)
class CoreSeconds:
    """CPU time (user + system, every thread) the platform's processes used over `wall_s`, by
    role: `engine` = the vLLM replicas (API server and engine core; the rollouts' work),
    `learner` = the learner process (the training work), `other` = every other process of the
    benchmark (gateway, webhook, ingest, console, broker, Redis and the benchmark's own client
    threads). Example: over a 60 s round of 8 tenants' steps, engine 52.0, learner 48.5, other
    9.1: on 2 cores the round needed at least (52.0 + 48.5) / 2 = 50.2 s."""

    engine: float
    learner: float
    other: float
    wall_s: float

    def __add__(self, o: "CoreSeconds") -> "CoreSeconds":
        return CoreSeconds(self.engine + o.engine, self.learner + o.learner, self.other + o.other,
                           self.wall_s + o.wall_s)

    def __sub__(self, o: "CoreSeconds") -> "CoreSeconds":
        return CoreSeconds(self.engine - o.engine, self.learner - o.learner, self.other - o.other,
                           self.wall_s - o.wall_s)


class CpuMeter:
    """Core-seconds of a running platform's processes by role, read from the kernel's per-process
    accounting (psutil `cpu_times`), so no process needs to report anything:

        meter = CpuMeter(platform)
        before = meter.read()
        ...                                    # rollouts and training
        used = meter.read() - before           # CoreSeconds

    Every read walks this process's descendants: the engine is every process below the `serving`
    service (its vLLM replicas; the service itself is the gateway), the learner is the `learner`
    service and its children. A process that exits between two reads loses the time it used
    since the first (none of the measured ones does unless it crashes); one started between them
    counts from zero."""

    def __init__(self, platform):
        self.platform = platform

    def _pid(self, service: str) -> int | None:
        proc = self.platform.services.get(service)
        return proc.pid if proc is not None else None

    def read(self) -> CoreSeconds:
        me = psutil.Process()
        engine_root, learner_root = self._pid("serving"), self._pid("learner")
        totals = {"engine": 0.0, "learner": 0.0, "other": 0.0}
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                role = self._role(proc, engine_root, learner_root)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue                          # exited while we walked: its time is gone either way
            totals[role] += times.user + times.system
        return CoreSeconds(**totals, wall_s=time.monotonic())

    @staticmethod
    def _role(proc: psutil.Process, engine_root: int | None, learner_root: int | None) -> str:
        if proc.pid == learner_root:
            return "learner"
        for parent in proc.parents():
            if parent.pid == engine_root:
                return "engine"
            if parent.pid == learner_root:
                return "learner"
        return "other"
