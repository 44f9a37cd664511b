"""Prometheus metrics of the gateway: requests by tenant and status, latency, time to the first
streamed token, tokens, interactions that could not be recorded, hot swaps, feedback -> served
freshness, quota checks made locally while Redis failed, the engine's replicas, their resident
adapters and the adapters each refused (`clora_engine_adapter_load_failures{replica,reason}`:
a failed load or canary; `clora_engine_adapters_out_of_rotation{replica}`), the interaction
logger's deliveries. `ServingService` serves them on `GatewaySettings.metrics_port` (on
`metrics_host`, the loopback unless configured: they name tenants), not on the public port.

`clora_feedback_to_served_seconds{tenant}` observes, for each feedback event first trained in
a version, the seconds from the webhook's 202 to the first completion that version served
(`clora.serving.freshness`). Its tenant label is bounded: the first `freshness_tenants`
tenants observed get their own label value, every later one shares `_other` (no tenant id can
start with `_`), so a platform with 10,000 tenants exports at most that many series.

Metrics live in an injected `CollectorRegistry` (a fresh one by default), so several gateways
can coexist in one test process.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from clora.serving.traffic import TrafficRollup

UNAUTHENTICATED = "-"
"""The tenant label of requests whose key was not checked or not valid."""

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
FRESHNESS_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200, 3600)
"""Seconds from a feedback event's 202 to serving a version trained on it (the target: p50 <= 60)."""
OTHER_TENANTS = "_other"
"""The tenant label of the tenants past a bounded metric's limit (`TenantLabels`)."""


