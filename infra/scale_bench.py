"""`clora bench scale`: scale-out on one machine, side by side in one run: ingest and serving
throughput with 1 vs 2 instances of each service, and how long a learner's tenants take to move
when it is killed.

    clora bench scale [--model tiny|<HF dir>] [--events 10000] [--batch 50] [--clients 4]
                      [--requests 128] [--concurrency 8] [--max-tokens 32] [--lease-ttl 6]
    python benchmarks/bench_scale.py ...          # the same command

One cluster (`clora.infra.cluster`: every service its own process, sharing only the broker, Redis
and an S3 store, moto here) runs the whole time; instances are added between the runs:

1. **Ingest, webhook -> buffer** (1 webhook + 1 ingest worker, then 2 + 2). Tenants `ing-*`, one
   per partition (so every worker of the group has work), each with interactions logged
   straight to Kafka before the clock starts; then `events` scores on them, POSTed in batches of
   `batch` records by `clients` senders spread over the webhooks. Events/s = events / (first
   send -> the last example in the replay buffers); the webhooks' own accept rate (-> the last
   202) beside it.
2. **Learner failover** (2 learners, lease TTL `lease_ttl_s`). Tenant `fail` learns from
   corrections until it has a version; then the learner holding its lease is killed with -9
   and two more corrections arrive. Measured from the kill: until the other learner holds the
   lease (`takeover_s`; the bound is the TTL + one idle tick of the survivor) and until the
   tenant's next version is in the registry (`next_version_s`: the takeover, reading the
   tenant's checkpoint from the store, one step, the gate and the publish).
3. **Serving, gateway completions** (1 gateway on 1 vLLM replica, then 2 gateways each on both
   replicas). `requests` chat completions of exactly `max_tokens` tokens (`ignore_eos`) to
   tenant `fail`'s live adapter, `concurrency` clients in total spread over the gateways, after
   a warm-up that loads and verifies the adapter on every replica. Completions/s, tokens/s and
   the latency percentiles.

**On this 2-core machine the instances share the same two cores** (each vLLM replica is bound to
its own core, `cluster.core_share`; every Python service and the load generator float over both),
so 2 instances cannot do twice the work of 1: the numbers show that scale-out is correct (two
webhooks, two workers and two gateways each carry their share, and the throughput holds or
rises) more than how it speeds up; on separate machines each instance brings its own cores.
Prints a table and writes JSON (`out`, default bench-results/scale.json).
"""

from __future__ import annotations

import json
import os
import platform as platform_info
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from clora.freshness import percentile
from clora.infra.cluster import Cluster, ClusterConfig, ClusterProcess, tenants_over_partitions
from clora.registry import LearningPolicy

FAILOVER_TENANT = "fail"
SFT_POLICY = LearningPolicy(algorithm="sft", learning_rate=2e-2, batch_size=2, min_new_examples=1,
                            fresh_fraction=1.0, eval_tolerance=1.0, drift_tolerance=None, reward_guard=False,
                            hacking_guard=False)
"""A tenant that trains every correction at once and publishes every candidate: the runs measure
the cluster, not the gate."""
PAUSED = LearningPolicy(paused=True)
"""The ingest tenants: their buffers fill, no learner trains them (it would take the cores)."""


@dataclass(frozen=True)
class ScaleBenchConfig:
    """Every knob of one run (also written to the JSON)."""

    model: str = "tiny"
    """`tiny` (generated: 2 layers, hidden 256, so that vLLM's CPU attention takes its head size) or a local
    HF model folder."""
    events: int = 10000
    """Feedback events per ingest run."""
    batch: int = 50
    """Records per webhook request (`POST /v1/feedback/batch`)."""
    clients: int = 4
    """Concurrent feedback senders in total, spread over the webhooks."""
    requests: int = 128
    """Chat completions per serving run."""
    concurrency: int = 8
    """Concurrent completion clients in total, spread over the gateways."""
    max_tokens: int = 32
    lease_ttl_s: float = 6.0
    partitions: int = 4
    out: str = "bench-results/scale.json"
    keep: bool = False
    """Keep the cluster's folders (every process's log) instead of deleting them."""

    def __post_init__(self) -> None:
        if min(self.events, self.batch, self.clients, self.requests, self.concurrency, self.max_tokens) < 1:
            raise ValueError("--events, --batch, --clients, --requests, --concurrency and --max-tokens must be >= 1")
        if self.clients < 2 or self.concurrency < 2:
            raise ValueError("--clients and --concurrency must be >= 2: the 2-instance runs give each instance one")
        if self.partitions < 2:
            raise ValueError("--partitions must be >= 2: two ingest workers need a partition each")
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl must be >= 1 s (got {self.lease_ttl_s})")


