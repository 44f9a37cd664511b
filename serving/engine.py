"""The engine manager: the vLLM replicas behind the gateway and the adapters resident in each.

Owns
- starting/stopping every replica and a health monitor that restarts a dead or hung one and
  reloads every live adapter (at its current version) into it before it takes traffic again;
- routing: `lease(ref)` picks the healthy replica with the fewest requests in flight, makes
  sure `ref`'s adapter is resident there (loading it on demand, evicting the least recently
  used idle adapter when the replica's `max_cpu_loras` slots are full) and pins it for the
  duration of the request, so it can be neither evicted nor retired mid-request;
- `preload(ref)` (hot swap: load a new version everywhere before the alias switches) and
  `retire(ref)` (wait until no request pins the old version, then unload it everywhere);
- the replicas' API key: generated here, given to each replica (`VLLM_API_KEY`, so that no
  other local process can list, load or unload adapters) and sent on every call by `http`;
- with an object store (`storage`, `clora.storage`), the folder vLLM loads: each version is
  fetched into this host's cache and verified before the load, and vLLM is given the cached
  folder's path (a vLLM on another host must see that folder at the same path). Without one the
  registry's path is the folder itself.

One request's engine error (a 500, a dropped connection) is only *reported*
(`report_error`): the monitor checks that replica's health at once and takes it out only if
the check fails; one tenant's odd request must not cost every tenant the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from clora.storage import AdapterStorage, StorageError, StorageIntegrityError
from clora.serving.aliases import AdapterRef
from clora.serving.replica import Replica, ReplicaError, cpu_build
from clora.serving.residency import CapacityError
from clora.serving.settings import EngineSettings
from clora.serving.zero_adapter import ZERO_ADAPTER_NAME, write_zero_adapter

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """No replica is healthy right now."""


class AdapterLoadError(RuntimeError):
    """An adapter could not be made resident. `transient`: no slot came free in time, or the
    replica died during the load; not: the replica refused this adapter (a missing or broken
    folder), which retrying at once will not mend."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class Lease:
    """One request's hold on a replica (and on an adapter resident there)."""

    replica: Replica
    model: str
    """Name to send as `model` to vLLM: the versioned adapter name, or the base model's."""
    ref: AdapterRef | None
    """The tenant adapter served, None for the base model."""


