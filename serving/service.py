"""The serving service: vLLM engine replicas + the OpenAI-compatible gateway, as one unit
that `clora up` (or a test) starts and stops.

    svc = ServingService(EngineSettings(model=...), GatewaySettings(port=8000),
                         kafka_bootstrap="127.0.0.1:19092", redis_url="redis://127.0.0.1:16379/0")
    svc.start()          # blocks until every replica is healthy and the gateway listens
    print(svc.url)       # http://127.0.0.1:8000/v1 for the openai client's base_url
    svc.stop()

or, blocking until `stop_event` is set: `run_serving(engine, gateway, kafka_bootstrap, redis_url, stop_event)`.

Everything async (engine monitor, hot swap, request handling) runs on one event loop in a
background thread; the interaction logger and the adapter-event consumer have their own threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time

import redis
import uvicorn
from prometheus_client import start_http_server

from clora.registry import Registry
from clora.settings import HTTP_KEEP_ALIVE_S
from clora.storage import StorageSettings, open_storage
from clora.ingest.producer import EventProducer
from clora.serving.aliases import AliasTable
from clora.serving.engine import EngineManager
from clora.serving.gateway import Gateway, create_app, shared_salt_key
from clora.serving.hotswap import AdapterEventListener, HotSwapper
from clora.serving.interactions import InteractionLogger
from clora.serving.metrics import GatewayMetrics
from clora.serving.quota_store import QuotaStore
from clora.serving.settings import EngineSettings, GatewaySettings, tenant_limits
from clora.serving.spool import DiskSpool
from clora.serving.traffic import TrafficRollup

log = logging.getLogger(__name__)


class ServingStartError(RuntimeError):
    """The engine or the gateway did not come up."""


class ServingStopped(RuntimeError):
    """Serving was told to stop before it finished starting (`ServingService.start`'s `stop_event`)."""


class ServingService:
    def __init__(self, engine: EngineSettings, gateway: GatewaySettings, *, kafka_bootstrap: str, redis_url: str,
                 listen_adapter_events: bool = True, storage: StorageSettings | None = None):
        self.engine_settings, self.gateway_settings = engine, gateway
        self.storage_settings = storage if storage is not None else StorageSettings()
        """Where adapter versions are stored (`CLORA_STORAGE_*`): with S3 each is fetched into
        `cache_dir` and verified before vLLM loads it from there."""
        self.kafka_bootstrap, self.redis_url = kafka_bootstrap, redis_url
        self.listen_adapter_events = listen_adapter_events
        tenant_limits(engine, gateway)  # raises ValueError for settings that leave a tenant nothing
        self.gateway: Gateway | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None
        """`_main`, while it runs: cancelled by `stop` before the gateway listens."""
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """Base URL for OpenAI clients (`.../v1`)."""
        return f"http://{self.gateway_settings.host}:{self.port}/v1"

    def start(self, timeout_s: float | None = None, stop_event: threading.Event | None = None) -> "ServingService":
        """Start the engine and the gateway; return once the gateway listens. When `stop_event`
        is set first (a SIGTERM while the engine boots, which takes minutes on a busy CPU), the
        start is abandoned at once, the replicas stopped, and `ServingStopped` raised: a process
        told to stop must not finish booting first, nor leave its engine children behind."""
        timeout_s = timeout_s or self.engine_settings.start_timeout_s + 30
        self._thread = threading.Thread(target=self._run, name="serving", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
            if stop_event is not None and stop_event.is_set():
                self.stop()
                raise ServingStopped("serving was told to stop while it started")
            if time.monotonic() >= deadline:
                break
        if not self._ready.is_set() or self._error is not None:
            self.stop()
            raise ServingStartError(f"serving did not start within {timeout_s} s") from self._error
        return self

    def stop(self) -> None:
        """Stop serving: the gateway drains, or a start in progress is cancelled; either way the
        engine's replicas are stopped before this returns (within a minute)."""
        if self._server is not None:
            self._server.should_exit = True
        elif self._task is not None and self.loop is not None:   # still starting: cancel it
            self.loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(60)

    def call(self, coro, timeout_s: float = 120):
        """Run a coroutine on the service's loop from another thread (tests, admin tools)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):   # `stop` during the start: nothing to report
            asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        es, gs = self.engine_settings, self.gateway_settings
        registry = Registry(redis.Redis.from_url(self.redis_url, socket_timeout=5))
        aliases = AliasTable()
        ss = self.storage_settings
        engine = EngineManager(es, live_refs=aliases.refs, adapter_wait_s=gs.adapter_wait_s,
                               storage=open_storage(ss, ss.cache_dir) if ss.backend == "s3" else None)
        rollup = TrafficRollup(registry)
        metrics = GatewayMetrics(rollup=rollup, freshness_tenants=gs.freshness_tenant_labels)
        swapper = HotSwapper(registry, aliases, engine, poll_s=gs.registry_poll_s, refresh_s=gs.tenant_refresh_s,
                             drain_timeout_s=gs.drain_timeout_s, metrics=metrics)
        logger = InteractionLogger(lambda: EventProducer(self.kafka_bootstrap, timeout_s=gs.kafka_timeout_s),
                                   DiskSpool(gs.spool_dir), ack_timeout_s=gs.kafka_timeout_s).start()
        metrics.watch(engine, logger)
        listener = exporter = None
        quota_store = QuotaStore.connect(self.redis_url, lease_s=gs.quota_lease_s, timeout_s=gs.quota_store_timeout_s,
                                         retry_s=gs.quota_store_retry_s, metrics=metrics) if gs.shared_quotas else None
        reporter: asyncio.Task | None = None
        try:
            exporter = self._export(metrics)
            await engine.start()
            swapper.start()
            rollup.start()
            reporter = asyncio.create_task(report_engine(registry, engine, gs.engine_report_s), name="engine-report")
            if self.listen_adapter_events:
                listener = AdapterEventListener(self.kafka_bootstrap, swapper, self.loop)
                listener.start()
            self.gateway = Gateway(gs, registry, engine, swapper, logger, metrics=metrics, quota_store=quota_store,
                                   salt_key=await asyncio.to_thread(self._salt_key, registry))
            config = uvicorn.Config(create_app(self.gateway), host=gs.host, port=gs.port, log_level="warning",
                                    lifespan="off", timeout_graceful_shutdown=5,
                                    timeout_keep_alive=HTTP_KEEP_ALIVE_S)
            self._server = uvicorn.Server(config)
            serve = asyncio.create_task(self._server.serve())
            while not self._server.started and not serve.done():
                await asyncio.sleep(0.05)
            if serve.done():
                serve.result()
                raise ServingStartError(f"gateway did not start on {gs.host}:{gs.port}")
            self.port = self._server.servers[0].sockets[0].getsockname()[1]
            log.info("gateway listening on %s", self.url)
            self._ready.set()
            await serve
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._ready.set()
            if reporter is not None:
                reporter.cancel()
            if exporter is not None:
                exporter.shutdown()
            if listener is not None:
                await asyncio.to_thread(listener.stop)
            await swapper.stop()
            await rollup.stop()
            await engine.stop()
            await asyncio.to_thread(logger.stop)
            if quota_store is not None:
                await quota_store.close()

    @staticmethod
    def _salt_key(registry: Registry) -> bytes:
        """The deployment's shared prefix-cache salt key; with Redis down at start, one of this
        gateway's own (tenants stay apart, only their cached prefixes are not shared)."""
        try:
            return shared_salt_key(registry.r)
        except redis.RedisError as e:
            log.warning("prefix-cache salt key not shared (Redis: %s): this gateway uses its own", e)
            return secrets.token_bytes(32)

    def _export(self, metrics: GatewayMetrics):
        """Serve the gateway's metrics on `metrics_host:metrics_port` (the loopback unless configured:
        they name tenants)."""
        gs = self.gateway_settings
        if gs.metrics_port is None:
            return None
        try:
            server, _ = start_http_server(gs.metrics_port, addr=gs.metrics_host, registry=metrics.registry)
        except OSError as e:
            log.warning("metrics port %s busy (%s); the gateway exports no metrics", gs.metrics_port, e)
            return None
        self.metrics_port = server.server_port
        return server


async def report_engine(registry: Registry, engine: EngineManager, every_s: float) -> None:
    """Write this gateway's view of its replicas (`EngineManager.report`) to the registry every
    `every_s` for the console, until cancelled; a Redis outage only skips reports."""
    gateway = f"{socket.gethostname()}:{os.getpid()}"
    while True:
        try:
            await asyncio.to_thread(registry.report_engine, gateway, engine.report(), stale_s=6 * every_s)
        except redis.RedisError as e:
            log.warning("reporting the engine's replicas to the registry failed (retrying): %s", e)
        await asyncio.sleep(every_s)


def run_serving(engine: EngineSettings, gateway: GatewaySettings, kafka_bootstrap: str, redis_url: str,
                stop_event: threading.Event) -> None:
    """Run engine + gateway until `stop_event` is set (the `clora up` entry point)."""
    try:
        svc = ServingService(engine, gateway, kafka_bootstrap=kafka_bootstrap, redis_url=redis_url).start(
            stop_event=stop_event)
    except ServingStopped:
        return
    try:
        stop_event.wait()
    finally:
        svc.stop()