# --- the learner's failover, timed (also the cluster test's) ----------------------------------


@dataclass(frozen=True)
class Failover:
    """kill -9 of the learner holding a tenant's lease, timed from the kill. Example: TTL 6 s, an
    idle tick 0.2 s: `takeover_s` 5.9 (<= the bound 6.2 s), `next_version_s` 9.4 (the takeover,
    then the checkpoint read, one step, the gate and the publish)."""

    tenant: str
    killed: str
    """The learner killed (its instance id)."""
    survivor: str
    """The learner that holds the tenant's lease afterwards."""
    version_before: int
    version_after: int
    takeover_s: float
    """Kill -> another learner holds the tenant's lease."""
    next_version_s: float
    """Kill -> the tenant's next version is in the registry."""
    lease_ttl_s: float
    tick_s: float
    """One idle tick of the survivor (`CLORA_LEARNER_IDLE_SLEEP_S`)."""

    @property
    def bound_s(self) -> float:
        """What docs/deploy.md promises: the lease TTL + one tick of the survivor."""
        return self.lease_ttl_s + self.tick_s


def newest_version(registry, tenant: str) -> int:
    """The tenant's newest recorded version number (0: none yet)."""
    versions = registry.adapter_versions(tenant)
    return versions[-1].version if versions else 0


def fail_over_learner(cluster: Cluster, tenant: str, feed: Callable[[], None], timeout_s: float = 180.0,
                      poll_s: float = 0.02) -> Failover:
    """Kill -9 the learner holding `tenant`'s lease, then `feed()` the tenant new examples (which
    only a survivor can train), and time the takeover and the next version (`Failover`)."""
    import redis

    from clora.learner.leases import RedisLeases

    client = redis.Redis.from_url(cluster.redis_url)
    registry = cluster.registry()
    watch = RedisLeases(client, "bench-observer", cluster.c.lease_ttl_s)   # reads the leases, takes none
    holder = watch.holder(tenant)
    if holder is None:
        raise RuntimeError(f"no learner holds {tenant}'s lease")
    victim = next(p for p in cluster.learners if p.name == holder.holder)
    before = newest_version(registry, tenant)
    killed_at = time.monotonic()
    victim.kill()
    feed()
    takeover = survivor = next_version = None
    deadline = killed_at + timeout_s
    while next_version is None or takeover is None:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{tenant} after kill -9 of {victim.name}: takeover after {takeover} s, next version "
                               f"after {next_version} s, still waiting after {timeout_s:.0f} s")
        if takeover is None and (h := watch.holder(tenant)) is not None and h.holder != victim.name:
            takeover, survivor = now - killed_at, h.holder
        if next_version is None and newest_version(registry, tenant) > before:
            next_version = now - killed_at
        time.sleep(poll_s)
    client.close()
    return Failover(tenant, victim.name, survivor, before, newest_version(registry, tenant), round(takeover, 3),
                    round(next_version, 3), cluster.c.lease_ttl_s, cluster.c.learner_idle_sleep_s)


# --- load generators --------------------------------------------------------------------------


def log_interactions(bootstrap: str, tenant: str, ids: list[str]) -> None:
    """Interactions `ids` of `tenant`, straight to Kafka as a gateway logs them (acks=all)."""
    from clora.ingest.producer import EventProducer
    from clora.ingest.schemas import TOPIC_INTERACTIONS, InteractionEvent

    producer = EventProducer(bootstrap, timeout_s=30)
    for iid in ids:
        ev = InteractionEvent(tenant=tenant, interaction_id=iid,
                              messages=[{"role": "user", "content": f"Order {iid}?"}],
                              response={"role": "assistant", "content": "Let me check."})
        producer.send(TOPIC_INTERACTIONS, tenant, ev.model_dump_json())
    producer.flush(120)
    producer.close()


