"""A clora cluster on one machine (issue 20): 2 webhooks, 2 ingest workers, 2 learners, 2 gateways
and 2 vLLM replicas, each its own process with its own data folder, sharing only the broker, Redis
and the object store (the suite's moto server) (`clora.infra.cluster`; the gateways attach to the
replicas by URL, each with its own adapter cache, which every replica can read on one machine).

It shows that:
1. a tenant's corrections, sent through both webhooks, become a version that both replicas hold
   and serve, pinned as `tenant@vN`, through either gateway;
2. a tenant's rate limit is its total across both gateways: a burst at both at once gets exactly
   the limit through, not the limit per gateway;
3. after kill -9 of one webhook, one ingest worker, one gateway and one vLLM replica, and then of
   the learner training the tenant, with traffic going on throughout: every feedback event that
   got a 202 is in the replay buffers (counted by event id) and every trainable one is in a
   version, no version is torn (each verifies against its manifest in the store) or duplicated
   (numbers unique and ascending, each version the child of the one before, no event first
   trained in two), and the tenant's lease moves to the surviving learner within the lease TTL
   + a tick, which then publishes the next version.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import redis

from clora.ids import served_name
from clora.infra.cluster import Cluster, ClusterConfig, ClusterProcess, tenants_over_partitions
from clora.infra.scale_bench import PAUSED, SFT_POLICY, fail_over_learner, log_interactions, newest_version
from clora.ingest.buffers import BufferPolicy, ReplayBuffer, is_heldout
from clora.storage import open_storage

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL_S = 6.0
"""The learners' lease TTL: the failover bound is this + a tick."""
RATE_PER_S, BURST = 2.5, 10
"""Every tenant's gateway rate limit: 10 requests per 4 s window, shared by the gateways. A burst
admitted within one window is counted exactly (`limits`' sliding window weighs the previous window
in only once the next one starts)."""
LEARNS, QUOTA = "learns", "quota"
POLICY = SFT_POLICY.model_copy(update={"batch_size": 4})
"""Every correction trained (a step as soon as one is new), up to 4 a step, every candidate published."""


@pytest.fixture(scope="module")
def cluster(tiny_model, s3, tmp_path_factory):
    logging.getLogger("werkzeug").setLevel(logging.WARNING)      # moto's line per request
    config = ClusterConfig(model=tiny_model, root=tmp_path_factory.mktemp("cluster"), s3_endpoint=s3,
                           lease_ttl_s=TTL_S, learner_env={"CLORA_LEARNER_KEEP_VERSIONS": "0"},   # every version stays
                           gateway_env={"CLORA_GATEWAY_TENANT_RATE_PER_S": str(RATE_PER_S),
                                        "CLORA_GATEWAY_TENANT_BURST": str(BURST),
                                        "CLORA_GATEWAY_ENGINE_REPORT_S": "1",
                                        # 30 checks at once on a loaded 2-core box can wait past the
                                        # default 0.5 s for Redis, and each gateway then counts on its
                                        # own (the designed fallback, tested in serving/test_shared_quota)
                                        "CLORA_GATEWAY_QUOTA_STORE_TIMEOUT_S": "30"})
    with Cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def keys(cluster) -> dict[str, str]:
    """Tenants and their API keys: `learns` learns from corrections; `quota` and one `ing-*` per
    partition only take traffic (paused: no learner trains them)."""
    registry = cluster.registry()
    policies = {LEARNS: POLICY, QUOTA: PAUSED} | {t: PAUSED for t in tenants_over_partitions("ing", 4)}
    return {t: registry.create_tenant(t, policy=p)[1] for t, p in policies.items()}


RETRY = (502, 503, 504)


