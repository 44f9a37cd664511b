"""A clora cluster on one machine: every service as its own OS process, with its own environment,
working directory and data folder, sharing only the broker, Redis and an S3-compatible object
store, as a deployment across machines runs them (docs/deploy.md). The cluster test
(tests/e2e/test_cluster.py) and `clora bench scale` (`clora.infra.scale_bench`) stand it up:

    cluster = Cluster(ClusterConfig(model=Path("/tmp/tiny"), root=Path("/tmp/cluster")))
    cluster.start()                         # stack, store, replicas, then every service; waits for each
    cluster.gateways[0].url                 # http://127.0.0.1:<port>
    cluster.learners[1].kill()              # kill -9 (its process group); never restarted
    cluster.add_gateway(replicas=[0])       # more processes later, attached to some replicas
    cluster.stop()

What runs (folder `root/<name>/`, log `root/<name>/<name>.log`):

    broker, redis   `LocalStack`: the embedded Tansu and redis-server on fresh ports, under `root/stack`
    s3              `python -m moto.server` with one bucket (or the endpoint `ClusterConfig.s3_endpoint`)
    vllm-<i>        `python -m vllm.entrypoints.openai.api_server`, as serving's `LocalReplica` builds it
                    (the CPU LoRA hook, runtime adapter loading, an API key), bound to its share of the cores
    webhook-<i>     `clora webhook`
    ingest-<i>      `clora ingest-worker`: one consumer group
    learner-<i>     `clora learner`, `CLORA_LEARNER_INSTANCE_ID=learner-<i>`, a short lease TTL, versions and
                    checkpoints in the store
    gateway-<i>     `clora serve` with `CLORA_ENGINE_REMOTE_URLS` = its replicas and `CLORA_ENGINE_PORTS=[]`

No process inherits a `CLORA_*` variable of this one: each gets the settings below and nothing else.

**The adapter cache.** Each gateway fetches versions into its own folder (`CLORA_STORAGE_CACHE_DIR`
under its data folder) and gives vLLM that path. A deployment mounts one volume at the same path
on gateways and replicas so that a replica can read it; on one machine every replica sees every
gateway's folder, which stands in for that volume. Two gateways loading one version into one
replica, each from its own folder, is what a deployment sees with several gateways: the replica
answers "already loaded" to the second, whose canary then checks what the replica holds.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from clora.procs import free_port, http_ok, terminate_with_parent

log = logging.getLogger(__name__)

Kind = Literal["s3", "vllm", "webhook", "ingest", "learner", "gateway"]

ENGINE_LIMITS = {"max_model_len": 512, "max_lora_rank": 8, "max_loras": 4, "max_cpu_loras": 8, "max_num_seqs": 32}
"""What vLLM is started with and what the gateways plan with (`EngineSettings`): one source for both."""
S3_CREDENTIALS = {"access_key_id": "test", "secret_access_key": "test", "region": "us-east-1"}
"""moto accepts any; the services pass these as a deployment passes its own."""


class ClusterStartError(RuntimeError):
    """A process of the cluster exited or did not become ready in time."""


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster's shape and the settings its processes share (also written by the bench)."""

    model: Path
    """A local Hugging Face model folder: what the learners train and vLLM serves."""
    root: Path
    """Every process's folder is `root/<name>`."""
    webhooks: int = 2
    ingest_workers: int = 2
    learners: int = 2
    gateways: int = 2
    replicas: int = 2
    partitions: int = 4
    """Partitions of each topic (events are keyed by tenant): at least the ingest workers."""
    lease_ttl_s: float = 6.0
    """`CLORA_LEARNER_LEASE_TTL_S`: a killed learner's tenants move within this + one tick."""
    learner_idle_sleep_s: float = 0.2
    """`CLORA_LEARNER_IDLE_SLEEP_S`: an idle learner's tick."""
    rank: int = 4
    s3_endpoint: str | None = None
    """An S3-compatible server already running (the test suite's moto); None: start one."""
    gateway_env: dict[str, str] = field(default_factory=dict)
    """More `CLORA_GATEWAY_*` settings for every gateway (quotas, say)."""
    learner_env: dict[str, str] = field(default_factory=dict)
    """More `CLORA_LEARNER_*` settings for every learner."""
    start_timeout_s: float = 420.0
    """Longest wait for one batch of processes (vLLM on a busy CPU takes minutes)."""

    def __post_init__(self) -> None:
        if min(self.webhooks, self.ingest_workers, self.learners, self.gateways) < 0 or self.replicas < 1:
            raise ValueError("a cluster needs at least one vLLM replica and no negative counts")
        if self.learners and self.lease_ttl_s < 3 * self.learner_idle_sleep_s:
            raise ValueError(f"lease_ttl_s ({self.lease_ttl_s}) must be at least 3 x learner_idle_sleep_s")