@dataclass
class Senders:
    """`clients` threads POSTing batches of feedback, thread k to `webhooks[k % len]`, until the
    shared queue is empty. Each batch is (api key, records). `accepted`: event ids that got 202."""

    webhooks: list[str]
    batches: list[tuple[str, list[dict]]]
    clients: int
    accepted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last_202: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        threads = [threading.Thread(target=self._send, args=(self.webhooks[k % len(self.webhooks)],), daemon=True)
                   for k in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _next(self) -> tuple[str, list[dict]] | None:
        with self._lock:
            return self.batches.pop(0) if self.batches else None

    def _send(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while (item := self._next()) is not None:
                key, records = item
                try:
                    r = http.post("/v1/feedback/batch", json={"records": records},
                                  headers={"Authorization": f"Bearer {key}"})
                except httpx.HTTPError as e:
                    self.errors.append(repr(e)[:200])
                    continue
                if r.status_code != 202:
                    self.errors.append(f"{r.status_code}: {r.text[:200]}")
                    continue
                with self._lock:
                    self.accepted += [rec["event_id"] for rec in records]
                    self.last_202 = time.monotonic()


@dataclass
class Completions:
    """`concurrency` threads each sending chat completions, thread k to `gateways[k % len]`, until
    `requests` are done. Latencies of the 200s; errors as text."""

    gateways: list[str]
    key: str
    model: str
    requests: int
    concurrency: int
    max_tokens: int
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    _left: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> float:
        """Send them all; returns the wall time (s)."""
        self._left = self.requests
        threads = [threading.Thread(target=self._send, args=(self.gateways[k % len(self.gateways)],), daemon=True)
                   for k in range(self.concurrency)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - started

    def _take(self) -> bool:
        with self._lock:
            self._left -= 1
            return self._left >= 0

    def _send(self, url: str) -> None:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 1.0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Where is my order?"}]}
        with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {self.key}"}) as http:
            while self._take():
                t0 = time.monotonic()
                try:
                    r = http.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    self.errors.append(repr(e)[:200])
                    continue
                if r.status_code != 200:
                    self.errors.append(f"{r.status_code}: {r.text[:200]}")
                    continue
                with self._lock:
                    self.latencies.append(time.monotonic() - t0)
                    self.tokens += r.json()["usage"]["completion_tokens"]


# --- the bench --------------------------------------------------------------------------------


class ScaleBench:
    def __init__(self, config: ScaleBenchConfig, console: Console | None = None, root: Path | None = None):
        self.c = config
        self.console = console or (Console() if sys.stdout.isatty() else Console(width=200))
        self.root = root or Path(tempfile.mkdtemp(prefix="clora-bench-scale-"))
        self.cluster: Cluster | None = None
        self.keys: dict[str, str] = {}

    def run(self) -> dict:
        c = self.c
        self.console.print(f"[bold]clora bench scale[/]: ingest {c.events} events, serving {c.requests} completions "
                           f"of {c.max_tokens} tokens, 1 vs 2 instances; learner failover (lease TTL "
                           f"{c.lease_ttl_s:g} s); {len(os.sched_getaffinity(0))} cores; data under {self.root}")
        started = time.monotonic()
        try:
            model = self._model()
            self.cluster = Cluster(ClusterConfig(model=model, root=self.root / "cluster", webhooks=1, ingest_workers=1,
                                                 learners=2, gateways=0, replicas=2, partitions=c.partitions,
                                                 lease_ttl_s=c.lease_ttl_s))
            self._say("starting the cluster: broker, Redis, moto S3, 2 vLLM replicas, 1 webhook, 1 ingest worker, "
                      "2 learners")
            self.cluster.start()
            self._tenants()
            ingest = {"1": self._ingest_run(1)}
            self._say("adding webhook-1 and ingest-1")
            self.cluster.add("webhook")
            self.cluster.add("ingest")
            self._settle_group()
            ingest["2"] = self._ingest_run(2)
            failover = self._failover()
            serving = {"1": self._serving_run([0], gateways=1)}
            serving["2"] = self._serving_run([0, 1], gateways=2)
        except BaseException:
            self.console.print(f"[red]failed[/]: the cluster's logs are kept under {self.root}")
            if self.cluster is not None:
                self.cluster.stop()
            raise
        self.cluster.stop()
        report = self._report(ingest, serving, failover, time.monotonic() - started)
        self.console.print(table(report))
        out = Path(c.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        self.console.print(f"wrote {out}")
        if not c.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        return report

    def _say(self, what: str) -> None:
        self.console.print(f"  {what}", highlight=False)

    def _model(self) -> Path:
        if self.c.model != "tiny":
            return Path(self.c.model).resolve()
        from clora.learner.base_model import make_tiny_model

        return make_tiny_model(self.root / "tiny", seed=0, hidden_size=256)

    def _tenants(self) -> None:
        registry = self.cluster.registry()
        for t in tenants_over_partitions("ing", self.c.partitions):
            self.keys[t] = registry.create_tenant(t, policy=PAUSED)[1]
        self.keys[FAILOVER_TENANT] = registry.create_tenant(FAILOVER_TENANT, policy=SFT_POLICY)[1]

    # --- ingest ---------------------------------------------------------------------------

    def _ingest_tenants(self) -> list[str]:
        return [t for t in self.keys if t != FAILOVER_TENANT]

    def _stored(self) -> int:
        """Examples in every ingest tenant's buffers (held-out ones too)."""
        import redis

        from clora.ingest.buffers import ReplayBuffer

        buf = ReplayBuffer(redis.Redis.from_url(self.cluster.redis_url))
        return sum(buf.depth(t, "rl") + buf.depth(t, "rl", heldout=True) for t in self._ingest_tenants())

    def _interactions(self, run: int) -> dict[str, list[str]]:
        """Log each ingest tenant's share of the run's interactions and wait until all are stored."""
        import redis

        from clora.ingest.buffers import ReplayBuffer

        tenants = self._ingest_tenants()
        ids = {t: [f"ix-{run}-{t}-{i}" for i in range(j, self.c.events, len(tenants))] for j, t in enumerate(tenants)}
        for t, its in ids.items():
            log_interactions(self.cluster.kafka_bootstrap, t, its)
        buf = ReplayBuffer(redis.Redis.from_url(self.cluster.redis_url))
        deadline = time.monotonic() + 300
        while not all(buf.interactions(t, its[-1:])[0] is not None for t, its in ids.items() if its):
            if time.monotonic() > deadline:
                raise TimeoutError("the ingest runs' interactions were not stored within 300 s")
            time.sleep(0.1)
        return ids

    def _ingest_run(self, instances: int) -> dict:
        c = self.c
        ids = self._interactions(instances)
        batches = []
        for t, its in ids.items():
            for i in range(0, len(its), c.batch):
                records = [{"interaction_id": iid, "event_id": f"fb-{iid}", "score": 1.0, "source": "user"}
                           for iid in its[i:i + c.batch]]
                batches.append((self.keys[t], records))
        batches.sort(key=lambda b: b[1][0]["interaction_id"].rsplit("-", 1)[-1].zfill(9))   # tenants interleaved
        webhooks = [w.url for w in self.cluster.webhooks if w.alive()][:instances]
        base = self._stored()
        self._say(f"ingest, {instances} webhook(s) + {instances} worker(s): {c.events} events in {len(batches)} "
                  f"batches from {c.clients} senders")
        senders = Senders(webhooks, batches, c.clients)
        started = time.monotonic()
        sending = threading.Thread(target=senders.run, daemon=True)
        sending.start()
        deadline = started + 600
        while (stored := self._stored() - base) < c.events and time.monotonic() < deadline:
            if not sending.is_alive() and stored >= len(senders.accepted):
                break                                   # some were refused: nothing more will come
            time.sleep(0.01)
        done = time.monotonic()
        sending.join(60)
        elapsed, accept = done - started, (senders.last_202 or done) - started
        return {"instances": instances, "webhooks": webhooks, "events": c.events, "accepted": len(senders.accepted),
                "stored": stored, "errors": len(senders.errors), "error_samples": senders.errors[:3],
                "seconds": round(elapsed, 3), "events_per_s": round(stored / elapsed, 1),
                "accept_seconds": round(accept, 3), "accepted_per_s": round(len(senders.accepted) / accept, 1)}

    def _settle_group(self) -> None:
        """After a second worker joined: the group's rebalance (a join waits up to the poll
        interval) is over once an event of every ingest tenant is stored again."""
        import redis

        from clora.ingest.buffers import ReplayBuffer

        time.sleep(8.0)                      # the join: a member's session and the poll interval (6 s, 5 s)
        probe = {t: [f"probe-{t}"] for t in self._ingest_tenants()}
        for t, its in probe.items():
            log_interactions(self.cluster.kafka_bootstrap, t, its)
        buf = ReplayBuffer(redis.Redis.from_url(self.cluster.redis_url))
        deadline = time.monotonic() + 120
        while not all(buf.interactions(t, its)[0] is not None for t, its in probe.items()):
            if time.monotonic() > deadline:
                raise TimeoutError("the ingest group did not settle after a worker joined")
            time.sleep(0.1)

    # --- learner failover -------------------------------------------------------------------

    def _failover(self) -> Failover:
        registry = self.cluster.registry()
        webhook = self.cluster.webhooks[0].url
        sent = [0]

        def corrections(n: int) -> None:
            ids = [f"fo-{sent[0] + i}" for i in range(n)]
            sent[0] += n
            log_interactions(self.cluster.kafka_bootstrap, FAILOVER_TENANT, ids)
            records = [{"interaction_id": iid, "event_id": f"fb-{iid}", "source": "operator",
                        "correction": {"role": "assistant", "content": "Your order ships today."}} for iid in ids]
            r = httpx.post(webhook + "/v1/feedback/batch", json={"records": records}, timeout=60,
                           headers={"Authorization": f"Bearer {self.keys[FAILOVER_TENANT]}"})
            if r.status_code != 202:
                raise RuntimeError(f"corrections for {FAILOVER_TENANT} refused: {r.status_code} {r.text[:300]}")

        self._say(f"learner failover: training {FAILOVER_TENANT} to its first version")
        deadline = time.monotonic() + 300
        corrections(4)
        while newest_version(registry, FAILOVER_TENANT) < 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{FAILOVER_TENANT} had no version within 300 s")
            time.sleep(0.2)
        time.sleep(self.c.lease_ttl_s)       # the learners idle, every lease renewed: the kill lands on a quiet cluster
        self._say("learner failover: kill -9 of the lease holder")
        return fail_over_learner(self.cluster, FAILOVER_TENANT, lambda: corrections(2))

    # --- serving ----------------------------------------------------------------------------

    def _serving_run(self, replicas: list[int], gateways: int) -> dict:
        c = self.c
        for g in self.cluster.gateways:
            g.stop()
        added: list[ClusterProcess] = [self.cluster.add_gateway(replicas) for _ in range(gateways)]
        urls = [g.url for g in added]
        self._say(f"serving, {gateways} gateway(s) on {len(replicas)} replica(s): {c.requests} completions from "
                  f"{c.concurrency} clients")
        key = self.keys[FAILOVER_TENANT]
        warm = Completions(urls, key, FAILOVER_TENANT, 2 * len(urls) * len(replicas), len(urls) * len(replicas), 2)
        warm.run()                              # each gateway loads and verifies the adapter on its replicas
        if warm.errors:
            raise RuntimeError(f"the warm-up completions failed: {warm.errors[:3]}")
        load = Completions(urls, key, FAILOVER_TENANT, c.requests, c.concurrency, c.max_tokens)
        wall = load.run()
        lat = load.latencies
        return {"instances": gateways, "gateways": gateways, "replicas": len(replicas), "requests": c.requests,
                "completed": len(lat), "errors": len(load.errors), "error_samples": load.errors[:3],
                "seconds": round(wall, 3), "completions_per_s": round(len(lat) / wall, 2),
                "tokens_per_s": round(load.tokens / wall, 1), "tokens": load.tokens,
                "p50_s": round(percentile(lat, 50), 3) if lat else None,
                "p99_s": round(percentile(lat, 99), 3) if lat else None}

    # --- the report -------------------------------------------------------------------------

    def _report(self, ingest: dict, serving: dict, failover: Failover, wall_s: float) -> dict:
        def ratio(part: dict, key: str) -> float | None:
            one, two = part["1"][key], part["2"][key]
            return round(two / one, 2) if one else None

        return {"config": asdict(self.c),
                "machine": {"cores": len(os.sched_getaffinity(0)), "python": platform_info.python_version(),
                            "platform": platform_info.platform()},
                "ingest": {**ingest, "ratio_events_per_s": ratio(ingest, "events_per_s"),
                           "ratio_accepted_per_s": ratio(ingest, "accepted_per_s")},
                "serving": {**serving, "ratio_completions_per_s": ratio(serving, "completions_per_s"),
                            "ratio_tokens_per_s": ratio(serving, "tokens_per_s")},
                "failover": {**asdict(failover), "bound_s": failover.bound_s,
                             "within_bound": failover.takeover_s <= failover.bound_s},
                "wall_s": round(wall_s, 1),
                "note": (f"{len(os.sched_getaffinity(0))} cores shared by every instance: 2 instances show that "
                         "scale-out is correct (each carries its share) more than a speed-up; across machines each "
                         "brings its own cores. Failover is timed from the kill -9 of the learner holding the "
                         "tenant's lease; the bound is the lease TTL + one idle tick of the survivor."),
                "time": time.time()}


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def table(report: dict) -> Table:
    c, ing, srv, fo = report["config"], report["ingest"], report["serving"], report["failover"]
    t = Table(title=f"clora bench scale ({report['machine']['cores']} cores, {c['model']} model)")
    t.caption = report["note"]
    for col in ("measure", "1 instance", "2 instances", "2 / 1"):
        t.add_column(col, justify="right" if col != "measure" else "left")

    def row(name: str, part: dict, key: str, digits: int = 1) -> None:
        one, two = part["1"][key], part["2"][key]
        t.add_row(name, _fmt(one, digits), _fmt(two, digits),
                  "—" if not one or two is None else f"{two / one:.2f}x")

    row(f"ingest: webhook -> buffer, events/s ({c['events']} events, batches of {c['batch']})", ing, "events_per_s")
    row("ingest: webhook accepted, events/s (-> last 202)", ing, "accepted_per_s")
    row(f"serving: completions/s ({c['requests']} x {c['max_tokens']} tokens, {c['concurrency']} clients)",
        srv, "completions_per_s", 2)
    row("serving: tokens/s", srv, "tokens_per_s")
    row("serving: p50 latency, s", srv, "p50_s", 3)
    row("serving: p99 latency, s", srv, "p99_s", 3)
    errors = [ing["1"]["errors"], ing["2"]["errors"], srv["1"]["errors"], srv["2"]["errors"]]
    t.add_row("errors (ingest 1 / 2, serving 1 / 2)", f"{errors[0]} / {errors[2]}", f"{errors[1]} / {errors[3]}", "")
    within = "[green]within[/]" if fo["within_bound"] else "[red]over[/]"
    t.add_row(f"learner failover: kill -9 -> lease taken over, s (bound TTL {fo['lease_ttl_s']:g} + tick "
              f"{fo['tick_s']:g} = {fo['bound_s']:g} s: {within})", "", _fmt(fo["takeover_s"], 2), "")
    t.add_row(f"learner failover: kill -9 -> next version (v{fo['version_before']} -> v{fo['version_after']}), s",
              "", _fmt(fo["next_version_s"], 2), "")
    return t


def main(config: ScaleBenchConfig) -> dict:
    return ScaleBench(config).run()
