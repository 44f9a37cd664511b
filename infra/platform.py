"""The whole platform on one machine: what `clora up` starts, in order, and stops in reverse.

    broker + Redis (embedded unless configured) -> topics -> webhook -> console -> ingest workers
    -> base model (converted once) -> learner -> serving (vLLM engine + OpenAI gateway)

Services other than the broker and Redis run as supervised child processes of this one
(`python -m clora.infra.cli <service>`), restarted when they die, each logging to
`<data_dir>/logs/<service>.log`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from rich.console import Console

from clora.infra.control import load_admin_token
from clora.infra.settings import BrokerSettings, ConsoleSettings
from clora.ingest.settings import IngestSettings, WebhookSettings
from clora.settings import PlatformSettings
from clora.serving.settings import EngineSettings, GatewaySettings
from clora.infra.stack import LocalStack
from clora.infra.supervisor import ManagedProcess
from clora.procs import port_open
from clora.ingest.producer import ensure_topics


def service_process(name: str, args: list[str], env: dict[str, str], logs, healthy=lambda: True,
                    start_timeout_s: float = 60.0, stop_timeout_s: float = 10.0) -> ManagedProcess:
    return ManagedProcess(name=name, argv=[sys.executable, "-m", "clora.infra.cli", *args],
                          log_path=logs / f"{name}.log", healthy=healthy, env=env,
                          start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s, restart=True)


@dataclass
class Platform:
    settings: PlatformSettings = field(default_factory=PlatformSettings)
    stack: LocalStack | None = None
    services: dict[str, ManagedProcess] = field(default_factory=dict)

    def start(self) -> "Platform":
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        load_admin_token(self.settings.data_dir, self.settings.admin_token)   # create it once, before children
        self.stack = LocalStack(platform=self.settings).start()
        try:
            ensure_topics(self.stack.kafka_bootstrap, BrokerSettings().partitions)
            env = {"CLORA_KAFKA_BOOTSTRAP": self.stack.kafka_bootstrap, "CLORA_REDIS_URL": self.stack.redis_url,
                   "CLORA_DATA_DIR": str(self.settings.data_dir)}
            env.update(self._learner_dirs())
            logs = self.settings.logs_dir
            wanted = set(self.settings.services)
            if "webhook" in wanted:
                wh = WebhookSettings()
                self._add(service_process("webhook", ["webhook"], env, logs, lambda: port_open(wh.host, wh.port)))
            if "console" in wanted:
                con = ConsoleSettings()
                self._add(service_process("console", ["console"], env, logs, lambda: port_open(con.host, con.port)))
            if "ingest" in wanted:
                for i in range(IngestSettings().workers):
                    worker_env = env if i == 0 else {**env, "CLORA_INGEST_METRICS_PORT": "0"}
                    self._add(service_process(f"ingest-{i}", ["ingest-worker", "--client-id", f"clora-ingest-{i}"],
                                              worker_env, logs))
            if wanted & {"learner", "serving"}:
                model = self._prepare_model(env, logs)
                env.setdefault("CLORA_ENGINE_MODEL", str(model))
            if "learner" in wanted:
                self._add(service_process("learner", ["learner"], env, logs,
                                          stop_timeout_s=90.0))     # finishes its step, checkpoints every tenant
            if "serving" in wanted:
                gw = GatewaySettings()
                env = {**env, "CLORA_ENGINE_LOG_DIR": str(logs),
                       "CLORA_GATEWAY_SPOOL_DIR": str(self.settings.data_dir.resolve() / "spool" / "serving")}
                self._add(service_process("serving", ["serve"], env, logs, lambda: port_open(gw.host, gw.port),
                                          start_timeout_s=EngineSettings().start_timeout_s,
                                          stop_timeout_s=45.0))     # gateway drain, then each vLLM replica
        except Exception:
            self.stop()
            raise
        return self

    def _prepare_model(self, env: dict[str, str], logs) -> str:
        """Convert the base model once, before learner and serving both need it (in a child
        process: this supervisor never imports torch). Returns the model directory."""
        import subprocess

        if "CLORA_ENGINE_MODEL" in os.environ:
            return os.environ["CLORA_ENGINE_MODEL"]
        print("preparing the base model (the first run converts SmolLM2-135M-Instruct, ~1 min) ...", flush=True)
        with open(logs / "prepare-model.log", "ab") as log:
            out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "prepare-model", "--path-only"],
                                 env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=log, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"preparing the base model failed; see {logs / 'prepare-model.log'}")
        return out.stdout.strip().splitlines()[-1]

    def _learner_dirs(self) -> dict[str, str]:
        """Learner folders under the platform's data dir, unless set explicitly."""
        data = self.settings.data_dir.resolve()
        dirs = {"CLORA_LEARNER_MODELS_DIR": data / "models", "CLORA_LEARNER_ADAPTERS_DIR": data / "adapters",
                "CLORA_LEARNER_CHECKPOINTS_DIR": data / "learner" / "checkpoints"}
        return {k: str(v) for k, v in dirs.items() if k not in os.environ}

    def _add(self, proc: ManagedProcess) -> None:
        self.services[proc.name] = proc.start()

    def stop(self) -> None:
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
        wh, con, gw = WebhookSettings(), ConsoleSettings(), GatewaySettings()
        return {"webhook": f"http://{wh.host}:{wh.port}", "console": f"http://{con.host}:{con.port}",
                "gateway": f"http://{gw.host}:{gw.port}"}

    def admin_token(self) -> str:
        return load_admin_token(self.settings.data_dir, self.settings.admin_token)

    def print_summary(self, console: Console) -> None:
        wh, ing = WebhookSettings(), IngestSettings()
        console.print("[bold]clora is up[/]")
        console.print(f"  Kafka bootstrap   {self.stack.kafka_bootstrap}")
        console.print(f"  Redis             {self.stack.redis_url}")
        console.print(f"  feedback webhook  http://{wh.host}:{wh.port}/v1/feedback  (OpenAPI: /docs)")
        if ing.metrics_port:
            console.print(f"  ingest metrics    http://127.0.0.1:{ing.metrics_port}/metrics")
        if "serving" in self.services:
            gw = GatewaySettings()
            console.print(f"  OpenAI API        http://{gw.host}:{gw.port}/v1   (model: your tenant id; key: its API key)")
            if gw.metrics_port:
                console.print(f"  serving metrics   http://127.0.0.1:{gw.metrics_port}/metrics")
        con = ConsoleSettings()
        token_file = self.settings.data_dir.resolve() / "admin_token"
        console.print(f"  admin console     http://{con.host}:{con.port}/console/")
        if self.settings.admin_token:
            console.print("  admin token       from CLORA_ADMIN_TOKEN")
        else:
            console.print(f"  admin token       in {token_file}")
        console.print(f"  logs              {self.settings.logs_dir.resolve()}/")
        console.print("  create a tenant:  clora tenant create acme     (Ctrl-C stops everything)")
