"""`clora bench fairness`: fair shares under a 10:1 skew, for serving and for training, each with
fairness off (the baseline) and on in the same run.

    clora bench fairness [--seconds 40] [--slots 8] [--light-tokens 16] [--skew 10]
    python benchmarks/bench_fairness.py ...          # the same command

**Serving** runs the real gateway over a real vLLM engine (one replica of the test suite's tiny
random model, embedded broker and Redis, in this process as `benchmarks/bench_serving.py` does).
Two tenants of equal weight each keep as many streamed completions outstanding as their quota
allows (`slots`, the engine's sequence slots, with `tenant_engine_share` 1.0 so that the quota
alone does not split the engine: each tenant alone would fill it, so both want more than their
share). Their offered load differs by `skew` in tokens: `heavy` asks for `skew x light_tokens`
tokens a request, `light` for `light_tokens` (`ignore_eos`: exactly that many). vLLM serves the
requests it holds first come, first served, so without fair admission `heavy` gets ~`skew`x the
tokens. The same engine then serves the same load with `fair_admission` on. Measured from the
clients: each streamed token at its arrival; Jain's index of tokens served per tenant over sliding
windows of `window_s` (a third of each phase by default, stepped by 1 s after a warm-up: the run
is far shorter than the 5-minute window of the target), the whole phase's index, each tenant's
longest wait for its first token (its queue wait: in the gateway's queue or in vLLM's), and the
throughput ratio fair / baseline.

**Training** is measured twice.

- On the real learner (`clora.learner.process.Learner`, in this process, over a real
  redis-server, its registry and replay buffers): the learner's throughput is measured first
  (examples/s, a few steps on full backlogs), then `light` is offered 0.75x of it and `heavy`
  `skew`x that, as SFT examples of 32-224 tokens written into the buffers while the learner
  ticks for `learner_seconds`. Both want more than their share. Trained tokens are counted
  as each step is recorded with the scheduler; a tenant's wait is from becoming eligible to
  being picked. Model: `learner_model` (the serving phases' tiny model by default, `smollm2`,
  or an HF folder).
- On a step-cost model, `seconds = step_fixed_s + step_per_token_s x tokens`, over
  `learner_minutes` of simulated time, for windows as long as the target's.

Baseline: the scheduler as it was (uncapped backlog bonus, charged seconds); fair: the backlog
bonus capped at `full_backlog`, charged tokens. Jain's index of training tokens over sliding
windows.

Prints a table and writes JSON (`out`, default bench-results/fairness.json).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

TENANTS = ("heavy", "light")


@dataclass(frozen=True)
class FairnessBenchConfig:
    seconds: float = 40.0
    """Length of each serving phase (baseline, then fair)."""
    slots: int = 8
    """The engine's sequence slots (`max_num_seqs`): each tenant's quota, and the fair queue's size."""
    light_tokens: int = 16
    """Tokens per `light` request; `heavy`'s are `skew` times as many."""
    skew: int = 10
    window_s: float | None = None
    """Sliding window of the Jain index (None: a third of a phase)."""
    shares_phase: bool = False
    """Also a third serving phase, after fair order alone, with per-tenant shares on
    (`GatewaySettings.fair_shares`), so that both are measured in one run."""
    learner_minutes: float = 30.0
    """Simulated training time per step-cost-model phase."""
    learner_seconds: float = 90.0
    """Real training time per real-learner phase (0: skip the real learner)."""
    learner_min_steps: int = 0
    """A real-learner phase also goes on until each tenant has trained this many steps after
    the warm-up and has waited for a pick at least once (at most 20 x `learner_seconds`): on a
    loaded machine, whose steps are slow, a short phase still measures both tenants."""
    learner_model: str = "tiny"
    """The real learner's base: "tiny" (the serving phases' model), "smollm2", or an HF folder."""
    step_fixed_s: float = 0.4
    step_per_token_s: float = 0.0005
    batch_size: int = 8
    out: str = "bench-results/fairness.json"

    def __post_init__(self) -> None:
        if self.seconds < 6:
            raise ValueError(f"--seconds must be >= 6 (a phase needs a warm-up and windows), got {self.seconds}")
        if self.slots < 2 or self.skew < 1 or self.light_tokens < 1:
            raise ValueError("--slots must be >= 2, --skew and --light-tokens >= 1")
        if self.learner_seconds and self.learner_seconds < 12:
            raise ValueError(f"--learner-seconds must be 0 or >= 12, got {self.learner_seconds}")

    @property
    def window(self) -> float:
        return self.window_s or self.seconds / 3


