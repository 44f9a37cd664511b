"""`clora bench freshness`: how long feedback takes to reach serving, under a steady stream.

    clora bench freshness [--tenants 3] [--minutes 5] [--requests-per-s 0.5] [--feedback-per-s 0.1]
                          [--batch-size 8] [--model smollm2|<HF dir>]
    python benchmarks/bench_freshness.py ...      # the same command

It starts a fresh platform (every `clora up` service, through `PlatformLauncher`, with the
learner and the engine on a core each), creates `tenants` tenants learning from corrections
(`sft`, new corrections first), and for `minutes` drives each at a steady rate: chat
completions through the gateway (`requests_per_s` per tenant, `model` = the tenant: whatever
version is live), and on `feedback_per_s` of them per second an operator correction through
the webhook (each tenant has its own reply style to learn). Then the feedback stops and the
completions go on (the drain, at most `drain_s`) until every trainable event (not held out) is
in a version that has served, or the drain ends.

Each event's freshness is read from the registry: the lineage of the version first trained on
it (the event's 202 time) and that version's first served completion (`clora.freshness`):

    freshness = learning + serving
    learning  = the version's creation - the event's 202   (wait for the learner, the step,
                                                             the gate, the publish)
    serving   = the version's first completion - its creation (the hot swap, then the next
                                                               request: the baseline below)

The baseline, measured in the same run, is publish -> served per version: what freshness
would be if learning took no time. The table shows per tenant (and over all of them) the events
sent and measured, freshness p50 / p99, its learning share's p50, publish -> served p50 / p99,
and what bounds the learning share: the learner's mean step and gate + publish seconds and the
gate's rejections. Target: p50 <= 60 s. Writes JSON (`--out`, default
bench-results/freshness.json) with every event.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from clora.freshness import percentile
from clora.infra.bench_platform import PlatformLauncher, Stack

TARGET_P50_S = 60.0
NAMES = ("Ada", "Bo", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")


@dataclass(frozen=True)
class FreshnessBenchConfig:
    """Every knob of one run (also written to the JSON)."""

    tenants: int = 3
    minutes: float = 5.0
    """How long the feedback stream runs (the drain comes after)."""
    requests_per_s: float = 0.5
    """Chat completions per second per tenant (the requests that find each new version first)."""
    feedback_per_s: float = 0.1
    """Corrections per second per tenant, each on one of those completions (at most one each). The
    default is within what one learner core trains for 3 tenants on 2 busy cores (a step of 8 and
    its publish every ~15 s per tenant): past that the backlog, and freshness, grow all run long."""
    batch_size: int = 8
    learning_rate: float = 2e-3
    max_tokens: int = 16
    drain_s: float = 120.0
    """Longest the completions go on after the feedback stopped, for the last events to be served."""
    model: str = "smollm2"
    models_dir: str = ".clora/models"
    out: str = "bench-results/freshness.json"
    keep: bool = False
    """Keep the platform's data folder (logs, adapters) instead of deleting it."""

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.minutes <= 0 or self.requests_per_s <= 0 or self.drain_s < 0:
            raise ValueError(f"--tenants >= 1, --minutes > 0, --requests-per-s > 0 and --drain-s >= 0 "
                             f"(got {self.tenants}, {self.minutes}, {self.requests_per_s}, {self.drain_s})")
        if not 0 < self.feedback_per_s <= self.requests_per_s:
            raise ValueError(f"--feedback-per-s must be in (0, --requests-per-s = {self.requests_per_s}]: each "
                             f"correction is on one completion (got {self.feedback_per_s})")


@dataclass(frozen=True)
class EventFreshness:
    """One feedback event's way to serving. Example: its 202 at 100.0, first trained in v3,
    which was created at 150.0 and first served at 160.0: freshness 60 s = learning 50 s +
    serving 10 s."""

    tenant: str
    event_id: str
    version: int
    accepted_at: float
    created_at: float
    first_served_at: float

    @property
    def freshness_s(self) -> float:
        return max(0.0, self.first_served_at - self.accepted_at)

    @property
    def learning_s(self) -> float:
        return max(0.0, self.created_at - self.accepted_at)

    @property
    def serving_s(self) -> float:
        return max(0.0, self.first_served_at - self.created_at)


@dataclass(frozen=True)
class VersionServed:
    """One version that served: its publish -> served seconds (the baseline) and events."""

    tenant: str
    version: int
    published_to_served_s: float
    events: int