@dataclass
class ClusterProcess:
    """One process of the cluster: started once, never restarted. `kill()` is kill -9 of its
    process group (vLLM's EngineCore with its API server)."""

    name: str
    kind: Kind
    argv: list[str]
    env: dict[str, str]
    folder: Path
    ready: Callable[[], bool]
    """True once it serves (its health URL answers 200, or its main loop beat once)."""
    url: str | None = None
    """Its HTTP base URL (webhook, gateway, vLLM, s3)."""
    proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.name}.log"

    @property
    def heartbeat_path(self) -> Path:
        return self.folder / "heartbeat"

    def spawn(self) -> "ClusterProcess":
        """Start it (from the main thread: a child is told to exit when the thread that started
        it ends, `terminate_with_parent`). Does not wait for it to be ready."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.folder, stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=terminate_with_parent())
        log.info("started %s (pid %d), log %s", self.name, self.proc.pid, self.log_path)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal its whole process group (kill -9 by default) and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a learner checkpoints, a gateway drains), then SIGKILL after `timeout_s`."""
        if not self.alive():
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, timeout_s)
        self.kill(signal.SIGKILL)   # also whatever it left in its group

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def partition_of(key: str, partitions: int) -> int:
    """The partition clora's producers send `key` (a tenant id) to: kafka-python's default
    partitioner, murmur2 of the key over the sorted partitions (`EventProducer._partition_for`)."""
    from kafka.partitioner.default import murmur2

    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def tenants_over_partitions(prefix: str, partitions: int) -> list[str]:
    """One tenant id per partition, `<prefix>-<n>`, in partition order: their events spread over
    every ingest worker of the group. Example: `tenants_over_partitions("ing", 2)` ->
    `["ing-1", "ing-0"]` when ing-1 lands on partition 0 and ing-0 on partition 1."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < partitions:
        found.setdefault(partition_of(f"{prefix}-{n}", partitions), f"{prefix}-{n}")
        n += 1
    return [found[p] for p in range(partitions)]


class Cluster:
    def __init__(self, config: ClusterConfig):
        self.c = config
        self.root = config.root.resolve()
        self.stack = None
        self.processes: list[ClusterProcess] = []
        self.bucket = f"clora-{uuid.uuid4().hex[:10]}"
        self.s3_endpoint = config.s3_endpoint
        self.vllm_api_key = secrets.token_urlsafe(24)
        """What every replica requires on `/v1/*` (`VLLM_API_KEY`) and every gateway sends."""

    # --- what runs --------------------------------------------------------------------------

    def of(self, kind: Kind) -> list[ClusterProcess]:
        return [p for p in self.processes if p.kind == kind]

    @property
    def replicas(self) -> list[ClusterProcess]:
        return self.of("vllm")

    @property
    def webhooks(self) -> list[ClusterProcess]:
        return self.of("webhook")

    @property
    def ingest_workers(self) -> list[ClusterProcess]:
        return self.of("ingest")

    @property
    def learners(self) -> list[ClusterProcess]:
        return self.of("learner")

    @property
    def gateways(self) -> list[ClusterProcess]:
        return self.of("gateway")

    @property
    def redis_url(self) -> str:
        return self.stack.redis_url

    @property
    def kafka_bootstrap(self) -> str:
        return self.stack.kafka_bootstrap

    def storage_settings(self, cache_dir: Path | None = None):
        """The store's `StorageSettings`, as every learner and gateway reads them."""
        from clora.storage import StorageSettings

        return StorageSettings(backend="s3", s3_endpoint_url=self.s3_endpoint, s3_bucket=self.bucket,
                               s3_region=S3_CREDENTIALS["region"], s3_access_key_id=S3_CREDENTIALS["access_key_id"],
                               s3_secret_access_key=S3_CREDENTIALS["secret_access_key"],
                               cache_dir=cache_dir or self.root / "reader-cache", s3_max_attempts=3, s3_timeout_s=20)

    def registry(self):
        import redis

        from clora.registry import Registry

        return Registry(redis.Redis.from_url(self.redis_url))

    # --- start and stop ---------------------------------------------------------------------

    def start(self) -> "Cluster":
        """Broker, Redis and the store first; then the replicas together with every service
        but the gateways (vLLM takes longest); the gateways once a replica answers."""
        try:
            self._start_stack()
            self._start_store()
            c = self.c
            batch = [self._replica(i, c.replicas) for i in range(c.replicas)]
            batch += [self._webhook(i) for i in range(c.webhooks)]
            batch += [self._ingest(i) for i in range(c.ingest_workers)]
            batch += [self._learner(i) for i in range(c.learners)]
            self.launch(batch)
            self.launch([self._gateway(i, range(c.replicas)) for i in range(c.gateways)])
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self, processes: list[ClusterProcess]) -> list[ClusterProcess]:
        """Spawn `processes` and wait until every one is ready (`ClusterStartError` naming the
        first that exits or is late, with its log's tail)."""
        for p in processes:
            self.processes.append(p.spawn())
        deadline = time.monotonic() + self.c.start_timeout_s
        waiting = list(processes)
        while waiting:
            for p in list(waiting):
                if not p.alive():
                    raise ClusterStartError(f"{p.name} exited with code {p.proc.returncode} while starting; "
                                            f"{p.log_path}:\n{p.tail()}")
                if p.ready():
                    waiting.remove(p)
            if waiting and time.monotonic() > deadline:
                raise ClusterStartError(f"{', '.join(p.name for p in waiting)} not ready after "
                                        f"{self.c.start_timeout_s:.0f} s; {waiting[0].log_path}:\n{waiting[0].tail()}")
            time.sleep(0.2)
        return processes

    def add_gateway(self, replicas: list[int] | range | None = None) -> ClusterProcess:
        """One more gateway, attached to `replicas` (indexes; None: every replica), started and ready."""
        n = len(self.gateways)
        return self.launch([self._gateway(n, range(len(self.replicas)) if replicas is None else replicas)])[0]

    def add(self, kind: Literal["webhook", "ingest", "learner"]) -> ClusterProcess:
        """One more webhook, ingest worker or learner, started and ready."""
        make = {"webhook": self._webhook, "ingest": self._ingest, "learner": self._learner}[kind]
        return self.launch([make(len(self.of(kind)))])[0]

    def stop(self) -> None:
        """Every process, the gateways first and the replicas last; then the store and the stack."""
        order = ("gateway", "learner", "ingest", "webhook", "vllm", "s3")
        for kind in order:
            for p in self.of(kind):
                p.stop(45.0 if kind in ("gateway", "learner") else 15.0)
        if self.stack is not None:
            self.stack.stop()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_stack(self) -> None:
        from clora.infra.settings import BrokerSettings, RedisSettings
        from clora.infra.stack import LocalStack
        from clora.ingest.producer import ensure_topics
        from clora.settings import KafkaSettings, PlatformSettings

        self.stack = LocalStack(platform=PlatformSettings(data_dir=self.root / "stack", kafka_bootstrap=None,
                                                          redis_url=None),
                                broker=BrokerSettings(port=free_port(), partitions=self.c.partitions),
                                redis=RedisSettings(port=free_port())).start()
        ensure_topics(self.stack.kafka_bootstrap, self.c.partitions, kafka=KafkaSettings())

    def _start_store(self) -> None:
        import boto3

        if self.s3_endpoint is None:
            port = free_port()
            self.s3_endpoint = f"http://127.0.0.1:{port}"
            proc = ClusterProcess("s3", "s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  self._base_env(), self.root / "s3", url=self.s3_endpoint,
                                  ready=lambda: http_ok(f"{self.s3_endpoint}/moto-api/"))
            self.launch([proc])
        boto3.client("s3", endpoint_url=self.s3_endpoint, region_name=S3_CREDENTIALS["region"],
                     aws_access_key_id=S3_CREDENTIALS["access_key_id"],
                     aws_secret_access_key=S3_CREDENTIALS["secret_access_key"]).create_bucket(Bucket=self.bucket)

    # --- each kind's argv and environment -----------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        """This process's environment without any `CLORA_*` setting."""
        return {k: v for k, v in os.environ.items() if not k.startswith("CLORA_")} | {"PYTHONUNBUFFERED": "1"}

    def _service_env(self, folder: Path, **settings: str) -> dict[str, str]:
        env = self._base_env() | {"CLORA_DATA_DIR": str(folder)}
        if self.stack is not None:
            env |= {"CLORA_KAFKA_BOOTSTRAP": self.kafka_bootstrap, "CLORA_REDIS_URL": self.redis_url}
        return env | settings

    def _storage_env(self, cache_dir: Path) -> dict[str, str]:
        s = self.storage_settings(cache_dir)
        return {"CLORA_STORAGE_BACKEND": "s3", "CLORA_STORAGE_S3_BUCKET": s.s3_bucket,
                "CLORA_STORAGE_S3_ENDPOINT_URL": s.s3_endpoint_url, "CLORA_STORAGE_S3_REGION": s.s3_region,
                "CLORA_STORAGE_S3_ACCESS_KEY_ID": s.s3_access_key_id,
                "CLORA_STORAGE_S3_SECRET_ACCESS_KEY": s.s3_secret_access_key.get_secret_value(),
                "CLORA_STORAGE_S3_MAX_ATTEMPTS": str(s.s3_max_attempts),
                "CLORA_STORAGE_S3_TIMEOUT_S": str(s.s3_timeout_s),
                "CLORA_STORAGE_CACHE_DIR": str(cache_dir)}

    def _clora(self, name: str, kind: Kind, args: list[str], env: dict[str, str], *, url: str | None = None,
               health: str | None = None) -> ClusterProcess:
        """`clora <args>`; ready when `url + health` answers 200, or (no health URL) at its first heartbeat."""
        folder = self.root / name
        proc = ClusterProcess(name, kind, [sys.executable, "-m", "clora.infra.cli", *args, "--log-level", "INFO"],
                              env, folder, url=url, ready=lambda: False)
        if health is not None:
            proc.ready = lambda: http_ok(url + health)
        else:
            proc.env = {**env, "CLORA_HEARTBEAT_FILE": str(proc.heartbeat_path)}
            proc.ready = proc.heartbeat_path.exists
        return proc

    def _replica(self, i: int, of: int) -> ClusterProcess:
        """vLLM replica `i` of `of`, bound to its share of this machine's cores."""
        from clora.serving.replica import LocalReplica
        from clora.serving.settings import EngineSettings

        folder, port = self.root / f"vllm-{i}", free_port()
        settings = EngineSettings(model=str(self.c.model), ports=[port], log_dir=folder, **ENGINE_LIMITS)
        replica = LocalReplica(i, port, settings, api_key=self.vllm_api_key)
        own = {k: v for k, v in replica.env().items() if os.environ.get(k) != v}   # what a replica's env adds
        env = self._base_env() | own | {"VLLM_CPU_OMP_THREADS_BIND": core_share(i, of)}
        return ClusterProcess(f"vllm-{i}", "vllm", replica.argv(), env, folder, url=replica.url,
                              ready=lambda: http_ok(replica.url + "/health"))

    def _webhook(self, i: int) -> ClusterProcess:
        port = free_port()
        folder = self.root / f"webhook-{i}"
        return self._clora(f"webhook-{i}", "webhook", ["webhook"],
                           self._service_env(folder, CLORA_WEBHOOK_PORT=str(port)),
                           url=f"http://127.0.0.1:{port}", health="/healthz")

    def _ingest(self, i: int) -> ClusterProcess:
        folder = self.root / f"ingest-{i}"
        return self._clora(f"ingest-{i}", "ingest", ["ingest-worker", "--client-id", f"ingest-{i}"],
                           self._service_env(folder, CLORA_INGEST_METRICS_PORT="0"))

    def _learner(self, i: int) -> ClusterProcess:
        c, folder = self.c, self.root / f"learner-{i}"
        env = self._service_env(
            folder, **self._storage_env(folder / "adapter-cache"),
            CLORA_LEARNER_INSTANCE_ID=f"learner-{i}", CLORA_LEARNER_LEASE_TTL_S=str(c.lease_ttl_s),
            CLORA_LEARNER_IDLE_SLEEP_S=str(c.learner_idle_sleep_s), CLORA_LEARNER_BASE_MODEL=str(c.model),
            CLORA_LEARNER_MODELS_DIR=str(folder / "models"), CLORA_LEARNER_ADAPTERS_DIR=str(folder / "adapters"),
            CLORA_LEARNER_CHECKPOINTS_DIR=str(folder / "checkpoints"), CLORA_LEARNER_METRICS_PORT="0",
            CLORA_LEARNER_DEVICE="cpu", CLORA_LEARNER_NUM_THREADS="1", CLORA_LEARNER_RANK=str(c.rank),
            CLORA_LEARNER_ALPHA=str(2 * c.rank), CLORA_LEARNER_MAX_SEQ_LEN="128",
            CLORA_TRAINAPI_BASE_MODEL=str(c.model), CLORA_TRAINAPI_TOKENIZER_ID=str(c.model),
            CLORA_TRAINAPI_CHECKPOINTS_DIR=str(folder / "trainapi"), **c.learner_env)
        return self._clora(f"learner-{i}", "learner", ["learner"], env)

    def _gateway(self, i: int, replicas) -> ClusterProcess:
        port, folder = free_port(), self.root / f"gateway-{i}"
        urls = [self.replicas[r].url for r in replicas]
        env = self._service_env(
            folder, **self._storage_env(folder / "adapter-cache"),
            CLORA_ENGINE_MODEL=str(self.c.model), CLORA_ENGINE_REMOTE_URLS=json.dumps(urls), CLORA_ENGINE_PORTS="[]",
            CLORA_ENGINE_REMOTE_API_KEY=self.vllm_api_key, CLORA_ENGINE_LOG_DIR=str(folder),
            **{f"CLORA_ENGINE_{k.upper()}": str(v) for k, v in ENGINE_LIMITS.items()},
            CLORA_GATEWAY_PORT=str(port), CLORA_GATEWAY_METRICS_PORT="0", CLORA_GATEWAY_SPOOL_DIR=str(folder / "spool"),
            CLORA_GATEWAY_REGISTRY_POLL_S="0.2", CLORA_GATEWAY_TENANT_REFRESH_S="1", **self.c.gateway_env)
        return self._clora(f"gateway-{i}", "gateway", ["serve"], env, url=f"http://127.0.0.1:{port}", health="/health")


def core_share(i: int, of: int) -> str:
    """Replica `i` of `of`'s cores for `VLLM_CPU_OMP_THREADS_BIND`: this process's cores split
    evenly, round robin when there are fewer cores than replicas. Example: cores 0-1, 2 replicas
    -> "0" and "1"; 1 replica -> "0,1"."""
    cores = sorted(os.sched_getaffinity(0))
    if of >= len(cores):
        return str(cores[i % len(cores)])
    per = len(cores) // of
    return ",".join(str(c) for c in cores[i * per:(i + 1) * per])