@dataclass(frozen=True)
class Served:
    """Tokens a tenant got at one moment (seconds from the phase's start)."""

    at: float
    tenant: str
    tokens: int


def jain(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1.0 is equal shares, 1/n one takes all."""
    total, squares = sum(xs), sum(x * x for x in xs)
    return total * total / (len(xs) * squares) if squares else float("nan")


def sliding_jain(served: list[Served], start: float, end: float, window: float, step: float = 1.0) -> list[float]:
    """Jain's index of tokens per tenant in each window [t, t + window) from `start` to `end`."""
    times: dict[str, list[float]] = {name: [] for name in TENANTS}
    sums: dict[str, list[int]] = {name: [0] for name in TENANTS}      # tokens before each point
    for s in sorted(served, key=lambda s: s.at):
        times[s.tenant].append(s.at)
        sums[s.tenant].append(sums[s.tenant][-1] + s.tokens)

    def tokens(name: str, a: float, b: float) -> int:
        return sums[name][bisect.bisect_left(times[name], b)] - sums[name][bisect.bisect_left(times[name], a)]

    out, t = [], start
    while t + window <= end + 1e-9:
        out.append(jain([tokens(name, t, t + window) for name in TENANTS]))
        t += step
    return out


@dataclass
class Phase:
    """One phase's per-tenant numbers and fairness."""

    mode: str
    offered_tokens: dict[str, int]
    served_tokens: dict[str, int]
    max_wait_s: dict[str, float]
    jain_windows: list[float]
    jain_whole: float
    tokens_per_s: float
    errors: int = 0
    first_error: str | None = None
    jain_min_by_window: dict[str, float] = field(default_factory=dict)
    """The worst window's index at other window lengths too ("20 s": 0.94, ...): the short ones
    show how lumpy the shares are, the long ones what the target's window sees."""

    @property
    def jain_min(self) -> float:
        return min(self.jain_windows) if self.jain_windows else float("nan")


OTHER_WINDOWS_S = (20.0, 60.0, 300.0)
"""Window lengths whose worst index is also reported beside the configured one's."""


def summarize(mode: str, served: list[Served], offered: dict[str, int], waits: dict[str, list[float]],
              warmup: float, end: float, window: float, errors: int = 0, step: float = 1.0,
              first_error: str | None = None) -> Phase:
    counted = [s for s in served if warmup <= s.at < end]
    per = {name: sum(s.tokens for s in counted if s.tenant == name) for name in TENANTS}
    by_window = {f"{w:g} s": min(sliding_jain(served, warmup, end, w, step)) for w in OTHER_WINDOWS_S
                 if w != window and warmup + w <= end}
    return Phase(mode, offered, per, {t: max(w, default=0.0) for t, w in waits.items()},
                 sliding_jain(served, warmup, end, window, step), jain(list(per.values())),
                 sum(per.values()) / max(1e-9, end - warmup), errors, first_error, by_window)


# --- serving ------------------------------------------------------------------------------

async def serve_phase(url: str, keys: dict[str, str], config: FairnessBenchConfig, mode: str) -> Phase:
    """Every tenant keeps `slots` streamed completions outstanding for `seconds`, through the
    gateway at `url` (its OpenAI base URL, `.../v1`)."""
    served: list[Served] = []
    offered = {name: 0 for name in TENANTS}
    waits: dict[str, list[float]] = {name: [] for name in TENANTS}
    errors, first_error = 0, None
    tokens = {"heavy": config.light_tokens * config.skew, "light": config.light_tokens}
    t0 = time.monotonic()
    deadline = t0 + config.seconds

    async def client(http: httpx.AsyncClient, tenant: str) -> None:
        nonlocal errors, first_error
        body = {"model": tenant, "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": tokens[tenant], "stream": True, "ignore_eos": True, "return_token_ids": True,
                "temperature": 0}
        headers = {"authorization": f"Bearer {keys[tenant]}"}
        while time.monotonic() < deadline:
            sent, first = time.monotonic(), True
            offered[tenant] += tokens[tenant]
            try:
                async with http.stream("POST", url + "/chat/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        errors += 1
                        first_error = first_error or f"{r.status_code}: {(await r.aread())[:300]!r}"
                        await asyncio.sleep(0.2)
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ())
                        if n:
                            now = time.monotonic()
                            if first:
                                waits[tenant].append(now - sent)
                                first = False
                            served.append(Served(now - t0, tenant, n))
            except httpx.HTTPError as e:
                errors += 1
                first_error = first_error or repr(e)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=4 * config.slots)) as http:
        await asyncio.gather(*(client(http, t) for t in TENANTS for _ in range(config.slots)))
    end = time.monotonic() - t0
    return summarize(mode, served, offered, waits, warmup=min(5.0, config.seconds / 5), end=min(end, config.seconds),
                     window=config.window, errors=errors, first_error=first_error)