def read_freshness(registry, tenant: str) -> tuple[list[EventFreshness], list[VersionServed]]:
    """Every measured lineage event of `tenant`'s served versions, and those versions."""
    events, versions = [], []
    for v in registry.adapter_versions(tenant):
        served = registry.first_served_at(tenant, v.version)
        if served is None:
            continue
        lineage = registry.lineage(tenant, v.version)
        measured = [EventFreshness(tenant, event_id, v.version, at, v.created_at, served)
                    for event_id, at in lineage.accepted_at.items() if at is not None]
        events += measured
        versions.append(VersionServed(tenant, v.version, max(0.0, served - v.created_at), len(measured)))
    return events, versions


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def summarize(events: list[EventFreshness], versions: list[VersionServed], sent: int) -> dict:
    """One table row: events sent and measured, freshness p50/p99 and its learning share, the
    publish -> served baseline over the versions (with events) that served."""
    fresh = [e.freshness_s for e in events]
    baseline = [v.published_to_served_s for v in versions if v.events]
    return {"sent": sent, "measured": len(events), "versions": len(baseline),
            "p50_s": _p(fresh, 50), "p99_s": _p(fresh, 99), "mean_s": statistics.fmean(fresh) if fresh else None,
            "learning_p50_s": _p([e.learning_s for e in events], 50),
            "serving_share": sum(e.serving_s for e in events) / sum(fresh) if sum(fresh) else None,
            "published_to_served_p50_s": _p(baseline, 50), "published_to_served_p99_s": _p(baseline, 99)}


def learner_profile(points: list[dict]) -> dict:
    """From a tenant's metrics history (the learner's points): steps, their mean seconds, the
    mean gate + publish seconds (a publish point's time minus its step point's), publishes."""
    steps = {p["step"]: p for p in points if p.get("loss") is not None and p.get("seconds") is not None}
    published = [p for p in points if p.get("version") is not None]
    gates = [p["time"] - steps[p["step"]]["time"] for p in published if p.get("step") in steps]
    return {"steps": len(steps), "publishes": len(published),
            "step_s": statistics.fmean(p["seconds"] for p in steps.values()) if steps else None,
            "gate_publish_s": statistics.fmean(gates) if gates else None}


# --- driving the platform ---------------------------------------------------------------------


@dataclass
class TenantStream:
    """One tenant's steady stream: completions at `requests_per_s`, a correction on
    `feedback_per_s / requests_per_s` of them, until `stop`; no corrections after `quiet`."""

    tenant: str
    key: str
    stack: Stack
    config: FreshnessBenchConfig
    stop: threading.Event
    quiet: threading.Event
    sent: list[str] = field(default_factory=list)
    """Event ids of the corrections the webhook accepted (202), in order."""
    completions: int = 0
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        from openai import OpenAI

        from clora.agents.feedback import FeedbackClient

        c = self.config
        period, share = 1.0 / c.requests_per_s, c.feedback_per_s / c.requests_per_s
        sign_off = f"— {self.tenant.capitalize()} Support"
        with OpenAI(base_url=self.stack.gateway + "/v1", api_key=self.key, max_retries=2, timeout=120) as client, \
                FeedbackClient(self.stack.webhook, self.key) as feedback:
            next_at, i = time.monotonic(), 0
            while not self.stop.wait(max(0.0, next_at - time.monotonic())):
                next_at = max(next_at + period, time.monotonic())  # steady; a slow answer skips, never bursts
                name, order = NAMES[i % len(NAMES)], 1000 + i
                try:
                    r = client.chat.completions.create(
                        model=self.tenant, max_tokens=c.max_tokens, temperature=0.7,
                        messages=[{"role": "user", "content": f"I'm {name}. Where is my order #{order}?"}])
                    self.completions += 1
                    if int((i + 1) * share) > int(i * share) and not self.quiet.is_set():
                        self.sent.append(feedback.send({"interaction_id": r.id, "source": "operator", "correction": {
                            "role": "assistant", "content": f"Hi {name}! Order #{order} is on its way. {sign_off}"}}))
                except Exception as e:  # noqa: BLE001 - counted and reported; the stream goes on
                    self.errors.append(repr(e)[:300])
                i += 1


