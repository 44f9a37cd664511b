"""Chaos under `clora up`'s supervision: while feedback streams through the webhook and
interactions through the broker, kill -9 hits an ingest worker twice in quick succession, a
worker crashes between its Redis write and its offset commit, and Redis is killed. Every
accepted event (202 / acknowledged) reaches the replay buffers exactly once.

The serving process's kill -9, with the broker frozen so that answered interactions sit only
in the gateway's spool, is `test_chaos_serving.py`.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import redis

from clora.ingest.buffers import ReplayBuffer
from clora.ingest.producer import BrokerUnavailable
from clora.ingest.worker import FAULT_EXIT_CODE
from clora.ingest.reports import consumer_lag
from clora.ingest.settings import IngestSettings, WebhookSettings
from clora.registry import Registry
from tests.infra.harness import running_platform, send_interactions

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N = 1500
CHUNK = 50


class Stream:
    """Sends N interaction/feedback pairs in chunks from a thread: each chunk's interactions until
    the broker acknowledges them, then its feedback until the webhook answers 202 (retrying with
    the same event ids, as a client should)."""

    def __init__(self, bootstrap: str, webhook: str, tenant: str, key: str):
        self.bootstrap, self.webhook, self.tenant, self.key = bootstrap, webhook, tenant, key
        self.accepted: set[str] = set()
        self.retries = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sent(self) -> int:
        return len(self.accepted)

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=10) as http:
                for start in range(0, N, CHUNK):
                    ids = range(start, start + CHUNK)
                    self._until_ok(lambda: send_interactions(self.bootstrap, self.tenant, ids))
                    body = {"records": [{"interaction_id": f"i{i}", "event_id": f"fb{i}", "score": 1.0} for i in ids]}
                    self._until_ok(lambda: self._post(http, body))
                    self.accepted.update(f"fb{i}" for i in ids)
        except BaseException as e:  # noqa: BLE001 - handed to the test, which fails with it
            self.error = e
        finally:
            self.done.set()

    def _post(self, http: httpx.Client, body: dict) -> None:
        r = http.post(f"{self.webhook}/v1/feedback/batch", json=body, headers={"Authorization": f"Bearer {self.key}"})
        if r.status_code != 202:
            raise RuntimeError(f"webhook answered {r.status_code}: {r.text[:200]}")

    def _until_ok(self, attempt) -> None:
        deadline = time.monotonic() + 120
        while True:
            try:
                return attempt()
            except (httpx.HTTPError, RuntimeError, BrokerUnavailable) as e:
                if time.monotonic() > deadline:
                    raise AssertionError(f"not accepted within 120 s: {e}") from e
                self.retries += 1
                time.sleep(0.2)                      # a client's back-off, not a wait for an event


def answers(client: redis.Redis) -> bool:
    """Whether Redis accepts connections and answers (a restarted process may not listen yet)."""
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_kills_during_a_stream_lose_and_duplicate_nothing(tmp_path, wait_for):
    crash = tmp_path / "crash-after-store"
    with running_platform(tmp_path / "data", ["webhook", "ingest"], CLORA_INGEST_WORKERS="2",
                          CLORA_INGEST_MAX_POLL_RECORDS="100",
                          CLORA_INGEST_CRASH_AFTER_STORE_FILE=str(crash)) as platform:
        client = redis.Redis.from_url(platform.stack.redis_url)
        tenant, key = Registry(client).create_tenant("chaos")
        wh = WebhookSettings()
        stream = Stream(platform.stack.kafka_bootstrap, f"http://{wh.host}:{wh.port}", tenant.id, key)
        buf = ReplayBuffer(client)
        workers = [platform.services["ingest-0"], platform.services["ingest-1"]]
        # Counted by exit, not by restarts: the supervisor may also restart a worker on its own
        # (its heartbeat or the group's commits stalled while the kills below hold up the group).
        exits = lambda how, ws=workers: sum(e.kind == "exited" and e.detail.endswith(f"code {how}")
                                            for x in ws for e in x.events)
        stream.thread.start()

        # 1. kill -9 one worker, and again as soon as its replacement runs
        wait_for(lambda: stream.sent() >= N // 10 or stream.done.is_set(), timeout=120, what="10% streamed")
        w = workers[0]
        w.signal(signal.SIGKILL)
        wait_for(lambda: exits(-signal.SIGKILL, [w]) == 1 and w.alive(), timeout=60, what="the first restart")
        w.signal(signal.SIGKILL)
        wait_for(lambda: exits(-signal.SIGKILL, [w]) == 2 and w.alive(), timeout=60, what="the second restart")

        # 2. a worker dies after its Redis write, before its commit: the batch comes back
        crash.touch()
        wait_for(lambda: not crash.exists(), timeout=120, what="a worker to take the injected crash")
        wait_for(lambda: exits(FAULT_EXIT_CODE) == 1 and all(x.alive() for x in workers), timeout=60,
                 what="the crashed worker's restart")

        # 3. kill -9 Redis mid-stream
        wait_for(lambda: stream.sent() >= N * 6 // 10 or stream.done.is_set(), timeout=180, what="60% streamed")
        r = platform.stack.processes["redis"]
        before = r.restarts
        r.signal(signal.SIGKILL)
        # alive is not listening: Redis answers once it has loaded its data, and the reads below need it
        wait_for(lambda: r.restarts > before and r.alive() and answers(client), timeout=60,
                 what="Redis's restart (answering again)")

        assert stream.done.wait(300) and stream.error is None, stream.error
        assert len(stream.accepted) == N
        group = IngestSettings().group_id
        stored = lambda: buf.depth(tenant.id, "rl") + buf.depth(tenant.id, "rl", heldout=True)
        wait_for(lambda: stored() >= N, timeout=300, interval=0.5,
                 what=f"all {N} examples in the buffers (stored {stored()}, lag {consumer_lag(client, group)})")
        wait_for(lambda: consumer_lag(client, group) == 0, timeout=60, what="the group to have committed everything")
        assert stored() == N                                           # nothing duplicated
        examples = buf.latest(tenant.id, "rl", N) + buf.heldout(tenant.id, "rl")
        ids = [e.feedback_event_id for e in examples]
        assert len(ids) == len(set(ids)) == N and set(ids) == stream.accepted   # nothing lost
        assert buf.stats(tenant.id)["added"] == N
        client.close()

