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
the learner and the engine (`core_split`).
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
        split = core_split(concurrent, len(os.sched_getaffinity(0)))
        for k in CORE_SPLIT:
            if k in self.user_env:
                os.environ[k] = self.user_env[k]
            elif k in split:
                os.environ[k] = split[k]
            else:
                os.environ.pop(k, None)

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