class FreshnessBench:
    def __init__(self, config: FreshnessBenchConfig, console: Console | None = None, root: Path | None = None):
        self.c = config
        self.console = console or (Console() if sys.stdout.isatty() else Console(width=200))
        self.root = root or Path(tempfile.mkdtemp(prefix="clora-bench-freshness-"))
        self.launcher = PlatformLauncher(model=config.model, models_dir=config.models_dir, slots=config.tenants,
                                         training_mode="serial", root=self.root)

    def run(self) -> dict:
        import redis

        from clora.registry import Registry

        c = self.c
        self.console.print(f"[bold]clora bench freshness[/]: {c.tenants} tenants, {c.minutes:g} min of "
                           f"{c.requests_per_s:g} completions/s and {c.feedback_per_s:g} corrections/s each, model "
                           f"{c.model}; data under {self.root}")
        with self.launcher.data_kept_on_failure(c.keep, self.console):
            self.launcher.prepare_model()
            platform, stack = self.launcher.start("freshness", concurrent=True)
            try:
                admin = httpx.Client(base_url=stack.console, timeout=60,
                                     headers={"Authorization": f"Bearer {stack.admin_token}"})
                tenants = [f"fresh{i}" for i in range(c.tenants)]
                keys = {t: self._create_tenant(admin, t) for t in tenants}
                registry = Registry(redis.Redis.from_url(stack.redis_url))
                streams = self._drive(stack, keys, registry)
                report = self._report(registry, admin, streams)
            finally:
                platform.stop()
        self.console.print(table(report))
        self._verdict(report)
        out = Path(c.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        self.console.print(f"wrote {out}")
        return report

    def _create_tenant(self, admin: httpx.Client, tenant: str) -> str:
        c = self.c
        policy = {"algorithm": "sft", "learning_rate": c.learning_rate, "batch_size": c.batch_size,
                  "min_new_examples": 1, "fresh_fraction": 1.0, "reward_guard": False}
        r = admin.post("/api/tenants", json={"id": tenant, "name": "freshness bench", "policy": policy})
        if r.status_code != 201:
            raise RuntimeError(f"creating tenant {tenant} failed: {r.status_code} {r.text}")
        return r.json()["api_key"]

    def _drive(self, stack: Stack, keys: dict[str, str], registry) -> list[TenantStream]:
        """Run every tenant's stream for `minutes`, then drain: completions only, until every
        trainable event is in a served version or `drain_s` passed."""
        stop, quiet = threading.Event(), threading.Event()
        streams = [TenantStream(t, k, stack, self.c, stop, quiet) for t, k in keys.items()]
        threads = [threading.Thread(target=s.run, name=f"stream-{s.tenant}", daemon=True) for s in streams]
        for t in threads:
            t.start()
        started = time.monotonic()
        try:
            while time.monotonic() - started < self.c.minutes * 60:
                time.sleep(min(30.0, self.c.minutes * 60 - (time.monotonic() - started)))
                self._progress(streams, registry, started)
            quiet.set()
            drain_until, waiting = time.monotonic() + self.c.drain_s, 0
            while True:
                waiting = sum(len(_unserved(s.sent, {e.event_id for e in read_freshness(registry, s.tenant)[0]}))
                              for s in streams)
                if not waiting or time.monotonic() >= drain_until:
                    break
                time.sleep(2.0)
            self.console.print(f"[{time.monotonic() - started:4.0f} s] stream stopped"
                               + (f"; {waiting} trainable events not served by the end of the drain" if waiting else ""))
        finally:
            stop.set()
            for t in threads:
                t.join(180)
        return streams

    def _progress(self, streams: list[TenantStream], registry, started: float) -> None:
        for s in streams:
            events, versions = read_freshness(registry, s.tenant)
            row = summarize(events, versions, len(s.sent))
            self.console.print(f"[{time.monotonic() - started:4.0f} s] {s.tenant}: {s.completions} completions, "
                               f"{len(s.sent)} corrections, {row['measured']} served in {row['versions']} versions, "
                               f"p50 {_fmt(row['p50_s'])} s", highlight=False)

    def _report(self, registry, admin: httpx.Client, streams: list[TenantStream]) -> dict:
        rows, every_event, every_version = [], [], []
        for s in streams:
            events, versions = read_freshness(registry, s.tenant)
            points = admin.get(f"/api/tenants/{s.tenant}/metrics", params={"n": 2000}).json()["points"]
            rows.append({"tenant": s.tenant, **summarize(events, versions, len(s.sent)),
                         "unserved": _unserved(s.sent, {e.event_id for e in events}),
                         "completions": s.completions, "errors": len(s.errors), "error_samples": s.errors[:3],
                         "learner": learner_profile(points), "gate_rejections": _rejections(s.stack, s.tenant),
                         "registry_p50_s": registry.freshness_p50(s.tenant)})
            every_event += events
            every_version += versions
        total = summarize(every_event, every_version, sum(len(s.sent) for s in streams))
        return {"config": asdict(self.c), "rows": rows, "all": total,
                "target": {"p50_at_most_s": TARGET_P50_S,
                           "met": total["p50_s"] is not None and total["p50_s"] <= TARGET_P50_S},
                "note": ("freshness: a feedback event's 202 -> the first completion served by the version first "
                         "trained on it = learning (-> the version's creation) + serving (-> its first completion). "
                         "Baseline, same run: publish -> served per version (freshness if learning took no time)."),
                "versions": [asdict(v) for v in every_version],
                "events": [asdict(e) | {"freshness_s": e.freshness_s, "learning_s": e.learning_s,
                                        "serving_s": e.serving_s} for e in every_event],
                "time": time.time()}

    def _verdict(self, report: dict) -> None:
        total = report["all"]
        self.console.print(report["note"])
        met = "[green]met[/]" if report["target"]["met"] else "[red]not met[/]"
        self.console.print(f"all tenants: p50 {_fmt(total['p50_s'])} s (target <= {TARGET_P50_S:g} s: {met}), "
                           f"p99 {_fmt(total['p99_s'])} s; learning share p50 {_fmt(total['learning_p50_s'])} s, "
                           f"publish -> served p50 {_fmt(total['published_to_served_p50_s'])} s (baseline)")


def _unserved(sent: list[str], served: set[str]) -> list[str]:
    """The trainable events (not held out) of `sent` that no served version was first trained on:
    not trained yet, or in a candidate the gate refused with nothing new to train on since."""
    from clora.ingest.buffers import BufferPolicy, is_heldout

    fraction = BufferPolicy().holdout_fraction
    return [e for e in sent if e not in served and not is_heldout(f"{e}:sft", fraction)]


def _rejections(stack: Stack, tenant: str) -> float:
    """The publish gate's rejections of `tenant`'s candidates (the learner's Prometheus counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(stack.learner_metrics, timeout=30).text):
        if fam.name == "clora_learner_publishes":
            return sum(s.value for s in fam.samples if s.name.endswith("_total") and s.labels.get("tenant") == tenant
                       and s.labels.get("outcome") == "rejected")
    return 0.0


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def table(report: dict) -> Table:
    c = report["config"]
    t = Table(title=f"feedback -> served: {c['tenants']} tenants, {c['minutes']:g} min, {c['requests_per_s']:g} "
                    f"completions/s + {c['feedback_per_s']:g} corrections/s each (sft, batch {c['batch_size']})")
    t.caption = ("freshness = learning (202 -> version created) + serving (-> its first completion); baseline "
                 "publish -> served is the serving part alone, per version, measured in the same run; unserved: "
                 "trainable corrections (not held out) that no served version was first trained on by the end")
    for col in ("tenant", "corrections sent", "measured (unserved)", "p50 s", "p99 s", "learning p50 s", "serving share",
                "publish -> served p50 / p99 s (versions)", "learner step s", "gate + publish s", "steps / versions",
                "gate rejections"):
        t.add_column(col, justify="right")

    def add(name: str, row: dict, learner: dict | None, rejected: float | None) -> None:
        share = "—" if row["serving_share"] is None else f"{row['serving_share']:.0%}"
        unserved = len(row["unserved"]) if "unserved" in row else sum(len(r["unserved"]) for r in report["rows"])
        t.add_row(name, str(row["sent"]), f"{row['measured']} ({unserved})", _fmt(row["p50_s"]), _fmt(row["p99_s"]),
                  _fmt(row["learning_p50_s"]), share,
                  f"{_fmt(row['published_to_served_p50_s'])} / {_fmt(row['published_to_served_p99_s'])} "
                  f"({row['versions']})",
                  _fmt(learner and learner["step_s"]), _fmt(learner and learner["gate_publish_s"]),
                  f"{learner['steps']} / {learner['publishes']}" if learner else "—",
                  "—" if rejected is None else f"{rejected:.0f}")

    for r in report["rows"]:
        add(r["tenant"], r, r["learner"], r["gate_rejections"])
    add("all", report["all"], None, None)
    return t


def main(config: FreshnessBenchConfig) -> dict:
    return FreshnessBench(config).run()