def post(procs: list[ClusterProcess], first: int, path: str, body: dict, key: str, ok: int,
         attempts: int = 40) -> tuple[httpx.Response, ClusterProcess]:
    """POST to `procs[first]`, and on a dead one (a refused connection, a 5xx) the same body to the
    next, as a client behind a load balancer sees it; 429s wait their Retry-After. Returns the
    answer `ok` and the process that gave it."""
    last = ""
    for attempt in range(attempts):
        proc = procs[(first + attempt) % len(procs)]
        try:
            r = httpx.post(proc.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        except httpx.TransportError as e:
            last = f"{proc.name}: {e!r}"
            time.sleep(0.1)
            continue
        if r.status_code == ok:
            return r, proc
        last = f"{proc.name}: {r.status_code} {r.text[:300]}"
        if r.status_code == 429:
            time.sleep(float(r.headers.get("retry-after", 1)))
        elif r.status_code not in RETRY:
            break
        else:
            time.sleep(0.2)
    raise AssertionError(f"POST {path} never answered {ok}; last: {last}")


@dataclass
class Corrections:
    """A tenant's traffic: a completion through the gateways in turn, then an operator correction
    of it through the webhooks in turn, each failing over to the other instance. A correction
    keeps its event id across retries, so the webhook that takes it last stores it once."""

    cluster: Cluster
    tenant: str
    key: str
    accepted: dict[str, str] = field(default_factory=dict)
    """Event id -> the webhook that answered 202."""
    served_by: dict[str, str] = field(default_factory=dict)
    """Interaction id -> the gateway that answered it."""
    accepted_at: dict[str, float] = field(default_factory=dict)
    """Event id -> when its 202 came (monotonic)."""
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    """Corrections no instance took (`run` goes on; the test fails on any)."""

    def one(self) -> str:
        i = self.sent
        self.sent += 1
        chat = {"model": self.tenant, "max_tokens": 8, "messages": [{"role": "user", "content": f"Order #{1000 + i}?"}]}
        r, gateway = post(self.cluster.gateways, i, "/v1/chat/completions", chat, self.key, 200)
        iid = r.json()["id"]
        self.served_by[iid] = gateway.name
        event = f"fb-{self.tenant}-{i}"
        fb = {"interaction_id": iid, "event_id": event, "source": "operator",
              "correction": {"role": "assistant", "content": f"Order #{1000 + i} ships today."}}
        _, webhook = post(self.cluster.webhooks, i, "/v1/feedback", fb, self.key, 202)
        self.accepted[event], self.accepted_at[event] = webhook.name, time.monotonic()
        return event

    def run(self, stop: threading.Event, period_s: float) -> None:
        while not stop.wait(period_s):
            try:
                self.one()
            except AssertionError as e:
                self.failures.append(str(e)[:500])


@dataclass
class Scores:
    """Scores on interactions logged straight to Kafka, for every `ing-*` tenant (one per
    partition, so every ingest worker has work), in small batches through the webhooks in turn."""

    cluster: Cluster
    keys: dict[str, str]
    accepted: dict[str, set[str]] = field(default_factory=dict)
    """Tenant -> event ids that got 202."""
    accepted_at: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def prepare(self, per_tenant: int) -> None:
        for t in self.keys:
            log_interactions(self.cluster.kafka_bootstrap, t, [f"ix-{t}-{i}" for i in range(per_tenant)])
            self.accepted[t] = set()

    def run(self, stop: threading.Event, per_tenant: int, batch: int = 5) -> None:
        for i in range(0, per_tenant, batch):
            for n, (t, key) in enumerate(self.keys.items()):
                if stop.is_set():
                    return
                records = [{"interaction_id": f"ix-{t}-{j}", "event_id": f"sc-{t}-{j}", "score": 1.0}
                           for j in range(i, min(i + batch, per_tenant))]
                try:
                    post(self.cluster.webhooks, i // batch + n, "/v1/feedback/batch", {"records": records}, key, 202)
                except AssertionError as e:
                    self.failures.append(str(e)[:500])
                    continue
                self.accepted[t] = self.accepted[t] | {r["event_id"] for r in records}    # a new set: readers copy none
                self.accepted_at = self.accepted_at | {r["event_id"]: time.monotonic() for r in records}
            time.sleep(0.2)


def stored_events(buffer: ReplayBuffer, tenant: str, kind: str) -> set[str]:
    """The feedback event ids of every `kind` example in `tenant`'s buffers, held-out ones too."""
    return {e.feedback_event_id for e in buffer.latest(tenant, kind, 100_000) + buffer.heldout(tenant, kind)}


def trained_events(registry, tenant: str) -> dict[int, set[str]]:
    """Version -> the feedback events first trained in it (its lineage)."""
    return {v.version: set(registry.lineage(tenant, v.version).accepted_at) for v in registry.adapter_versions(tenant)}


def trainable(events) -> set[str]:
    fraction = BufferPolicy().holdout_fraction
    return {e for e in events if not is_heldout(f"{e}:sft", fraction)}


def models(url: str, key: str) -> dict[str, dict]:
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def test_corrections_through_both_webhooks_become_a_version_both_replicas_serve_through_either_gateway(
        cluster, keys, wait_for):
    registry = cluster.registry()
    traffic = Corrections(cluster, LEARNS, keys[LEARNS])
    for _ in range(6):
        traffic.one()
    assert set(traffic.accepted.values()) == {"webhook-0", "webhook-1"}
    assert set(traffic.served_by.values()) == {"gateway-0", "gateway-1"}

    # the learners train them (one at a time holds the tenant) and publish
    want = trainable(traffic.accepted)
    wait_for(lambda: want <= set().union(*trained_events(registry, LEARNS).values()), timeout=180, interval=0.5,
             what=f"every trainable correction of {LEARNS} in a version")
    # the newest version is recorded a moment before it is made live: read it once it is
    wait_for(lambda: registry.live_version(LEARNS) == newest_version(registry, LEARNS), timeout=60,
             what=f"{LEARNS}'s newest version live")
    version = registry.live_version(LEARNS)
    name = served_name(LEARNS, version)

    for gateway in cluster.gateways:          # each swapped to it, and serves it pinned
        wait_for(lambda: models(gateway.url, keys[LEARNS])[LEARNS]["root"] == name, timeout=60,
                 what=f"{gateway.name} serving {name}")
        chat = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "Order #7?"}]}
        r = httpx.post(gateway.url + "/v1/chat/completions", json=chat, timeout=60,
                       headers={"Authorization": f"Bearer {keys[LEARNS]}"})
        assert r.status_code == 200 and r.json()["model"] == name, r.text

    # every replica holds it (vLLM's own list), and every gateway's report says so, verified, out of rotation nowhere
    for replica in cluster.replicas:
        assert name in models(replica.url, cluster.vllm_api_key), f"{replica.name} does not hold {name}"

    def reports_agree() -> bool:
        reports = list(registry.engine_reports().values())
        return len(reports) == 2 and all(
            len(rep["replicas"]) == 2 and all(r["healthy"] and name in r["resident"] and not r["refused"]
                                              for r in rep["replicas"]) for rep in reports)

    wait_for(reports_agree, timeout=30, what=f"both gateways reporting {name} resident on both replicas")