class EngineManager:
    def __init__(self, settings: EngineSettings, *, live_refs: Callable[[], list[AdapterRef]] = list,
                 adapter_wait_s: float = 30.0, storage: AdapterStorage | None = None):
        self.settings = settings
        self.storage = storage
        """Where versions are fetched from (None: `AdapterRef.path` is a folder vLLM reads as it is)."""
        self.api_key = secrets.token_urlsafe(32)
        """Every replica requires it on `/v1/*` (vLLM's `VLLM_API_KEY`); only the gateway holds it."""
        self.replicas = [Replica(i, p, settings, api_key=self.api_key) for i, p in enumerate(settings.ports)]
        self.live_refs = live_refs
        """Adapters to reload into a restarted replica (the alias table's live versions)."""
        self.adapter_wait_s = adapter_wait_s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120, connect=2),
                                      headers={"authorization": f"Bearer {self.api_key}"},
                                      limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                                          keepalive_expiry=settings.keep_alive_s / 2))
        """Drops an idle connection well before the replica would (`EngineSettings.keep_alive_s`)."""
        self._changed = asyncio.Condition()
        self._monitor: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._suspects: set[int] = set()
        """Replicas a request reported an error for: a failed health check takes them out."""
        self._stopping = False
        self.zero_ref: AdapterRef | None = None
        """Set when base-model requests go through the all-zero adapter (CPU build)."""
        use_zero = settings.base_via_zero_adapter
        if use_zero is None:
            use_zero = cpu_build() and settings.cpu_lora_ops == "vllm"
        if use_zero:
            folder = Path(tempfile.mkdtemp(prefix="clora-zero-adapter-"))
            write_zero_adapter(settings.model, folder)
            self.zero_ref = AdapterRef(ZERO_ADAPTER_NAME, 0, str(folder))

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        for r in self.replicas:
            r.spawn()
        try:
            await asyncio.gather(*(r.wait_ready(self.http) for r in self.replicas))
        except BaseException:
            await self.stop()
            raise
        for r in self.replicas:
            await self._load_fixed(r)
            r.healthy = True
        self._monitor = asyncio.create_task(self._monitor_loop(), name="engine-monitor")

    async def stop(self) -> None:
        self._stopping = True
        if self._monitor:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await asyncio.gather(*(asyncio.to_thread(r.terminate) for r in self.replicas))
        await self.http.aclose()
        if self.zero_ref is not None:
            shutil.rmtree(self.zero_ref.path, ignore_errors=True)

    async def _load_fixed(self, replica: Replica) -> None:
        """Adapters every replica always holds: the zero adapter, pinned for good."""
        if self.zero_ref is not None:
            await self._make_resident(replica, self.zero_ref, pin=True)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def mark_failed(self, replica: Replica, cause: BaseException | str) -> None:
        """A request could not reach `replica`: stop routing to it until the monitor checked it."""
        if replica.healthy:
            log.warning("replica %d marked unhealthy: %s", replica.index, cause)
        replica.healthy = False
        self._wake.set()

    def report_error(self, replica: Replica, cause: BaseException | str) -> None:
        """A request to `replica` failed (a dropped connection, a broken stream): have the
        monitor check its health now. It keeps serving unless that check fails."""
        log.warning("replica %d: a request failed (%s); checking its health", replica.index, cause)
        self._suspects.add(replica.index)
        self._wake.set()

    # --- routing ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, ref: AdapterRef | None) -> AsyncIterator[Lease]:
        replica = self._pick()
        if ref is not None:
            await self._make_resident(replica, ref, pin=True)
        replica.in_flight += 1
        served = ref.name if ref else (self.zero_ref.name if self.zero_ref else self.settings.base_name)
        try:
            yield Lease(replica, served, ref)
        finally:
            replica.in_flight -= 1
            if ref is not None:
                replica.resident.unpin(ref.name)
                async with self._changed:
                    self._changed.notify_all()

    def _pick(self) -> Replica:
        healthy = self.healthy()
        if not healthy:
            raise EngineUnavailable(f"no healthy engine replica (0 of {len(self.replicas)})")
        return min(healthy, key=lambda r: r.in_flight)

    async def _make_resident(self, replica: Replica, ref: AdapterRef, *, pin: bool) -> None:
        name = ref.name
        if name in replica.resident:  # fast path: no await between the check and the pin
            replica.resident.pin(name) if pin else replica.resident.touch(name)
            return
        folder = await self._local_folder(ref)
        deadline = time.monotonic() + self.adapter_wait_s
        while True:
            async with replica.lock:
                if name in replica.resident:
                    replica.resident.pin(name) if pin else replica.resident.touch(name)
                    return
                try:
                    while replica.resident.full():
                        victim = replica.resident.victim()
                        await self._unload(replica, victim)
                        log.info("evicted %s from replica %d (LRU)", victim, replica.index)
                except CapacityError as e:
                    if time.monotonic() >= deadline:
                        raise AdapterLoadError(f"no slot for {name} on replica {replica.index} after "
                                               f"{self.adapter_wait_s} s: {e}", transient=True) from e
                except ReplicaError as e:  # the unload that frees a slot failed
                    if not replica.alive():
                        self.mark_failed(replica, e)
                    raise AdapterLoadError(f"freeing a slot for {name} on replica {replica.index} failed: {e}",
                                           transient=True) from e
                else:
                    try:
                        await replica.load_adapter(self.http, name, folder)
                    except ReplicaError as e:
                        died = not replica.alive()
                        if died:
                            self.mark_failed(replica, e)
                        raise AdapterLoadError(f"loading {name} (tenant {ref.tenant} v{ref.version}) "
                                               f"from {ref.path} failed", transient=died) from e
                    replica.resident.add(name, folder)
                    if pin:
                        replica.resident.pin(name)
                    return
            async with self._changed:  # every slot busy: wait for a request to finish
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)

    async def _local_folder(self, ref: AdapterRef) -> str:
        """The folder vLLM loads `ref` from: with `storage`, fetched into this host's cache and
        verified (outside any replica's lock: a download must not hold up other loads)."""
        if self.storage is None:
            return ref.path
        try:
            return str(await asyncio.to_thread(self.storage.fetch, ref.path))
        except StorageError as e:   # a torn or corrupt version will not mend; an unreachable store may
            raise AdapterLoadError(f"fetching {ref.name} (tenant {ref.tenant} v{ref.version}) from {ref.path} "
                                   f"failed: {e}", transient=not isinstance(e, StorageIntegrityError)) from e

    # --- hot swap -----------------------------------------------------------------------

    async def preload(self, ref: AdapterRef) -> None:
        """Make `ref` resident on every healthy replica (before its alias switches to it)."""
        await asyncio.gather(*(self._make_resident(r, ref, pin=False) for r in self.healthy()))

    def pins(self, name: str) -> int:
        return sum(r.resident.pins(name) for r in self.replicas)

    async def retire(self, ref: AdapterRef, drain_timeout_s: float) -> None:
        """Wait until no in-flight request uses `ref`, then unload it from every replica."""
        deadline = time.monotonic() + drain_timeout_s
        async with self._changed:
            while self.pins(ref.name) and time.monotonic() < deadline:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)
        if self.pins(ref.name):
            log.warning("unloading %s with %d requests still in flight after %.0f s", ref.name,
                        self.pins(ref.name), drain_timeout_s)
        for r in self.replicas:
            async with r.lock:
                if ref.name in r.resident and r.resident.pins(ref.name) == 0:
                    try:
                        await self._unload(r, ref.name)
                    except ReplicaError as e:
                        log.warning("retiring %s: %s", ref.name, e)

    async def _unload(self, replica: Replica, name: str) -> None:
        """Unload an idle adapter (`replica.lock` held). It leaves the resident set *before* the
        call: a request arriving meanwhile must not pin a name vLLM is removing (it would get
        vLLM's 404); it takes the slow path, waits for the lock and loads the name again. Put
        back when the unload fails."""
        gone = replica.resident.remove(name)
        try:
            await replica.unload_adapter(self.http, name)
        except BaseException:
            if gone is not None:
                replica.resident.restore(gone)
            raise

    def resident_names(self) -> dict[int, list[str]]:
        return {r.index: r.resident.names() for r in self.replicas}

    # --- health -------------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        """Health-check every replica; restart (in its own task) one whose process died or
        that has not answered a health check for `hang_timeout_s` (a busy replica answers
        slowly: that alone is not a reason to kill it)."""
        last_ok = {r.index: time.monotonic() for r in self.replicas}
        restarting: dict[int, asyncio.Task] = {}
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.health_interval_s)
            self._wake.clear()
            for r in self.replicas:
                if r.index in restarting:
                    continue
                alive = r.alive()
                suspect = r.index in self._suspects
                self._suspects.discard(r.index)
                if alive and await r.check_health(self.http):
                    last_ok[r.index] = time.monotonic()
                    r.healthy = True  # also refutes a failure a request reported
                    continue
                if suspect and r.healthy:  # a request's error, confirmed by the health check
                    log.warning("replica %d failed its health check after a request's error: taken out", r.index)
                    r.healthy = False
                hung = alive and time.monotonic() - last_ok[r.index] > self.settings.hang_timeout_s
                if not alive or hung:
                    r.healthy = False
                    if self.settings.restart:
                        task = asyncio.create_task(self._restart(r), name=f"restart-replica-{r.index}")
                        restarting[r.index] = task
                        task.add_done_callback(lambda t, i=r.index: self._restarted(restarting, last_ok, i, t))

    def _restarted(self, restarting: dict, last_ok: dict, index: int, task: asyncio.Task) -> None:
        restarting.pop(index, None)
        last_ok[index] = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            log.error("restarting replica %d failed (will retry): %s", index, task.exception())
        self._wake.set()

    async def _restart(self, r: Replica) -> None:
        r.healthy = False
        log.warning("restarting vLLM replica %d (alive=%s)", r.index, r.alive())
        await asyncio.to_thread(r.terminate, 5.0)
        recent = list(reversed(r.resident.names()))  # most recently used first
        r.resident.clear()
        r.restarts += 1
        r.spawn()
        await r.wait_ready(self.http)
        await self._load_fixed(r)
        # Every live adapter comes back at its current version; when there are more than slots,
        # the ones used last before the crash are loaded now and the others on demand.
        live = self.live_refs()
        rank = {name: i for i, name in enumerate(recent)}
        live.sort(key=lambda ref: rank.get(ref.name, len(rank)))
        for ref in reversed(live[: r.resident.capacity - len(r.resident)]):
            await self._make_resident(r, ref, pin=False)
        r.healthy = True
        log.info("replica %d back with %d live adapters: %s", r.index, len(r.resident), r.resident.names())