class TenantLabels:
    """Tenant label values for a metric whose series must stay bounded: the first `limit`
    tenants seen keep their id, every later one is `OTHER_TENANTS`. Example: limit 2, tenants
    seen a, b, c, a -> "a", "b", "_other", "a". Thread-safe (observed from worker threads)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a tenant label limit must be >= 1, got {limit}")
        self.limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._named:
                return tenant
            if len(self._named) < self.limit:
                self._named.add(tenant)
                return tenant
            return OTHER_TENANTS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, rollup: TrafficRollup | None = None,
                 freshness_tenants: int = 100):
        """`freshness_tenants`: tenants the freshness histogram names (`TenantLabels`)."""
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.rollup = rollup
        """Also counts each tenant's requests and tokens per minute for the console."""
        self.requests = Counter("clora_gateway_requests", "Completion requests answered, by HTTP status (a stream "
                                "counts when it ends)", ["tenant", "kind", "status"], registry=r)
        self.seconds = Histogram("clora_gateway_request_seconds", "Time from a completion request to its last byte",
                                 ["kind", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("clora_gateway_first_token_seconds", "Time from a streamed request to its "
                                     "first chunk", buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("clora_gateway_in_flight", "Completions being generated", ["tenant"], registry=r)
        self.prompt_tokens = Counter("clora_gateway_prompt_tokens", "Prompt tokens of served completions",
                                     ["tenant"], registry=r)
        self.completion_tokens = Counter("clora_gateway_completion_tokens", "Tokens generated", ["tenant"],
                                         registry=r)
        self.unrecorded = Counter("clora_gateway_unrecorded_interactions", "Served completions whose interaction "
                                  "event could not be built (their feedback cannot join)", ["tenant"], registry=r)
        self.swaps = Counter("clora_gateway_swaps", "Alias switches to a tenant's new live version", ["tenant"],
                             registry=r)
        self.swap_seconds = Histogram("clora_gateway_swap_seconds", "From noticing a new live version to serving "
                                      "it (its preload into every replica)", buckets=LATENCY_BUCKETS, registry=r)
        self.freshness = Histogram("clora_feedback_to_served_seconds", "From a feedback event's 202 to the first "
                                   "completion served by the version first trained on it (tenant: the first "
                                   f"{freshness_tenants} tenants by name, the rest {OTHER_TENANTS!r})", ["tenant"],
                                   buckets=FRESHNESS_BUCKETS, registry=r)
        self.freshness_label = TenantLabels(freshness_tenants)
        self.quota_fallbacks = Counter("clora_gateway_quota_fallbacks", "Per-tenant limit checks this gateway made "
                                       "in its own memory because the shared quota store (Redis) failed, by limit",
                                       ["limit"], registry=r)

    def watch(self, engine, logger=None) -> None:
        """Report `engine`'s replicas (health, restarts, resident adapters, requests) and the
        interaction `logger`'s deliveries on each scrape."""
        self.registry.register(_EngineCollector(engine))
        if logger is not None:
            self.registry.register(_LoggerCollector(logger))

    def answered(self, tenant: str, kind: str, status: int, seconds: float, *, stream: bool = False) -> None:
        self.requests.labels(tenant, kind, str(status)).inc()
        self.seconds.labels(kind, "true" if stream else "false").observe(seconds)
        if self.rollup is not None and tenant != UNAUTHENTICATED:
            self.rollup.answered(tenant, status, seconds)

    def served(self, tenant: str, prompt_tokens: int, completion_tokens: int, recorded: bool) -> None:
        self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        self.completion_tokens.labels(tenant).inc(completion_tokens)
        if not recorded:
            self.unrecorded.labels(tenant).inc()
        if self.rollup is not None:
            self.rollup.served(tenant, prompt_tokens, completion_tokens)

    def swapped(self, tenant: str, seconds: float) -> None:
        self.swaps.labels(tenant).inc()
        self.swap_seconds.observe(seconds)

    def fresh(self, tenant: str, seconds: list[float]) -> None:
        """Observe the freshness of each of a version's lineage events (`clora.serving.freshness`)."""
        if not seconds:
            return
        histogram = self.freshness.labels(self.freshness_label(tenant))
        for s in seconds:
            histogram.observe(s)


class _EngineCollector:
    """Reads the replicas when scraped (from the metrics server's thread: plain reads only)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        families = [
            (GaugeMetricFamily("clora_engine_replica_healthy", "1 while a vLLM replica takes requests",
                               labels=["replica"]), lambda r: 1 if r.healthy else 0),
            (GaugeMetricFamily("clora_engine_replica_restarts", "Restarts of a vLLM replica", labels=["replica"]),
             lambda r: r.restarts),
            (GaugeMetricFamily("clora_engine_resident_adapters", "Adapters loaded in a vLLM replica",
                               labels=["replica"]), lambda r: len(r.resident)),
            (GaugeMetricFamily("clora_engine_replica_in_flight", "Requests a vLLM replica is serving",
                               labels=["replica"]), lambda r: r.in_flight),
            (GaugeMetricFamily("clora_engine_adapters_out_of_rotation", "Adapters a vLLM replica is out of rotation "
                               "for (its load or canary failed; retried later)", labels=["replica"]),
             lambda r: len(r.refused.blocked())),
        ]
        for family, value in families:
            for r in self.engine.replicas:
                family.add_metric([str(r.index)], value(r))
            yield family
        failures = CounterMetricFamily("clora_engine_adapter_load_failures", "Adapter loads a vLLM replica refused "
                                       "or whose canary failed (`clora.canary`), by reason",
                                       labels=["replica", "reason"])
        for r in self.engine.replicas:
            for reason, n in dict(r.load_failures).items():
                failures.add_metric([str(r.index), reason], n)
        yield failures


class _LoggerCollector:
    """The interaction logger's counts (plain reads of numbers another thread updates)."""

    def __init__(self, logger):
        self.logger = logger

    def collect(self):
        lg = self.logger
        for name, help_, value in (
                ("clora_gateway_interactions_sent", "Interaction events the broker acknowledged", lg.sent),
                ("clora_gateway_interactions_spooled", "Interaction events written to the disk spool while the "
                 "broker did not take them", lg.spooled),
                ("clora_gateway_interactions_rejected", "Interaction events the broker refused for good (set aside "
                 "in the spool folder's rejected.jsonl)", lg.rejected)):
            family = CounterMetricFamily(name, help_)
            family.add_metric([], value)
            yield family
        queued = GaugeMetricFamily("clora_gateway_interactions_queued", "Interaction events waiting in memory")
        queued.add_metric([], lg.queued())
        yield queued
        spool = GaugeMetricFamily("clora_gateway_interaction_spool_bytes", "Bytes in the disk spool not yet sent")
        spool.add_metric([], lg.spool.pending_bytes())
        yield spool