def test_a_tenants_rate_limit_is_its_total_across_both_gateways(cluster, keys):
    """30 requests at once, 15 at each gateway, on a fresh window: exactly `BURST` get through in
    total (a few more only if the checks outlast the window). Each gateway counting on its own
    would let `BURST` through each (20)."""
    chat = {"model": QUOTA, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    go = threading.Barrier(3 * BURST)

    def one(i: int) -> tuple[str, int, str]:
        gateway = cluster.gateways[i % 2]
        with httpx.Client(base_url=gateway.url, timeout=60, headers={"Authorization": f"Bearer {keys[QUOTA]}"}) as http:
            go.wait()
            r = http.post("/v1/chat/completions", json=chat)
        return gateway.name, r.status_code, r.text

    with ThreadPoolExecutor(3 * BURST) as pool:
        started = time.monotonic()
        answers = list(pool.map(one, range(3 * BURST)))
        spread = time.monotonic() - started
    ok = [g for g, status, _ in answers if status == 200]
    limited = [(g, text) for g, status, text in answers if status == 429]
    assert len(ok) + len(limited) == len(answers), [a for a in answers if a[1] not in (200, 429)]
    fell_back = [g.name for g in cluster.gateways if "the quota store (Redis) failed" in g.log_path.read_text()]
    # The window opens at the first check. Checks still arriving after it ends (a loaded machine
    # spread them over more than BURST / RATE_PER_S seconds) see the first window's count weighed
    # down as the next one runs on: RATE_PER_S more a second may then pass, by design.
    late = max(0.0, spread - BURST / RATE_PER_S)
    allowed = BURST + math.ceil(RATE_PER_S * late)
    assert BURST <= len(ok) <= allowed, (
        f"{len(ok)} of {len(answers)} got through ({ok}); the limit is {BURST} in total ({allowed} with the "
        f"answers spread over {spread:.1f} s); gateways that counted on their own while Redis failed: {fell_back}")
    assert all("requests/s" in text for _, text in limited), limited[:2]
    assert {g for g, _ in limited} == {"gateway-0", "gateway-1"}


def test_after_kill_9_of_one_of_each_no_accepted_event_is_lost_no_version_is_torn_and_training_resumes_in_bound(
        cluster, keys, wait_for):
    registry = cluster.registry()
    buffer = ReplayBuffer(redis.Redis.from_url(cluster.redis_url))
    stop = threading.Event()
    traffic = Corrections(cluster, LEARNS, keys[LEARNS], sent=100)
    scores = Scores(cluster, {t: k for t, k in keys.items() if t.startswith("ing-")})
    per_tenant = 1000                  # ~80 s of scores: the stream outlasts both rounds of kills
    scores.prepare(per_tenant)
    threads = [threading.Thread(target=traffic.run, args=(stop, 0.5), daemon=True),
               threading.Thread(target=scores.run, args=(stop, per_tenant), daemon=True)]
    for t in threads:
        t.start()
    try:
        before = newest_version(registry, LEARNS)
        wait_for(lambda: newest_version(registry, LEARNS) > before, timeout=120, interval=0.2,
                 what=f"a version of {LEARNS} from the live traffic")

        # one webhook, one ingest worker, one gateway, one vLLM replica: kill -9, all at once
        killed_at = time.monotonic()
        for proc in (cluster.webhooks[0], cluster.ingest_workers[0], cluster.gateways[0], cluster.replicas[1]):
            proc.kill()

        def waiting() -> dict[str, str]:         # tenants none of whose events accepted after the kills is stored
            accepted = {LEARNS: dict(traffic.accepted_at)} | {t: {} for t in scores.keys}
            for event, at in scores.accepted_at.items():
                accepted[event.rsplit("-", 1)[0].removeprefix("sc-")][event] = at
            out = {}
            for tenant, events in accepted.items():
                later = {e for e, at in events.items() if at > killed_at + 1.0}
                if not later & stored_events(buffer, tenant, "sft" if tenant == LEARNS else "rl"):
                    out[tenant] = f"{len(later)} accepted since the kills, none stored"
            return out

        deadline = time.monotonic() + 90
        while (left := waiting()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"data path not back 90 s after the kills: {left}; failures: " \
                         f"{(traffic.failures + scores.failures)[:3]}"
        recovered_s = time.monotonic() - killed_at
        print(f"data path back {recovered_s:.1f} s after kill -9 of webhook-0, ingest-0, gateway-0 and vllm-1")

        # then the learner training the tenant, while its corrections keep coming
        failover = fail_over_learner(cluster, LEARNS, feed=lambda: None, timeout_s=120)
        print(f"learner failover: {failover}")
        assert failover.survivor != failover.killed and failover.survivor in {p.name for p in cluster.learners}
        assert failover.takeover_s <= failover.bound_s + 2.0, \
            f"lease taken over {failover.takeover_s:.2f} s after the kill; bound: TTL {TTL_S} s + a tick"
        assert failover.next_version_s <= failover.bound_s + 20.0, \
            f"the next version came {failover.next_version_s:.2f} s after the kill (bound + a step and a publish)"
        assert failover.version_after > failover.version_before
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not traffic.failures and not scores.failures, (traffic.failures + scores.failures)[:3]

    # nothing accepted is lost: every 202 is in the buffers, once
    want = {LEARNS: (set(traffic.accepted), "sft")} | {t: (ev, "rl") for t, ev in scores.accepted.items()}
    for tenant, (events, kind) in want.items():
        wait_for(lambda: events <= stored_events(buffer, tenant, kind), timeout=120, interval=0.5,
                 what=f"every accepted event of {tenant} in its buffer ({len(events)})")
    assert len(scores.accepted) == 4 and all(scores.accepted.values())
    learned = stored_events(buffer, LEARNS, "sft")
    assert learned <= {f"fb-{LEARNS}-{i}" for i in range(traffic.sent)}       # nothing from nowhere

    # ... and every trainable correction is trained, each first in one version
    wait_for(lambda: trainable(learned) <= set().union(*trained_events(registry, LEARNS).values()), timeout=180,
             interval=0.5, what=f"every trainable correction of {LEARNS} in a version")
    trained = trained_events(registry, LEARNS)
    firsts = [e for events in trained.values() for e in events]
    assert len(firsts) == len(set(firsts)), "an event was first trained in two versions"

    # no version torn or duplicated: numbers unique and ascending, each the child of the one before, more
    # examples each, and every one verifies against its manifest in the store
    versions = registry.adapter_versions(LEARNS)
    numbers = [v.version for v in versions]
    assert numbers == sorted(set(numbers)) and numbers[0] == 1
    gaps = sorted(set(range(1, numbers[-1] + 1)) - set(numbers))
    assert len(gaps) <= 1, f"version numbers {numbers}: only the killed learner may leave one claimed number unused"
    assert [v.parent_version for v in versions] == [None] + numbers[:-1]
    assert all(a.examples_seen < b.examples_seen for a, b in zip(versions, versions[1:]))
    store = open_storage(cluster.storage_settings(), cluster.root / "verify-cache")
    for v in versions:
        folder = store.fetch(v.path)                         # raises unless every file matches the manifest
        assert (folder / "adapter_model.safetensors").is_file()
    assert set(numbers) <= set(store.versions(LEARNS))
    print(f"{LEARNS}: versions {numbers} (unused numbers {gaps}); {len(traffic.accepted)} corrections accepted, "
          f"{sum(map(len, scores.accepted.values()))} scores accepted, all stored")
