"""The whole platform on one machine: what `clora up` starts, in order, and stops in reverse.

    broker + Redis (embedded unless configured) -> topics -> webhook -> console -> ingest workers
    -> base model (converted once) -> learner -> Tinker training API -> serving (vLLM engine +
    OpenAI gateway)

Services other than the broker and Redis run as supervised child processes of this one
(`python -m clora.infra.cli <service>`), each logging to `<data_dir>/logs/<service>.log`.
Every process, the broker and Redis included, is restarted when it dies or stops showing signs
of life (`SupervisorSettings`):

    broker          answers a metadata request   (its restart loses its topics: logged, recorded)
    redis           answers PING
    webhook/console answer HTTP
    trainapi        answers GET /api/v1/healthz
    serving         the gateway answers HTTP (its own monitor restarts vLLM replicas)
    ingest-N        heartbeat file, one beat per consumer-loop pass
    learner         heartbeat file, one beat per tick

Each supervisor event goes to the log and to Redis (`reports.recent_service_events`), and the
ingest group's lag is measured from the broker and recorded for the console (`reports.LagProbe`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from rich.console import Console

from clora.infra.control import load_admin_token
from clora.infra.settings import BrokerSettings, ConsoleSettings, SupervisorSettings
from clora.ingest.settings import IngestSettings, WebhookSettings
from clora.settings import PlatformSettings, redacted_url
from clora.serving.settings import EngineSettings, GatewaySettings
from clora.trainapi.settings import TrainApiSettings
from clora.infra.stack import LocalStack
from clora.infra.supervisor import ManagedProcess, SupervisorEvent
from clora.procs import http_answers, http_ok, port_open
from clora.ingest.producer import ensure_topics
from clora.ingest.reports import LagProbe, ServiceEvent, record_lag, record_service_event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedModel:
    """The learner's base model, prepared (`clora prepare-model --json`). Example:
    `PreparedModel(path="/data/models/smollm2-135m-instruct", name="HuggingFaceTB/SmolLM2-135M-Instruct")`."""

    path: str
    """Its Hugging Face folder: what vLLM serves and the training API's clients load the tokenizer from."""
    name: str
    """The name the learner records versions under, and Tinker clients pass as `base_model`."""


def service_process(name: str, args: list[str], env: dict[str, str], logs, healthy=lambda: True,
                    start_timeout_s: float = 60.0, stop_timeout_s: float = 10.0, *,
                    liveness=None, heartbeat: bool = False, unresponsive_after_s: float | None = None,
                    supervision: SupervisorSettings | None = None) -> ManagedProcess:
    """A `clora <args>` child, restarted when it exits or its liveness signal (`liveness`, or
    its `heartbeat` file) stops for `unresponsive_after_s` (default: the supervision's)."""
    sup = supervision or SupervisorSettings()
    return ManagedProcess(name=name, argv=[sys.executable, "-m", "clora.infra.cli", *args],
                          log_path=logs / f"{name}.log", healthy=healthy, env=env,
                          start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s, restart=True,
                          liveness=liveness, heartbeat=heartbeat, liveness_interval_s=sup.liveness_interval_s,
                          unresponsive_after_s=unresponsive_after_s or sup.unresponsive_after_s)