def tiny_model(path: Path) -> Path:
    """The test suite's tiny random model (`tests/serving/tiny.py`), written at `path`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "clora_serving_tiny", Path(__file__).resolve().parents[1] / "tests" / "serving" / "tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return tiny.make_model(path)


def run_serving(config: FairnessBenchConfig, console: Console) -> list[Phase]:
    import redis

    from clora.infra.settings import BrokerSettings, RedisSettings
    from clora.infra.stack import LocalStack
    from clora.ingest.producer import ensure_topics
    from clora.procs import free_port
    from clora.registry import Registry
    from clora.serving.service import ServingService
    from clora.serving.settings import EngineSettings, GatewaySettings
    from clora.settings import PlatformSettings

    work = Path(tempfile.mkdtemp(prefix="clora-bench-fairness-"))
    stack = LocalStack(platform=PlatformSettings(data_dir=work / "data"), broker=BrokerSettings(port=free_port()),
                       redis=RedisSettings(port=free_port())).start()
    svc = None
    try:
        ensure_topics(stack.kafka_bootstrap, partitions=stack.broker.partitions)
        model = tiny_model(work / "tiny")
        reg = Registry(redis.Redis.from_url(stack.redis_url))
        keys = {name: reg.create_tenant(name)[1] for name in TENANTS}  # no version yet: the base model
        es = EngineSettings(model=str(model), ports=[free_port()], max_model_len=512, max_num_seqs=config.slots,
                            log_dir=work / "logs", start_timeout_s=900)
        gs = GatewaySettings(port=0, metrics_port=0, spool_dir=work / "spool", tenant_engine_share=1.0,
                             tenant_concurrency=config.slots, tenant_rate_per_s=1000, tenant_burst=1000,
                             fair_admission=False)
        svc = ServingService(es, gs, kafka_bootstrap=stack.kafka_bootstrap, redis_url=stack.redis_url).start()
        console.print(f"engine up; serving phases of {config.seconds:g} s each", highlight=False)
        phases = []
        for mode in ("baseline", "fair") + (("fair + shares",) if config.shares_phase else ()):
            gs.fair_admission = mode != "baseline"
            svc.gateway.fair.shares = mode == "fair + shares"      # read per send: the queue is idle now
            phase = asyncio.run(serve_phase(svc.url, keys, config, mode))
            phases.append(phase)
            others = ", ".join(f"{w} windows {j:.3f}" for w, j in phase.jain_min_by_window.items())
            console.print(f"{mode}: Jain min {phase.jain_min:.3f}, whole {phase.jain_whole:.3f}"
                          + (f" (worst {others})" if others else ""), highlight=False)
        return phases
    finally:
        if svc is not None:
            svc.stop()
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)


# --- training -----------------------------------------------------------------------------

class Arrivals:
    """The offered load of a training phase: `light` gets 0.75x of the learner's `capacity`
    (examples/s) and `heavy` `skew`x that, so that both want more than their share. `due` says
    how many examples a tenant is owed by `now` (seconds from the phase's start) beyond the
    `start` each got at once."""

    def __init__(self, capacity: float, skew: int, start: int = 0):
        self.rate = {"light": 0.75 * capacity, "heavy": 0.75 * capacity * skew}
        self.start = start
        self.arrived = {name: start for name in TENANTS}

    def due(self, tenant: str, now: float) -> int:
        n = max(0, self.start + int(self.rate[tenant] * now) - self.arrived[tenant])
        self.arrived[tenant] += n
        return n


class Tally:
    """What a training phase gave each tenant, for the simulated and the real learner alike:
    tokens at the end of each of its steps, and each wait from becoming eligible to being picked."""

    def __init__(self) -> None:
        self.served: list[Served] = []
        self.waits: dict[str, list[float]] = {name: [] for name in TENANTS}
        self._since: dict[str, float] = {}

    def picking(self, views, now: float) -> None:
        """The scheduler is about to pick among `views` (`TenantView`s) at `now`."""
        for v in views:
            if v.eligible:
                self._since.setdefault(v.id, now)
            else:
                self._since.pop(v.id, None)

    def picked(self, tenant: str | None, now: float) -> None:
        if tenant in self._since:
            self.waits[tenant].append(now - self._since.pop(tenant))

    def trained(self, tenant: str, at: float, tokens: int) -> None:
        self.served.append(Served(at, tenant, tokens))

    def measured_each(self, steps: int, seconds: float) -> bool:
        """Whether, were the phase `seconds` long, each tenant trained `steps` steps after its
        warm-up and waited for a pick at least once."""
        warmup = seconds / 6
        return all(sum(s.tenant == name and s.at >= warmup for s in self.served) >= steps
                   and max(self.waits[name], default=0.0) > 0 for name in TENANTS)

    def phase(self, mode: str, offered: dict[str, int], seconds: float) -> Phase:
        """The phase's numbers, over sliding windows of a third of its `seconds` after a warm-up."""
        window = seconds / 3
        return summarize(mode, self.served, offered, self.waits, warmup=window / 2, end=seconds, window=window,
                         step=window / 20)


def run_learner(config: FairnessBenchConfig, fair: bool) -> Phase:
    """Simulated training: examples arrive at fixed rates, the scheduler picks, each step costs
    the model's seconds; tokens counted at each step's end."""
    from clora.learner.scheduler import Scheduler, TenantView

    rng = random.Random(7)
    clock = [0.0]
    sched = Scheduler(clock=lambda: clock[0], **({} if fair else {"full_backlog": None}))
    mean_tokens = 128  # examples of 32..224 tokens
    step_s = config.step_fixed_s + config.step_per_token_s * config.batch_size * mean_tokens
    arrivals = Arrivals(config.batch_size / step_s, config.skew)  # capacity: examples/s the learner trains
    backlog: dict[str, list[int]] = {name: [] for name in TENANTS}
    offered = {name: 0 for name in TENANTS}
    tally = Tally()
    end = config.learner_minutes * 60
    while clock[0] < end:
        for name in TENANTS:  # arrivals up to now
            for _ in range(arrivals.due(name, clock[0])):
                n = rng.randint(32, 224)
                backlog[name].append(n)
                offered[name] += n
        views = [TenantView(name, False, 1.0, 0, 1, len(backlog[name])) for name in TENANTS]
        tally.picking(views, clock[0])
        tenant = sched.pick(views).tenant
        if tenant is None:
            clock[0] += 0.1
            continue
        tally.picked(tenant, clock[0])
        batch, backlog[tenant] = backlog[tenant][: config.batch_size], backlog[tenant][config.batch_size:]
        tokens = sum(batch)
        seconds = config.step_fixed_s + config.step_per_token_s * tokens
        clock[0] += seconds
        tally.trained(tenant, clock[0], tokens)
        sched.record(tenant, seconds, tokens=tokens if fair else None)
    return tally.phase("fair" if fair else "baseline", offered, end)


WORDS = ("red", "blue", "green", "stone", "river", "cloud", "seven", "lamp", "north", "quiet", "paper", "bright")


class RealLearner:
    """A real learner over a real redis-server, one fresh world (registry, buffers, learner)
    per phase; see the module's docstring."""

    def __init__(self, config: FairnessBenchConfig, work: Path):
        import redis

        from clora.infra.settings import RedisSettings
        from clora.infra.stack import redis_process
        from clora.learner.base_model import load_base_model, prepare_base_model
        from clora.procs import free_port

        self.config, self.work = config, work
        rs = RedisSettings(port=free_port())
        self.server = redis_process(rs, work / "redis", work / "logs").start()
        self.client = redis.Redis.from_url(f"redis://{rs.host}:{rs.port}/0")
        source = config.learner_model
        self.model_dir = tiny_model(work / "tiny") if source == "tiny" else prepare_base_model(source)
        self._load = load_base_model
        self.tokenizer = load_base_model(self.model_dir)[1]
        self.rng = random.Random(11)
        self.serial = 0
        self.answers = [self._answer() for _ in range(256)]
        """(answer, its tokens): examples are drawn from these, so offering costs no tokenizing."""

    def _answer(self) -> tuple[str, int]:
        """An answer of 32-224 tokens, whatever the tokenizer."""
        want, words = self.rng.randint(32, 224), self.rng.choice(WORDS)
        while (n := len(self.tokenizer.encode(words))) < want:
            words += " " + " ".join(self.rng.choice(WORDS) for _ in range(max(1, (want - n) // 4)))
        return words, n

    def close(self) -> None:
        self.client.close()
        self.server.stop()

    def learner(self, name: str):
        """A fresh registry with `TENANTS` (SFT, equal weights) and a learner over it."""
        from clora.ingest.buffers import ReplayBuffer
        from clora.learner.process import Learner
        from clora.learner.settings import LearnerSettings
        from clora.registry import LearningPolicy, Registry

        self.client.flushdb()
        registry = Registry(self.client)
        b = self.config.batch_size
        for t in TENANTS:
            registry.create_tenant(t, policy=LearningPolicy(algorithm="sft", learning_rate=1e-4, batch_size=b,
                                                            min_new_examples=b))
        root = self.work / name
        settings = LearnerSettings(adapters_dir=root / "adapters", checkpoints_dir=root / "checkpoints",
                                   metrics_port=0, rank=8, alpha=16, max_seq_len=256, idle_sleep_s=0.05,
                                   publish_every=10**6, checkpoint_every=10**6, device="cpu")
        model, tok = self._load(self.model_dir)
        self.buffer = ReplayBuffer(self.client)
        return Learner(settings, model, tok, registry=registry, buffer=self.buffer, announce=lambda event: None,
                       base_model_name=str(self.model_dir))

    def offer(self, tenant: str, n: int) -> int:
        """`n` new SFT examples of 32-224 tokens (their answers) for `tenant`; their tokens."""
        from clora.ingest.buffers import PendingWrite
        from clora.ingest.schemas import Message, SFTExample

        items, tokens = [], 0
        for _ in range(n):
            self.serial += 1
            words, length = self.rng.choice(self.answers)
            tokens += length
            ex = SFTExample(example_id=f"x{self.serial}", tenant=tenant, interaction_id=f"i{self.serial}",
                            feedback_event_id=f"f{self.serial}", time=time.time(),
                            messages=[Message(role="user", content="Say the words.")],
                            target=Message(role="assistant", content=words))
            items.append(PendingWrite(f"f{self.serial}", [ex], "", None))
        if items:
            self.buffer.add_many(tenant, items, now=time.time())
        return tokens

    def capacity(self) -> float:
        """Examples/s the learner trains, on full backlogs (after one warm-up step each)."""
        learner = self.learner("calibrate")
        for t in TENANTS:
            self.offer(t, 6 * self.config.batch_size)
        for _ in TENANTS:
            learner.tick()
        done, t0 = 0, time.monotonic()
        for _ in range(6):
            if learner.tick() is not None:
                done += self.config.batch_size
        learner.shutdown()
        return done / (time.monotonic() - t0)

    def phase(self, fair: bool, capacity: float) -> Phase:
        """`learner_seconds` of training under the offered load, with the scheduler as it was
        (fair=False) or as it is."""
        c = self.config
        learner = self.learner("fair" if fair else "baseline")
        sched = learner.scheduler
        tally = Tally()
        t0 = time.monotonic()
        record, pick = sched.record, sched.pick
        if not fair:
            sched.full_backlog = None

        def recorded(tenant, seconds, tokens=None):
            if tokens is not None and tenant in TENANTS:
                tally.trained(tenant, time.monotonic() - t0, tokens)
            record(tenant, seconds, tokens=tokens if fair else None)

        def picked(views):
            now = time.monotonic() - t0
            tally.picking(views, now)
            decision = pick(views)
            tally.picked(decision.tenant, now)
            return decision

        sched.record, sched.pick = recorded, picked
        arrivals = Arrivals(capacity, c.skew, start=c.batch_size)
        offered = {name: self.offer(name, c.batch_size) for name in TENANTS}    # a step's worth each to start
        while (now := time.monotonic() - t0) < c.learner_seconds or (
                now < 20 * c.learner_seconds and not tally.measured_each(c.learner_min_steps, now)):
            for name in TENANTS:
                if due := arrivals.due(name, now):
                    offered[name] += self.offer(name, due)
            learner.tick()
        learner.shutdown()
        return tally.phase(("fair" if fair else "baseline") + " (real learner)", offered, now)


def run_real_learner(config: FairnessBenchConfig, console: Console) -> list[Phase]:
    work = Path(tempfile.mkdtemp(prefix="clora-bench-fairness-learner-"))
    real = RealLearner(config, work)
    try:
        capacity = real.capacity()
        console.print(f"real learner ({config.learner_model}): {capacity:.1f} examples/s on full backlogs; "
                      f"offering light {0.75 * capacity:.1f}/s, heavy {0.75 * capacity * config.skew:.1f}/s",
                      highlight=False)
        return [real.phase(fair, capacity) for fair in (False, True)]
    finally:
        real.close()
        shutil.rmtree(work, ignore_errors=True)


# --- the report ---------------------------------------------------------------------------

def table(title: str, phases: list[Phase]) -> Table:
    t = Table(title=title)
    for col in ("mode", "tenant", "offered tok", "served tok", "max wait s", "Jain min (windows)", "Jain whole",
                "tok/s"):
        t.add_column(col, justify="right" if col not in ("mode", "tenant") else "left")
    for p in phases:
        for i, name in enumerate(TENANTS):
            t.add_row(p.mode if i == 0 else "", name, str(p.offered_tokens[name]), str(p.served_tokens[name]),
                      f"{p.max_wait_s[name]:.2f}", f"{p.jain_min:.3f}" if i == 0 else "",
                      f"{p.jain_whole:.3f}" if i == 0 else "", f"{p.tokens_per_s:.1f}" if i == 0 else "")
    return t


def main(config: FairnessBenchConfig, console: Console | None = None) -> dict:
    console = console or Console()
    serving = run_serving(config, console)
    real = run_real_learner(config, console) if config.learner_seconds else []
    learner = [run_learner(config, fair) for fair in (False, True)]
    console.print(table(f"serving: equal weights, {config.skew}:1 offered tokens, {config.slots} engine slots, "
                        f"windows of {config.window:.0f} s", serving))
    base = serving[0]
    ratios = {p.mode: p.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("nan") for p in serving[1:]}
    ratio = ratios["fair"]
    for p in serving:
        if p.first_error:
            console.print(f"{p.mode}: {p.errors} requests failed, the first: {p.first_error}", highlight=False)
    console.print("throughput " + ", ".join(f"{mode} / baseline: {r:.2f}" for mode, r in ratios.items())
                  + "; errors " + " / ".join(str(p.errors) for p in serving)
                  + "; max wait = longest time to a request's first token", highlight=False)
    if real:
        console.print(table(f"training on the real learner ({config.learner_model}), {config.learner_seconds:g} s "
                            f"per phase, windows of a third", real))
    console.print(table(f"training (scheduler on the step-cost model, {config.learner_minutes:g} simulated min, "
                        f"windows of a third)", learner))
    result = {"config": asdict(config) | {"window_s": config.window},
              "serving": [asdict(p) | {"jain_min": p.jain_min} for p in serving],
              "serving_throughput_ratio": ratio,
              "serving_throughput_ratios": ratios,
              "learner_real": [asdict(p) | {"jain_min": p.jain_min} for p in real],
              "learner": [asdict(p) | {"jain_min": p.jain_min} for p in learner]}
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out}")
    return result
