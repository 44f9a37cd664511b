"""`clora bench tinker`: what the Tinker-compatible API costs a training step, and how it shares the learner.

    python benchmarks/bench_tinker.py [--model tiny|smollm2|<HF dir>] [--steps 8] [--clients 1,2,4]
                                      [--batch 8] [--group-size 4] [--seq-len 128] [--threads 1]
    run(TinkerBenchConfig(...))                 # the same, from Python (`clora bench tinker`)

Everything runs in this process, as tests/trainapi/conftest.py stands it up: a redis-server of its
own (`clora.infra.stack.redis_process`; no broker), a real `Learner` looping in a thread with the
Tinker executor plugged in, and the training API (`clora.trainapi.service.build`) in a uvicorn
thread. Tenants `bench0..` each hold a Tinker key; the official `tinker` SDK drives them.

1. **One RL step, SDK vs native.** A fixed batch of B sampled completions (B / G prompts, G each,
   every sequence `seq_len` tokens) is trained K times two ways from the same LoRA init, steps
   interleaved so both see the same machine load: through the SDK, `forward_backward(data,
   "importance_sampling")` + `optim_step` (each datum's target tokens, behaviour logprobs and
   advantages, docs/tinker-protocol.md §7.3); natively, `Trainer.train_step(tenant, samples,
   TrainingPolicy(algorithm="rl"))` on the same tokens as `RLSample`s (its clip opened to
   `NATIVE_CLIP`: Tinker's importance sampling has none), on a second copy of the
   model in this thread. The SDK's advantages are the native group advantages divided by each
   sample's completion tokens and by B, so Tinker's token sum equals the native mean loss and
   both paths take the same step (the report gives the loss and weight gaps as a check). A third
   path, **direct**, calls the learner's Tinker backend (`InProcessBackend`) in this thread on the
   decoded datums: Tinker's loss path without HTTP, Redis or protobuf, so SDK - direct is the
   transport (with the contention of the client and API threads here) and direct - native the
   loss path. **Sampling is excluded from every path**: it is
   the same engine either way; the batch is sampled once, before any timing, from the base model.

   The SDK step is split along one clock (the learner is probed, `ProbedTinkerWork`):

       SDK step = to learner      client encode, HTTP, API auth/sequencing/enqueue, learner wake-up
                + fb request      the learner's forward_backward request
                + between         the learner's tick between the two requests
                + optim request   the learner's optim_step request
                + back            retrieve_future long-poll, HTTP, client decode
       a request = compute (the backend's forward/backward or AdamW) + checkpoint (optim_step's
                   crash-safe state, fsynced) + executor (queue reads/writes in Redis, protobuf)

2. **Concurrent SDK clients.** C clients (C in `clients`), each its own `ServiceClient` in its own
   thread on its own tenant's run, each K steps of the same batch: all at once against the same
   clients one after another. Wall time, steps/s, the speed-up, and how busy the one learner
   thread was (the share of the wall it spent running requests).

In-process caveat: client, API and learner share one interpreter (one GIL) here; in a deployment
they are three processes. Writes JSON (`out`) with every measurement, the machine and the config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from clora.freshness import percentile
from clora.ingest.schemas import Message, RLSample
from clora.learner.batches import ChatEncoder
from clora.learner.losses import sample_advantages
from clora.learner.trainer import Trainer, TrainingPolicy
from clora.procs import ServerThread
from clora.trainapi.backend import AdamParams, InProcessBackend
from clora.trainapi.executor import TinkerWork
from clora.trainapi.wire import TinkerDatum

SEED = 1234
"""The LoRA init of the SDK run and of the native tenant (the same init)."""
LEARNING_RATE = 1e-4
NATIVE_CLIP = 0.99
"""The native step's PPO clip range: as good as none (`importance_sampling` has none), so both paths
take the same step (at 0.2 a few steps' ratios leave the range and the paths part); the clip costs
the same either way."""


@dataclass(frozen=True)
class TinkerBenchConfig:
    """Every knob of one run (also written to the JSON)."""

    model: str = "tiny"
    """`tiny` (generated, ~90 K params: the API's overhead dominates), `smollm2`, or a local HF dir."""
    steps: int = 8
    """K: timed steps per path (part 1) and per client (part 2), after one warm-up step each."""
    clients: tuple[int, ...] = (1, 2, 4)
    batch: int = 8
    """B: sampled completions per step."""
    group_size: int = 4
    """G: completions per prompt (B / G prompts; advantages are normalised within a prompt's group)."""
    seq_len: int = 128
    """Tokens per sequence, prompt + completion."""
    micro_batch: int = 8
    """The learner's micro-batch size, both paths."""
    rank: int = 8
    threads: int = 1
    """torch CPU threads (one process: the learner thread and the native steps share them)."""
    models_dir: str = ".clora/models"
    out: str = "bench-results/tinker.json"

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.group_size < 1 or self.threads < 1 or self.micro_batch < 1:
            raise ValueError("--steps, --batch, --group-size, --micro-batch and --threads must be >= 1")
        if self.batch % self.group_size:
            raise ValueError(f"--batch ({self.batch}) must be a multiple of --group-size ({self.group_size})")
        if not self.clients or min(self.clients) < 1:
            raise ValueError(f"--clients must list client counts >= 1, got {self.clients}")
        if self.seq_len < 16:
            raise ValueError(f"--seq-len must be >= 16 (a prompt and a completion), got {self.seq_len}")


# --- the batch -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RLBatch:
    """The fixed batch both paths train on. Example, B 2 (one prompt, G 2), seq_len 6, prompt
    [p0, p1, p2]: samples carry prompt [p0, p1, p2], completions [c0, c1, c2] and [d0, d1, d2] with
    their behaviour logprobs; datum 0 is model_input [p0, p1, p2, c0, c1], target_tokens [p1, p2,
    c0, c1, c2], logprobs [0, 0, q(c0), q(c1), q(c2)], advantages [0, 0, a, a, a] with
    a = A_0 / (3 * 2) (its group advantage over its completion tokens and B)."""

    samples: tuple[RLSample, ...]
    datums: tuple  # tinker.Datum, one per sample
    decoded: tuple[TinkerDatum, ...]
    """The same datums as `wire.decode_forward_backward` hands them to the learner's backend."""
    target_tokens: int
    """Completion tokens over the batch (what the loss reads)."""


def sample_batch(model, tokenizer, encoder: ChatEncoder, c: TinkerBenchConfig) -> RLBatch:
    """B completions sampled from the base model (temperature 1, no top-k/top-p, exactly
    `seq_len - prompt` tokens each), their behaviour logprobs from one forward over them, and
    seeded 0/1 rewards; as `RLSample`s and as Tinker datums of the same tokens."""
    import tinker

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    tenant = "native"   # a label: the SDK's datums carry no tenant
    samples: list[RLSample] = []
    for g in range(c.batch // c.group_size):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [Message(role="user", content=f"Problem {g}: what is {a} + {b}?")]
        prompt = encoder.encode(messages, Message(role="assistant", content="ok")).prompt_ids
        n = c.seq_len - len(prompt)
        if n < 4:
            raise ValueError(f"--seq-len {c.seq_len} leaves {n} completion tokens after a {len(prompt)}-token prompt")
        ids = torch.tensor([prompt] * c.group_size)  # (G, prompt)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=tokenizer.pad_token_id)
            logp = torch.log_softmax(model(out).logits[:, :-1].float(), dim=-1)  # (G, L-1, V)
            behaviour = logp.gather(-1, out[:, 1:].unsqueeze(-1)).squeeze(-1)[:, len(prompt) - 1:]  # (G, n)
        for j in range(c.group_size):
            i = len(samples)
            completion = out[j, len(prompt):].tolist()
            samples.append(RLSample(
                example_id=f"{tenant}-{i}", tenant=tenant, interaction_id=f"i-{i}", feedback_event_id=f"fb-{i}",
                time=1000.0 + i, messages=messages,
                response=Message(role="assistant", content=tokenizer.decode(completion) or "."),
                prompt_token_ids=prompt, completion_token_ids=completion,
                behaviour_logprobs=behaviour[j].tolist(), reward=float(rng.random() < 0.5), group_id=f"g{g}"))
    advantages = sample_advantages(samples)
    datums, decoded = [], []
    for s, adv in zip(samples, advantages.tolist()):
        ids, n = s.prompt_token_ids + s.completion_token_ids, len(s.completion_token_ids)
        pad = len(s.prompt_token_ids) - 1   # prompt targets: no loss
        inputs = {"target_tokens": ids[1:], "logprobs": [0.0] * pad + list(s.behaviour_logprobs),
                  "advantages": [0.0] * pad + [adv / (n * len(samples))] * n}
        datums.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
        decoded.append(TinkerDatum(np.array(ids[:-1], dtype=np.int64), {
            k: np.array(v, dtype=np.int64 if k == "target_tokens" else np.float32) for k, v in inputs.items()}))
    return RLBatch(tuple(samples), tuple(datums), tuple(decoded), sum(len(s.completion_token_ids) for s in samples))


# --- probing the learner -------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestTiming:
    """One Tinker request as the learner ran it, on `time.perf_counter` (one clock for the whole
    process). Example: a forward_backward taken at 10.000 and finished at 10.120, 0.100 of it the
    backend's forward and backward: 0.020 executor (Redis queue reads and writes, protobuf)."""

    run: str
    op: str
    """forward_backward | optim_step | other (create)."""
    start: float
    end: float
    compute_s: float
    checkpoint_s: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def executor_s(self) -> float:
        return max(0.0, self.seconds - self.compute_s - self.checkpoint_s)


class LearnerProbe:
    """Every request the learner ran, timed. The learner thread times one request at a time
    (`begin`, `add`, `end`); the bench reads `of` and `busy_s` from its own."""

    def __init__(self):
        self.requests: list[RequestTiming] = []
        self._lock = threading.Lock()
        self._op, self._compute, self._checkpoint = "other", 0.0, 0.0

    def begin(self) -> None:
        self._op, self._compute, self._checkpoint = "other", 0.0, 0.0

    def add(self, seconds: float, op: str | None = None, checkpoint: bool = False) -> None:
        """`seconds` of the request's compute (its op named) or, with `checkpoint`, of its checkpoint."""
        if checkpoint:
            self._checkpoint += seconds
        else:
            self._op, self._compute = op or self._op, self._compute + seconds

    def end(self, run: str, start: float) -> None:
        with self._lock:
            self.requests.append(RequestTiming(run, self._op, start, time.perf_counter(), self._compute,
                                               self._checkpoint))

    def of(self, run: str, since: float, until: float) -> list[RequestTiming]:
        """`run`'s requests the learner took within [since, until]. (A request's end is read just
        after it was answered, so it may fall a few microseconds after the client's `until`.)"""
        with self._lock:
            return [r for r in self.requests if r.run == run and since <= r.start <= until]

    def busy_s(self, since: float, until: float) -> float:
        """Seconds the learner spent running requests within [since, until]."""
        with self._lock:
            return sum(max(0.0, min(r.end, until) - max(r.start, since)) for r in self.requests)


class ProbedBackend(InProcessBackend):
    """`InProcessBackend`, its forward/backward and AdamW timed into `probe`."""

    def __init__(self, trainer: Trainer, probe: LearnerProbe):
        super().__init__(trainer)
        self.probe = probe

    def forward_backward(self, key, data, loss_fn, config, forward_only):
        t0 = time.perf_counter()
        try:
            return super().forward_backward(key, data, loss_fn, config, forward_only)
        finally:
            self.probe.add(time.perf_counter() - t0, "forward_backward")

    def optim_step(self, key, adam):
        t0 = time.perf_counter()
        try:
            return super().optim_step(key, adam)
        finally:
            self.probe.add(time.perf_counter() - t0, "optim_step")


class ProbedTinkerWork(TinkerWork):
    """The learner's `TinkerWork`, each request (and its checkpoint) timed into `probe`."""

    def __init__(self, learner, redis_client, settings, probe: LearnerProbe):
        super().__init__(learner, redis_client, settings)
        self.probe = probe
        self.backend = ProbedBackend(learner.trainer, probe)

    def run(self, key: str) -> float | None:
        self.probe.begin()
        start = time.perf_counter()
        seconds = super().run(key)
        if seconds is not None:
            self.probe.end(key, start)
        return seconds

    def _checkpoint(self, key: str, applied: int) -> None:
        t0 = time.perf_counter()
        try:
            super()._checkpoint(key, applied)
        finally:
            self.probe.add(time.perf_counter() - t0, checkpoint=True)


# --- standing the platform up --------------------------------------------------------------------


@dataclass
class BenchPlatform:
    """Redis, the learner thread and the API, running."""

    url: str
    keys: dict[str, str]
    """Tenant -> its Tinker key."""
    learner: object
    probe: LearnerProbe
    base_model: str


@contextlib.contextmanager
def stand_up(root: Path, model_dir: Path, base_model: str, c: TinkerBenchConfig,
             tenants: int) -> Iterator[BenchPlatform]:
    """A redis-server under `root`, `tenants` registry tenants `bench0..` with Tinker keys, a
    learner on `model_dir` looping in a thread with the probed Tinker executor, and the training
    API in a uvicorn thread; all stopped on exit."""
    import redis

    from clora.infra.settings import RedisSettings
    from clora.infra.stack import redis_process
    from clora.ingest.buffers import ReplayBuffer
    from clora.learner.base_model import load_base_model
    from clora.learner.process import Learner
    from clora.learner.settings import LearnerSettings
    from clora.procs import free_port
    from clora.registry import Registry
    from clora.trainapi.service import build
    from clora.trainapi.settings import TrainApiSettings

    with contextlib.ExitStack() as stack:
        rs = RedisSettings(port=free_port())
        server = redis_process(rs, root / "data", root / "logs").start()
        stack.callback(server.stop)
        url = f"redis://{rs.host}:{rs.port}/0"
        client = redis.Redis.from_url(url)
        stack.callback(client.close)
        registry = Registry(client)
        keys = {}
        for i in range(tenants):
            registry.create_tenant(f"bench{i}")
            keys[f"bench{i}"] = registry.create_tinker_key(f"bench{i}")
        settings = TrainApiSettings(base_model=base_model, tokenizer_id=str(model_dir), max_context_length=c.seq_len,
                                    checkpoints_dir=root / "tinker-checkpoints")
        ls = LearnerSettings(adapters_dir=root / "adapters", checkpoints_dir=root / "learner-checkpoints",
                             metrics_port=0, rank=c.rank, alpha=2 * c.rank, max_seq_len=c.seq_len,
                             micro_batch_size=c.micro_batch, device="cpu", idle_sleep_s=0.2)
        model, tok = load_base_model(model_dir)
        learner = Learner(ls, model, tok, registry=registry, buffer=ReplayBuffer(client),
                          announce=lambda event: None, base_model_name=base_model)   # nothing is published
        probe = LearnerProbe()
        learner.external = ProbedTinkerWork(learner, client, settings, probe)
        stop = threading.Event()
        thread = threading.Thread(target=learner.run_forever, args=(stop,), name="bench-learner", daemon=True)
        thread.start()
        stack.callback(thread.join, 60)
        stack.callback(stop.set)
        api = stack.enter_context(_serve(build(settings, url)))
        yield BenchPlatform(api, keys, learner, probe, base_model)


@contextlib.contextmanager
def _serve(app) -> Iterator[str]:
    """`app` served by uvicorn on a free port in a thread; its URL."""
    with ServerThread(app, lifespan="auto") as server:
        yield server.url


# --- part 1: one RL step, SDK vs native ----------------------------------------------------------


@dataclass(frozen=True)
class SdkStep:
    """One RL step through the SDK, as the client saw it (`time.perf_counter`)."""

    start: float
    end: float
    loss: float
    """`loss:sum`."""
    grad_norm: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def sdk_step(training, data: Sequence, adam) -> SdkStep:
    """`forward_backward(data, "importance_sampling")` and `optim_step`, both sent, then both awaited."""
    t0 = time.perf_counter()
    fb = training.forward_backward(list(data), "importance_sampling")
    opt = training.optim_step(adam)
    out, step = fb.result(), opt.result()
    return SdkStep(t0, time.perf_counter(), out.metrics["loss:sum"],
                   (step.metrics or {}).get("grad_norm:mean", float("nan")))


def split_sdk_step(step: SdkStep, requests: list[RequestTiming]) -> dict:
    """One SDK step's wall time along the learner's clock (module docstring)."""
    fb = next(r for r in requests if r.op == "forward_backward")
    opt = next(r for r in requests if r.op == "optim_step")
    start, end = step.start, step.end
    return {"seconds": end - start, "to_learner_s": fb.start - start, "fb_request_s": fb.seconds,
            "between_s": opt.start - fb.end, "optim_request_s": opt.seconds, "back_s": max(0.0, end - opt.end),
            "compute_s": fb.compute_s + opt.compute_s, "fb_compute_s": fb.compute_s, "optim_compute_s": opt.compute_s,
            "checkpoint_s": fb.checkpoint_s + opt.checkpoint_s, "executor_s": fb.executor_s + opt.executor_s,
            "outside_learner_s": (end - start) - fb.seconds - opt.seconds}


def compare_step(p: BenchPlatform, native: Trainer, batch: RLBatch, c: TinkerBenchConfig, adam) -> dict:
    """Part 1: K interleaved steps (after one warm-up each) from the same init, three ways: through
    the SDK, the learner's Tinker backend called directly in this thread (its loss path without
    HTTP, Redis or protobuf), and natively."""
    import tinker

    policy = TrainingPolicy(algorithm="rl", learning_rate=LEARNING_RATE, batch_size=c.batch, rl_clip_eps=NATIVE_CLIP)
    native.store.register("native", SEED)
    backend = InProcessBackend(native)
    backend.create("direct", SEED)
    params = AdamParams(adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm)
    steps: dict[str, list[dict]] = {"sdk": [], "direct": [], "native": []}
    with tinker.ServiceClient(base_url=p.url, api_key=p.keys["bench0"]) as service:
        training = service.create_lora_training_client(base_model=p.base_model, rank=c.rank, seed=SEED).result()
        run = f"bench0/tinker/{training.model_id}"
        for k in range(c.steps + 1):
            through = sdk_step(training, batch.datums, adam)
            t0 = time.perf_counter()
            out = backend.forward_backward("direct", batch.decoded, "importance_sampling", {}, False)
            backend.optim_step("direct", params)
            t1 = time.perf_counter()
            mine = native.train_step("native", list(batch.samples), policy)
            t2 = time.perf_counter()
            if k == 0:
                continue   # warm-up
            split = split_sdk_step(through, p.probe.of(run, through.start, through.end))
            steps["sdk"].append(split | {"loss": through.loss, "grad_norm": through.grad_norm})
            steps["direct"].append({"seconds": t1 - t0, "loss": out.metrics["loss:sum"]})
            steps["native"].append({"seconds": t2 - t1, "loss": mine.loss, "grad_norm": mine.grad_norm})
        gap = float((p.learner.store.state(run).master - native.store.state("native").master).abs().max())
    paths = {name: summarize([s["seconds"] for s in rows]) | {"steps": rows} for name, rows in steps.items()}
    paths["sdk"]["split_mean"] = split = {k: statistics.fmean(s[k] for s in steps["sdk"])
                                          for k in steps["sdk"][0] if k.endswith("_s")}
    nat, direct, sdk = paths["native"], paths["direct"], paths["sdk"]
    return paths | {"ratio_mean": sdk["mean_s"] / nat["mean_s"], "ratio_p50": sdk["p50_s"] / nat["p50_s"],
                    "direct_ratio_mean": direct["mean_s"] / nat["mean_s"],
                    "direct_ratio_p50": direct["p50_s"] / nat["p50_s"],
                    "compute_ratio": split["compute_s"] / nat["mean_s"],
                    "loss_max_gap": max(abs(a["loss"] - b["loss"]) for a, b in zip(steps["sdk"], steps["native"])),
                    "weights_max_gap": gap, "weights_step_scale": LEARNING_RATE * (c.steps + 1)}


def summarize(seconds: Sequence[float]) -> dict:
    return {"mean_s": statistics.fmean(seconds), "p50_s": percentile(seconds, 50), "min_s": min(seconds),
            "max_s": max(seconds)}


# --- part 2: concurrent SDK clients --------------------------------------------------------------


@dataclass
class Client:
    """One SDK client on its own tenant's run."""

    tenant: str
    training: object
    steps: list[float] = field(default_factory=list)
    error: BaseException | None = None

    def train(self, data: Sequence, adam, k: int) -> None:
        """K steps, each one's seconds kept; a failure is kept in `error` (a thread's target)."""
        try:
            for _ in range(k):
                self.steps.append(sdk_step(self.training, data, adam).seconds)
        except Exception as e:  # noqa: BLE001 - re-raised by the bench, the client named
            self.error = e


def concurrency(p: BenchPlatform, batch: RLBatch, c: TinkerBenchConfig, adam) -> list[dict]:
    """Part 2: for each C, the first C clients one after another, then all C at once."""
    import tinker

    rows = []
    with contextlib.ExitStack() as stack:
        clients = []
        for i in range(max(c.clients)):
            service = stack.enter_context(tinker.ServiceClient(base_url=p.url, api_key=p.keys[f"bench{i}"]))
            training = service.create_lora_training_client(base_model=p.base_model, rank=c.rank, seed=SEED + i).result()
            clients.append(Client(f"bench{i}", training))
            sdk_step(training, batch.datums, adam)   # warm-up
        for n in c.clients:
            phases = {mode: _phase(p, clients[:n], batch, c, adam, mode) for mode in ("sequential", "concurrent")}
            rows.append({"clients": n, **phases,
                         "speedup": phases["sequential"]["wall_s"] / phases["concurrent"]["wall_s"]})
    return rows


def _phase(p: BenchPlatform, group: list[Client], batch: RLBatch, c: TinkerBenchConfig, adam, mode: str) -> dict:
    """K steps of every client in `group`: one client after another, or all at once."""
    for cl in group:
        cl.steps, cl.error = [], None
    start = time.perf_counter()
    if mode == "sequential":
        for cl in group:
            cl.train(batch.datums, adam, c.steps)
            if cl.error is not None:
                break
    else:
        threads = [threading.Thread(target=cl.train, args=(batch.datums, adam, c.steps),
                                    name=f"bench-client-{cl.tenant}") for cl in group]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    end = time.perf_counter()
    if failed := next((cl for cl in group if cl.error is not None), None):
        raise RuntimeError(f"{mode}, {len(group)} clients: {failed.tenant}'s step failed") from failed.error
    wall, steps = end - start, len(group) * c.steps
    return {"wall_s": wall, "steps": steps, "steps_per_s": steps / wall,
            "step_mean_s": statistics.fmean(s for cl in group for s in cl.steps),
            "learner_busy_share": p.probe.busy_s(start, end) / wall,
            "per_client_steps_s": {cl.tenant: cl.steps for cl in group}}


# --- the run -------------------------------------------------------------------------------------


def machine() -> dict:
    return {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "tinker": _version("tinker")}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def prepare_model(c: TinkerBenchConfig, root: Path) -> tuple[Path, str]:
    """(HF model dir, the name clients pass as base_model)."""
    from clora.learner.base_model import make_tiny_model, prepare_base_model

    if c.model == "tiny":
        return make_tiny_model(root / "tiny", seed=0), "tiny"
    path = prepare_base_model(c.model, c.models_dir)
    return path, c.model if c.model == "smollm2" else path.name


def run(c: TinkerBenchConfig, console: Console | None = None) -> dict:
    """Run both parts, print the tables, write the JSON; the report."""
    import tinker

    from clora.learner.adapter_store import AdapterStore
    from clora.learner.base_model import load_base_model
    from clora.learner.lora import LoraModel, LoraSpec
    from clora.learner.trainer import TrainerConfig

    console = console or (Console() if sys.stdout.isatty() else Console(width=200))
    root = Path(tempfile.mkdtemp(prefix="clora-bench-tinker-"))
    threads, telemetry = torch.get_num_threads(), os.environ.get("TINKER_TELEMETRY")
    torch.set_num_threads(c.threads)
    os.environ["TINKER_TELEMETRY"] = "0"
    before = machine()
    try:
        model_dir, base_model = prepare_model(c, root)
        console.print(f"[bold]clora bench tinker[/]: model {c.model}, {c.steps} steps, batch {c.batch} "
                      f"({c.batch // c.group_size} prompts x {c.group_size}), {c.seq_len} tokens each, clients "
                      f"{','.join(map(str, c.clients))}, {c.threads} torch threads; data under {root}")
        model, tok = load_base_model(model_dir)
        encoder = ChatEncoder(tok, c.seq_len)
        batch = sample_batch(model, tok, encoder, c)   # from the base model, before LoRA wraps it
        lm = LoraModel(model, LoraSpec(rank=c.rank, alpha=2 * c.rank))
        native = Trainer(lm, encoder, AdapterStore(lm, prefetch=False),
                         TrainerConfig(micro_batch_size=c.micro_batch, max_seq_len=c.seq_len))
        a = native.cfg.adam   # the native optimizer's settings, sent by the SDK
        adam = tinker.AdamParams(learning_rate=LEARNING_RATE, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                                 weight_decay=a.weight_decay, grad_clip_norm=a.max_grad_norm or 0.0)
        with stand_up(root, model_dir, base_model, c, max(c.clients)) as p:
            step = compare_step(p, native, batch, c, adam)
            console.print(f"one step compared; now {','.join(map(str, c.clients))} concurrent clients")
            clients = concurrency(p, batch, c, adam)
    finally:
        torch.set_num_threads(threads)
        if telemetry is None:
            os.environ.pop("TINKER_TELEMETRY", None)
        else:
            os.environ["TINKER_TELEMETRY"] = telemetry
        shutil.rmtree(root, ignore_errors=True)
    report = {"config": asdict(c), "machine": before | {"load_avg_after": os.getloadavg()},
              "batch": {"sequences": c.batch, "tokens": c.batch * c.seq_len, "target_tokens": batch.target_tokens},
              "rl_step": step, "concurrency": clients, "note": NOTE, "time": time.time()}
    console.print(step_table(report))
    console.print(concurrency_table(report))
    console.print(NOTE, highlight=False)
    out = Path(c.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    console.print(f"wrote {out}")
    return report


NOTE = ("Sampling is excluded from both paths (the same engine serves either); the batch is sampled once "
        "from the base model. Client, API and learner share one process here (one GIL); deployed they "
        "are three.")


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1000 * x:.1f}"


def step_table(report: dict) -> Table:
    c, s = report["config"], report["rl_step"]
    sdk, direct, nat, split = s["sdk"], s["direct"], s["native"], s["sdk"]["split_mean"]
    t = Table(title=f"one RL step, SDK vs native: {c['model']}, batch {c['batch']} x {c['seq_len']} tokens, "
                    f"{c['steps']} steps each (ms)")
    t.caption = ("SDK = forward_backward(importance_sampling) + optim_step through HTTP, Redis and the learner's "
                 "scheduler; direct = the learner's Tinker backend called in this thread (its loss path, no "
                 "transport); native = Trainer.train_step (rl) on the same tokens. Learner compute = the backend's "
                 "forward/backward + AdamW; checkpoint = optim_step's fsynced state; executor = Redis queue + "
                 "protobuf in the learner; outside = client, HTTP, API, wake-ups and the long-poll. Same step both "
                 f"ways: loss gap {s['loss_max_gap']:.1e}, weight gap {s['weights_max_gap']:.1e} after "
                 f"{c['steps'] + 1} steps of lr {LEARNING_RATE:g}.")
    for col in ("path", "mean", "p50", "vs native: mean / p50", "learner compute", "checkpoint", "executor",
                "outside learner", "to learner / between / back"):
        t.add_column(col, justify="right")
    t.add_row("SDK", _ms(sdk["mean_s"]), _ms(sdk["p50_s"]), f"{s['ratio_mean']:.2f}x / {s['ratio_p50']:.2f}x",
              _ms(split["compute_s"]), _ms(split["checkpoint_s"]), _ms(split["executor_s"]),
              _ms(split["outside_learner_s"]),
              f"{_ms(split['to_learner_s'])} / {_ms(split['between_s'])} / {_ms(split['back_s'])}")
    t.add_row("direct backend", _ms(direct["mean_s"]), _ms(direct["p50_s"]),
              f"{s['direct_ratio_mean']:.2f}x / {s['direct_ratio_p50']:.2f}x",
              _ms(direct["mean_s"]), "—", "—", "—", "—")
    t.add_row("native", _ms(nat["mean_s"]), _ms(nat["p50_s"]), "1", _ms(nat["mean_s"]), "—", "—", "—", "—")
    return t


def concurrency_table(report: dict) -> Table:
    c = report["config"]
    t = Table(title=f"concurrent SDK clients, one tenant each: {c['steps']} RL steps per client, {c['model']}")
    t.caption = ("sequential = the same clients one after another; learner busy = the share of the wall the "
                 "learner thread spent running requests (it runs one at a time)")
    for col in ("clients", "sequential s", "concurrent s", "steps/s seq -> conc", "step ms seq -> conc",
                "learner busy seq -> conc", "speed-up"):
        t.add_column(col, justify="right")
    for r in report["concurrency"]:
        sq, cc = r["sequential"], r["concurrent"]
        t.add_row(str(r["clients"]), f"{sq['wall_s']:.2f}", f"{cc['wall_s']:.2f}",
                  f"{sq['steps_per_s']:.2f} -> {cc['steps_per_s']:.2f}",
                  f"{_ms(sq['step_mean_s'])} -> {_ms(cc['step_mean_s'])}",
                  f"{sq['learner_busy_share']:.0%} -> {cc['learner_busy_share']:.0%}", f"{r['speedup']:.2f}x")
    return t


def parse_args(argv: Sequence[str] | None = None) -> tuple[TinkerBenchConfig, str]:
    """(the config, the log level) from `benchmarks/bench_tinker.py`'s command line."""
    d = TinkerBenchConfig()
    ap = argparse.ArgumentParser(prog="clora bench tinker", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=d.model, help="tiny, smollm2 or a local HF model directory")
    ap.add_argument("--steps", type=int, default=d.steps, help="K: timed steps per path and per client")
    ap.add_argument("--clients", default=",".join(map(str, d.clients)), help="client counts, comma-separated")
    ap.add_argument("--batch", type=int, default=d.batch, help="B: sampled completions per step")
    ap.add_argument("--group-size", type=int, default=d.group_size, help="G: completions per prompt")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence, prompt + completion")
    ap.add_argument("--micro-batch", type=int, default=d.micro_batch, help="the learner's micro-batch size")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    ap.add_argument("--models-dir", default=d.models_dir, help="where smollm2 is converted once")
    ap.add_argument("--out", default=d.out, help="JSON output")
    ap.add_argument("--log-level", default="WARNING")
    a = ap.parse_args(argv)
    try:
        clients = tuple(int(x) for x in a.clients.split(",") if x.strip())
        config = TinkerBenchConfig(model=a.model, steps=a.steps, clients=clients, batch=a.batch,
                                   group_size=a.group_size, seq_len=a.seq_len, micro_batch=a.micro_batch,
                                   threads=a.threads, models_dir=a.models_dir, out=a.out)
    except ValueError as e:
        ap.error(str(e))
    return config, a.log_level


def main(argv: Sequence[str] | None = None) -> dict:
    """`python benchmarks/bench_tinker.py [options]`: parse, log at `--log-level`, run."""
    config, level = parse_args(argv)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(config)