@dataclass
class Platform:
    settings: PlatformSettings = field(default_factory=PlatformSettings)
    stack: LocalStack | None = None
    services: dict[str, ManagedProcess] = field(default_factory=dict)
    supervision: SupervisorSettings = field(default_factory=SupervisorSettings)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)
    _lag_thread: threading.Thread | None = field(default=None, init=False)
    _events_redis: object = field(default=None, init=False)
    _unrecorded: list[ServiceEvent] = field(default_factory=list, init=False)
    _events_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def start(self) -> "Platform":
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        load_admin_token(self.settings.data_dir, self.settings.admin_token)   # create it once, before children
        self._stopping.clear()
        self.stack = LocalStack(platform=self.settings, supervision=self.supervision,
                                on_event=self.record_event).start()
        try:
            ensure_topics(self.stack.kafka_bootstrap, BrokerSettings().partitions)
            env = {"CLORA_KAFKA_BOOTSTRAP": self.stack.kafka_bootstrap, "CLORA_REDIS_URL": self.stack.redis_url,
                   "CLORA_DATA_DIR": str(self.settings.data_dir)}
            env.update(self._learner_dirs())
            logs = self.settings.logs_dir
            wanted = set(self.settings.services)
            sup = self.supervision
            if "webhook" in wanted:
                wh = WebhookSettings()
                self._add(service_process("webhook", ["webhook"], env, logs, lambda: port_open(wh.host, wh.port),
                                          liveness=lambda: http_answers(f"http://{wh.host}:{wh.port}/healthz"),
                                          supervision=sup))
            if "console" in wanted:
                con = ConsoleSettings()
                self._add(service_process("console", ["console"], env, logs, lambda: port_open(con.host, con.port),
                                          liveness=lambda: http_answers(f"http://{con.host}:{con.port}/console/"),
                                          supervision=sup))
            if "ingest" in wanted:
                for i in range(IngestSettings().workers):
                    worker_env = env if i == 0 else {**env, "CLORA_INGEST_METRICS_PORT": "0"}
                    self._add(service_process(f"ingest-{i}", ["ingest-worker", "--client-id", f"clora-ingest-{i}"],
                                              worker_env, logs, heartbeat=True, supervision=sup))
                self._watch_lag()
            if wanted & {"learner", "trainapi"} or ("serving" in wanted and "CLORA_ENGINE_MODEL" not in os.environ):
                model = self._prepare_model(env, logs)
                if "CLORA_ENGINE_MODEL" not in os.environ:
                    env["CLORA_ENGINE_MODEL"] = model.path
                env.update(self._trainapi_env(model))   # the learner runs the training API's requests
            if "learner" in wanted:
                # one id across restarts: a restarted learner takes its own tenants' leases back at
                # once instead of waiting out their TTL (`clora.learner.leases`)
                learner_env = {"CLORA_LEARNER_INSTANCE_ID": f"{socket.gethostname()}-learner"} \
                    if "CLORA_LEARNER_INSTANCE_ID" not in os.environ else {}
                self._add(service_process("learner", ["learner"], {**env, **learner_env}, logs,
                                          stop_timeout_s=90.0,      # finishes its step, checkpoints every tenant
                                          heartbeat=True, unresponsive_after_s=sup.learner_unresponsive_after_s,
                                          supervision=sup))
            if "trainapi" in wanted:
                health = f"{self.urls()['trainapi']}/api/v1/healthz"
                self._add(service_process("trainapi", ["trainapi"], env, logs, lambda: http_ok(health),
                                          liveness=lambda: http_answers(health), supervision=sup))
            if "serving" in wanted:
                gw = GatewaySettings()
                env = {**env, "CLORA_ENGINE_LOG_DIR": str(logs),
                       "CLORA_GATEWAY_SPOOL_DIR": str(self.settings.data_dir.resolve() / "spool" / "serving")}
                self._add(service_process("serving", ["serve"], env, logs, lambda: port_open(gw.host, gw.port),
                                          start_timeout_s=EngineSettings().start_timeout_s,
                                          stop_timeout_s=45.0,      # gateway drain, then each vLLM replica
                                          liveness=lambda: http_answers(f"http://{gw.host}:{gw.port}/health"),
                                          supervision=sup))
        except Exception:
            self.stop()
            raise
        return self

    def _prepare_model(self, env: dict[str, str], logs) -> PreparedModel:
        """Convert the learner's base model once, before learner, serving and the training API
        need it (in a child process: this supervisor never imports torch)."""
        import json
        import subprocess

        print("preparing the base model (the first run converts SmolLM2-135M-Instruct, ~1 min) ...", flush=True)
        with open(logs / "prepare-model.log", "ab") as log:
            out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "prepare-model", "--json"],
                                 env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=log, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"preparing the base model failed; see {logs / 'prepare-model.log'}")
        prepared = json.loads(out.stdout.strip().splitlines()[-1])
        return PreparedModel(path=prepared["path"], name=prepared["name"])

    def _trainapi_env(self, model: PreparedModel) -> dict[str, str]:
        """What the training API and the learner (which runs its requests) must agree on: where
        checkpoints live, the base model's name clients pass and the folder the SDK loads its
        tokenizer from; and, for the training API, the gateway its sampling clients use. Each
        unless set explicitly."""
        data = self.settings.data_dir.resolve()
        env = {"CLORA_TRAINAPI_CHECKPOINTS_DIR": str(data / "trainapi" / "checkpoints"),
               "CLORA_TRAINAPI_BASE_MODEL": model.name, "CLORA_TRAINAPI_TOKENIZER_ID": model.path,
               "CLORA_TRAINAPI_GATEWAY_URL": self.urls()["gateway"],
               "CLORA_TRAINAPI_GATEWAY_BASE_MODEL": EngineSettings().base_name}
        return {k: v for k, v in env.items() if k not in os.environ}

    def _learner_dirs(self) -> dict[str, str]:
        """Learner folders under the platform's data dir, unless set explicitly."""
        data = self.settings.data_dir.resolve()
        dirs = {"CLORA_LEARNER_MODELS_DIR": data / "models", "CLORA_LEARNER_ADAPTERS_DIR": data / "adapters",
                "CLORA_LEARNER_CHECKPOINTS_DIR": data / "learner" / "checkpoints"}
        return {k: str(v) for k, v in dirs.items() if k not in os.environ}

    def _add(self, proc: ManagedProcess) -> None:
        proc.on_event = self.record_event
        self.services[proc.name] = proc.start()

    def record_event(self, event: SupervisorEvent) -> None:
        """Keep a supervisor event where the console reads it (Redis); the supervisor has logged it.
        Events that find Redis down (its own exit, say) are recorded with the next one that does not."""
        import redis

        with self._events_lock:
            if self._events_redis is None:
                self._events_redis = redis.Redis.from_url(self.stack.redis_url, socket_timeout=5,
                                                          socket_connect_timeout=2)
            self._unrecorded.append(ServiceEvent(event.time, event.service, event.kind, event.detail))
            try:
                while self._unrecorded:
                    record_service_event(self._events_redis, self._unrecorded[0])
                    self._unrecorded.pop(0)
            except redis.RedisError as e:
                log.warning("%d service events not recorded in Redis yet (%s); the latest: %s %s: %s",
                            len(self._unrecorded), e, event.service, event.kind, event.detail)

    # --- the ingest group's lag, measured from the broker --------------------------------------

    def _watch_lag(self) -> None:
        self._lag_thread = threading.Thread(target=self._lag_loop, name="ingest-lag", daemon=True)
        self._lag_thread.start()

    def _lag_loop(self) -> None:
        """Every `lag_interval_s`: the group's lag from the broker, into Redis for the console. Lag
        that stays above zero while no committed offset moves is a stall: logged, recorded, and
        every ingest worker restarted."""
        import redis
        from kafka.errors import KafkaError

        sup, group = self.supervision, IngestSettings().group_id
        client = redis.Redis.from_url(self.stack.redis_url, socket_timeout=5, socket_connect_timeout=2)
        probe: LagProbe | None = None
        moved_at, last = time.monotonic(), None
        while not self._stopping.wait(sup.lag_interval_s):
            try:
                probe = probe or LagProbe(self.stack.kafka_bootstrap, group)
                lags = probe.measure()
                record_lag(client, group, lags)
            except (KafkaError, OSError, ValueError) as e:
                log.warning("ingest lag not measured: %s", e)
                if probe is not None:
                    probe.close()
                probe = None
                continue
            except redis.RedisError as e:
                log.warning("ingest lag not recorded: %s", e)
                continue
            total = sum(lags.values())
            if total == 0 or probe.committed != last:
                moved_at = time.monotonic()
            elif time.monotonic() - moved_at > sup.ingest_stalled_after_s:
                # beating but not consuming (a group that never finishes its rebalance, say):
                # restart every worker, again after each further `ingest_stalled_after_s`
                detail = f"lag {total} and no committed offset moved for {sup.ingest_stalled_after_s:.0f} s"
                log.error("ingest stalled: %s; restarting the ingest workers", detail)
                self.record_event(SupervisorEvent(time.time(), "ingest", "stalled", detail))
                for name, proc in list(self.services.items()):
                    if name.startswith("ingest-"):
                        proc.restart_now(f"ingest stalled ({detail})")
                moved_at = time.monotonic()
            last = dict(probe.committed)
        if probe is not None:
            probe.close()
        client.close()

    def stop(self) -> None:
        self._stopping.set()
        if self._lag_thread is not None:
            self._lag_thread.join(15)
        for proc in reversed(list(self.services.values())):
            proc.stop()
        if self.stack is not None:
            self.stack.stop()

    def __enter__(self) -> "Platform":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def urls(self) -> dict[str, str]:
        """Where each HTTP service answers (for clients such as the demo)."""
        wh, con, gw, ta = WebhookSettings(), ConsoleSettings(), GatewaySettings(), TrainApiSettings()
        return {"webhook": f"http://{wh.host}:{wh.port}", "console": f"http://{con.host}:{con.port}",
                "gateway": f"http://{gw.host}:{gw.port}", "trainapi": f"http://{ta.host}:{ta.port}"}

    def admin_token(self) -> str:
        return load_admin_token(self.settings.data_dir, self.settings.admin_token)

    def print_summary(self, console: Console) -> None:
        wh, ing = WebhookSettings(), IngestSettings()
        console.print("[bold]clora is up[/]")
        console.print(f"  Kafka bootstrap   {self.stack.kafka_bootstrap}")
        console.print(f"  Redis             {redacted_url(self.stack.redis_url)}")
        console.print(f"  feedback webhook  http://{wh.host}:{wh.port}/v1/feedback  (OpenAPI: /docs)")
        if ing.metrics_port:
            console.print(f"  ingest metrics    http://{ing.metrics_host}:{ing.metrics_port}/metrics")
        if "serving" in self.services:
            gw = GatewaySettings()
            console.print(f"  OpenAI API        http://{gw.host}:{gw.port}/v1   (model: your tenant id; key: its API key)")
            if gw.metrics_port:
                console.print(f"  serving metrics   http://{gw.metrics_host}:{gw.metrics_port}/metrics")
        if "trainapi" in self.services:
            console.print(f"  Tinker API        {self.urls()['trainapi']}   (TINKER_BASE_URL; key: clora tinker-key "
                          "create --tenant <id>)")
        con = ConsoleSettings()
        token_file = self.settings.data_dir.resolve() / "admin_token"
        console.print(f"  admin console     http://{con.host}:{con.port}/console/")
        if self.settings.admin_token:
            console.print("  admin token       from CLORA_ADMIN_TOKEN")
        else:
            console.print(f"  admin token       in {token_file}")
        console.print(f"  logs              {self.settings.logs_dir.resolve()}/")
        console.print("  create a tenant:  clora tenant create acme     (Ctrl-C stops everything)")
