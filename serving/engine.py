"""The engine manager: the vLLM replicas behind the gateway and the adapters resident in each.

Replicas are local (`LocalReplica`: children started, health-checked and restarted here, one per
`EngineSettings.ports` entry) and/or remote (`RemoteReplica`: vLLM servers started elsewhere,
`EngineSettings.remote_urls`, reached with `remote_api_key`). A remote replica is never started
or restarted: one that fails a health check leaves rotation, and when it answers again it
rejoins as a fresh server (it may have restarted): every live adapter is loaded, or found
loaded, and verified before it takes traffic.

Owns
- starting/stopping the local replicas and a health monitor over all of them;
- routing: `lease(ref)` picks a healthy replica that is not out of rotation for `ref`, preferring
  one where `ref`'s adapter is resident (warm in vLLM's memory first, `ResidentSet.warm`) unless it
  has `resident_slack` more requests in flight than the least loaded one, then the least loaded
  (one with a free adapter slot on a tie); makes sure the adapter is resident there (loading it on
  demand, evicting the least recently used idle adapter when the replica's
  `EngineSettings.registered_loras` slots are full) and pins it for the duration of the request,
  so it can be neither evicted nor retired mid-request. With `max_registered_loras` above
  `max_cpu_loras`, vLLM's own cache does the swapping below that: it re-reads a resident
  adapter's folder when a request needs it;
- verifying each version's first load on a replica with its canary (`clora.serving.canary`,
  `clora.canary`); a re-load after an eviction, from the same folder, on the same replica since it
  last (re)started or rejoined, is not verified again (`ResidentSet.verified`; a 404 for a name
  the replica was believed to hold resets that replica's record). A replica that fails the load
  or the canary is out of rotation *for that adapter* (its `Refusals`), retried after a doubling
  wait, counted by reason (`Replica.load_failures`, the metric
  `clora_engine_adapter_load_failures`) and shown on the console (`report`); other adapters
  still route to it;
- `preload(ref)` (hot swap: load a new version into every healthy replica before the alias
  switches; it switches when at least one replica took it) and `retire(ref)` (wait until no
  request pins the old version, then unload it everywhere);
- the local replicas' API key: generated here, given to each (`VLLM_API_KEY`, so that no other
  local process can list, load or unload adapters) and sent on every call (`Replica.headers`);
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
from typing import Any

import httpx

from clora.storage import AdapterStorage, StorageError, StorageIntegrityError
from clora.serving.aliases import AdapterRef
from clora.serving.canary import run_canary
from clora.serving.replica import LocalReplica, RemoteReplica, Replica, ReplicaError, cpu_build
from clora.serving.residency import CapacityError
from clora.serving.settings import EngineSettings
from clora.serving.zero_adapter import ZERO_ADAPTER_NAME, write_zero_adapter

log = logging.getLogger(__name__)

CANARY_REASONS = {"not_applied": "not_applied", "mismatch": "canary_mismatch", "base_mismatch": "base_mismatch",
                  "malformed": "canary_error"}
"""A failed canary's outcome (`clora.canary.Outcome`) -> the failures metric's `reason`."""
REJOIN_RETRY_MAX_S = 60.0


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
        """Every local replica requires it on `/v1/*` (vLLM's `VLLM_API_KEY`); only the gateway holds it."""
        remote_key = settings.remote_api_key.get_secret_value() if settings.remote_api_key else None
        local = [LocalReplica(i, p, settings, api_key=self.api_key) for i, p in enumerate(settings.ports)]
        remote = [RemoteReplica(len(local) + i, url, settings, api_key=remote_key)
                  for i, url in enumerate(settings.remote_urls)]
        self.replicas: list[Replica] = [*local, *remote]
        self.live_refs = live_refs
        """Adapters to reload into a restarted or rejoining replica (the alias table's live versions)."""
        self.adapter_wait_s = adapter_wait_s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120, connect=2),
                                      limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                                          keepalive_expiry=settings.keep_alive_s / 2))
        """Drops an idle connection well before the replica would (`EngineSettings.keep_alive_s`)."""
        self._changed = asyncio.Condition()
        self._monitor: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._suspects: set[int] = set()
        """Replicas a request reported an error for: a failed health check takes them out."""
        self._lost: set[int] = {r.index for r in remote}
        """Remote replicas that must rejoin (load every live adapter) before they take traffic:
        not yet attached, or their health check failed since."""
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

    @property
    def base_model(self) -> str:
        """The name base-model requests are sent to vLLM under."""
        return self.zero_ref.name if self.zero_ref else self.settings.base_name

    def local(self) -> list[LocalReplica]:
        return [r for r in self.replicas if isinstance(r, LocalReplica)]

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the local replicas and wait until each is ready; attach every remote replica
        that answers now (the monitor attaches the others once they answer: a fleet starting
        in any order must not stop the gateway from starting)."""
        local = self.local()
        for r in local:
            r.spawn()
        try:
            await asyncio.gather(*(r.wait_ready(self.http) for r in local))
            for r in local:
                await self._load_fixed(r)
                r.healthy = True
            await asyncio.gather(*(self._attach(r) for r in self.replicas if r.index in self._lost))
        except BaseException:
            await self.stop()
            raise
        self._monitor = asyncio.create_task(self._monitor_loop(), name="engine-monitor")

    async def _attach(self, r: Replica) -> None:
        if await r.check_health(self.http):
            try:
                await self._rejoin(r)
            except (ReplicaError, AdapterLoadError) as e:
                log.warning("%s answers but could not be attached yet (retrying): %s", r.describe(), e)
        else:
            log.warning("%s does not answer yet; it takes traffic once it does", r.describe())

    async def stop(self) -> None:
        self._stopping = True
        if self._monitor:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await asyncio.gather(*(asyncio.to_thread(r.terminate) for r in self.local()))
        await self.http.aclose()
        if self.zero_ref is not None:
            shutil.rmtree(self.zero_ref.path, ignore_errors=True)

    async def _load_fixed(self, replica: Replica) -> None:
        """Adapters every replica always holds: the zero adapter, pinned for good."""
        if self.zero_ref is not None:
            await self._make_resident(replica, self.zero_ref, pin=True)

    async def _load_live(self, r: Replica, recent: list[str] = ()) -> None:
        """Load every live adapter at its current version into `r` (verified); when there are more
        than slots, the ones in `recent` (most recently used first) before the others, the rest on
        demand. One adapter that fails to load or verify is left out of rotation there, not the
        replica; a replica that dies meanwhile raises."""
        live = self.live_refs()
        rank = {name: i for i, name in enumerate(recent)}
        live.sort(key=lambda ref: rank.get(ref.name, len(rank)))
        room = r.resident.cached - len(r.resident)  # what vLLM keeps in memory; the rest on demand
        for ref in reversed(live[: max(0, room)]):
            try:
                await self._make_resident(r, ref, pin=False)
            except AdapterLoadError as e:
                if e.transient:
                    raise
                log.error("%s: %s stays out of rotation there: %s", r.describe(), ref.name, e)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def mark_failed(self, replica: Replica, cause: BaseException | str) -> None:
        """A request could not reach `replica`: stop routing to it until the monitor checked it."""
        if replica.healthy:
            log.warning("%s marked unhealthy: %s", replica.describe(), cause)
        replica.healthy = False
        self._wake.set()

    def report_error(self, replica: Replica, cause: BaseException | str) -> None:
        """A request to `replica` failed (a dropped connection, a broken stream): have the
        monitor check its health now. It keeps serving unless that check fails."""
        log.warning("%s: a request failed (%s); checking its health", replica.describe(), cause)
        self._suspects.add(replica.index)
        self._wake.set()

    # --- routing ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, ref: AdapterRef | None) -> AsyncIterator[Lease]:
        replica = await self._acquire(ref)
        replica.in_flight += 1
        try:
            yield Lease(replica, ref.name if ref else self.base_model, ref)
        finally:
            replica.in_flight -= 1
            if ref is not None:
                replica.resident.unpin(ref.name)
                async with self._changed:
                    self._changed.notify_all()

    async def _acquire(self, ref: AdapterRef | None) -> Replica:
        """The replica to serve `ref` on, with its adapter resident and pinned there. A replica
        that refuses the adapter (load or canary) leaves rotation for it and the next one is tried."""
        if ref is None:
            return self._pick(None)
        tried: set[int] = set()
        while True:
            replica = self._pick(ref, exclude=tried)
            try:
                await self._make_resident(replica, ref, pin=True)
                return replica
            except AdapterLoadError as e:
                if e.transient or replica.refused.get(ref.name) is None:   # not this replica's doing
                    raise
                tried.add(replica.index)
                log.warning("%s refused %s (%s); trying another replica", replica.describe(), ref.name, e)

    def adapter_missing(self, lease: Lease) -> None:
        """The replica answered 404 to a request for an adapter it was believed to hold: another
        gateway sharing it unloaded that version (it retired it), or the replica restarted between
        two health checks. Forget it there, so that the next request loads and verifies it again;
        nothing loaded there counts as verified any more (it may be a new incarnation). A peer
        that retires a version unloads it from every replica, so it is forgotten on the others
        too where no request of this gateway is using it (one that is learns it from its own 404):
        the next request for it loads it, instead of trusting another replica that lost it too."""
        if lease.ref is None:
            return
        name = lease.ref.name
        lease.replica.resident.forget_verified()
        if lease.replica.resident.remove(name) is not None:
            log.warning("%s no longer holds %s (404): it is loaded and verified again on the next request",
                        lease.replica.describe(), name)
        for other in self.replicas:
            if other is not lease.replica and name in other.resident and other.resident.pins(name) == 0:
                other.resident.remove(name)
                other.resident.forget_verified(name)

    def _pick(self, ref: AdapterRef | None, exclude: set[int] = frozenset()) -> Replica:
        """Resident first (within `resident_slack` requests of the least loaded), then the least
        loaded, a free slot breaking ties. Example: slack 4, `acme@v3` resident on replica 0 with 5
        in flight, replica 1 idle without it: replica 1 (5 > 0 + 4), which loads it."""
        healthy = self.healthy()
        if not healthy:
            raise EngineUnavailable(f"no healthy engine replica (0 of {len(self.replicas)})")
        if ref is None:
            return min(healthy, key=lambda r: r.in_flight)
        usable = [r for r in healthy if r.index not in exclude and not r.refused.blocks(ref.name)]
        if not usable:
            why = "; ".join(f"{r.describe()}: {x.detail}" for r in healthy if (x := r.refused.get(ref.name)))
            raise AdapterLoadError(f"every healthy replica is out of rotation for {ref.name}: {why or 'refused it'}")
        least = min(r.in_flight for r in usable)
        resident = ([r for r in usable if r.resident.warm(ref.name)]
                    or [r for r in usable if ref.name in r.resident])
        if resident:
            best = min(resident, key=lambda r: r.in_flight)
            if best.in_flight <= least + self.settings.resident_slack:
                return best
        return min(usable, key=lambda r: (r.in_flight, r.resident.full()))

    async def _make_resident(self, replica: Replica, ref: AdapterRef, *, pin: bool) -> None:
        name = ref.name
        if name in replica.resident:  # fast path: no await between the check and the pin
            replica.resident.pin(name) if pin else replica.resident.touch(name)
            return
        if replica.refused.blocks(name):
            raise AdapterLoadError(f"{replica.describe()} is out of rotation for {name} until it is retried: "
                                   f"{replica.refused.get(name).detail}")
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
                        log.info("evicted %s from %s (LRU)", victim, replica.describe())
                except CapacityError as e:
                    if time.monotonic() >= deadline:
                        raise AdapterLoadError(f"no slot for {name} on {replica.describe()} after "
                                               f"{self.adapter_wait_s} s: {e}", transient=True) from e
                except ReplicaError as e:  # the unload that frees a slot failed
                    if not replica.alive():
                        self.mark_failed(replica, e)
                    raise AdapterLoadError(f"freeing a slot for {name} on {replica.describe()} failed: {e}",
                                           transient=True) from e
                else:
                    await self._load_verified(replica, ref, folder)
                    replica.resident.add(name, folder)
                    if pin:
                        replica.resident.pin(name)
                    return
            async with self._changed:  # every slot busy: wait for a request to finish
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=1.0)

    async def _load_verified(self, replica: Replica, ref: AdapterRef, folder: str) -> None:
        """Load `ref` from `folder` into `replica` and check its canary (`replica.lock` held).
        A refusal (vLLM refused the folder, the canary failed) puts the replica out of rotation for
        `ref` and raises a non-transient AdapterLoadError; a replica that gave no answer (died,
        unreachable) raises a transient one and goes to the monitor. No canary when this replica
        verified `ref` from `folder` before (since it last started) and this call loaded it: a
        name vLLM already held (another gateway loaded it) is verified whatever it holds."""
        name = ref.name
        what = f"{name} (tenant {ref.tenant} v{ref.version}) from {ref.path} on {replica.describe()}"
        try:
            loaded = await replica.load_adapter(self.http, name, folder)
        except ReplicaError as e:
            self._unanswered(replica, e)
            if e.unreachable or not replica.alive():
                raise AdapterLoadError(f"loading {what} failed", transient=True) from e
            self._refuse(replica, name, "load", str(e))
            raise AdapterLoadError(f"loading {what} failed: {e}") from e
        if ref is self.zero_ref:
            return
        if loaded and not self.settings.canary_every_load and replica.resident.verified(name, folder):
            replica.adapter_ops["canary_skipped"] += 1
            log.info("re-loaded %s (verified on this replica before)", what)
            return
        try:
            verdict = await run_canary(self.http, replica, ref, base_model=self.base_model,
                                       timeout_s=self.settings.canary_timeout_s)
        except ReplicaError as e:
            self._unanswered(replica, e)
            if e.unreachable or not replica.alive():
                raise AdapterLoadError(f"the canary of {what} got no answer", transient=True) from e
            await self._discard(replica, name)
            self._refuse(replica, name, "canary_error", str(e))
            raise AdapterLoadError(f"the canary of {what} failed: {e}") from e
        if not verdict.passed:
            await self._discard(replica, name)
            self._refuse(replica, name, CANARY_REASONS[verdict.outcome], verdict.reason)
            raise AdapterLoadError(f"{what} failed its canary: {verdict.reason}")
        replica.refused.clear(name)
        replica.resident.mark_verified(name, folder)
        if verdict.outcome in ("matched", "applied"):
            log.info("loaded %s: %s", what, verdict.reason)
        else:
            log.warning("loaded %s, not verified: %s", what, verdict.reason)

    def _unanswered(self, replica: Replica, e: ReplicaError) -> None:
        """A call got no answer: a dead local child is taken out now, anything else is checked."""
        if not replica.alive():
            self.mark_failed(replica, e)
        elif e.unreachable:
            self.report_error(replica, e)

    def _refuse(self, replica: Replica, name: str, reason: str, detail: str) -> None:
        refusal = replica.refused.add(name, reason, detail)
        replica.load_failures[reason] += 1
        log.error("%s is out of rotation for %s (%s, %d time(s); retried in %.0f s): %s", replica.describe(), name,
                  reason, refusal.failures, refusal.retry_at - time.monotonic(), detail)

    async def _discard(self, replica: Replica, name: str) -> None:
        """Unload an adapter that failed its canary (best effort), so a retry loads it afresh."""
        try:
            await replica.unload_adapter(self.http, name)
        except ReplicaError as e:
            log.warning("unloading %s after its failed canary: %s", name, e)

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
        """Make `ref` resident on every healthy replica (before its alias switches to it). Raises
        only when no replica took it (a transient error first, so that the next poll retries);
        the replicas that refused it stay out of rotation for it."""
        healthy = self.healthy()
        results = await asyncio.gather(*(self._make_resident(r, ref, pin=False) for r in healthy),
                                       return_exceptions=True)
        failed = [e for e in results if isinstance(e, BaseException)]
        for e in failed:
            if not isinstance(e, AdapterLoadError):
                raise e
        if failed and len(failed) == len(results):
            raise next((e for e in failed if e.transient), failed[0])
        if failed:
            log.warning("%s is resident on %d of %d healthy replicas; the others: %s", ref.name,
                        len(results) - len(failed), len(results), "; ".join(map(str, failed)))

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
            r.refused.clear(ref.name)
            r.resident.forget_verified(ref.name)
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

    def report(self) -> list[dict[str, Any]]:
        """Each replica as the console shows it: health, resident adapters, and the adapters it is
        out of rotation for (why, how often, when it is retried)."""
        now = time.monotonic()
        return [{"index": r.index, "url": r.url, "kind": r.kind, "healthy": r.healthy, "restarts": r.restarts,
                 "in_flight": r.in_flight, "resident": r.resident.names(), "load_failures": dict(r.load_failures),
                 "refused": [{"adapter": x.name, "reason": x.reason, "detail": x.detail, "failures": x.failures,
                              "retry_in_s": round(max(0.0, x.retry_at - now), 1)} for x in r.refused.items()]}
                for r in self.replicas]

    # --- health -------------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        """Health-check every replica. A local one whose process died or that has not answered
        a health check for `hang_timeout_s` is restarted (in its own task; a busy replica answers
        slowly: that alone is not a reason to kill it). A remote one that fails a check leaves
        rotation and rejoins (in its own task) once it answers again."""
        last_ok = {r.index: time.monotonic() for r in self.replicas}
        busy: dict[int, asyncio.Task] = {}
        """Replicas being restarted (local) or rejoining (remote)."""
        rejoin_after: dict[int, tuple[int, float]] = {}
        """Remote replica -> (failed rejoins, monotonic time of the next try)."""
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.health_interval_s)
            self._wake.clear()
            for r in self.replicas:
                if r.index in busy:
                    continue
                alive = r.alive()
                suspect = r.index in self._suspects
                self._suspects.discard(r.index)
                if alive and await r.check_health(self.http):
                    last_ok[r.index] = time.monotonic()
                    if r.index not in self._lost:
                        r.healthy = True  # also refutes a failure a request reported
                    elif time.monotonic() >= rejoin_after.get(r.index, (0, 0.0))[1]:
                        task = asyncio.create_task(self._rejoin(r), name=f"rejoin-replica-{r.index}")
                        busy[r.index] = task
                        task.add_done_callback(lambda t, i=r.index: self._rejoined(busy, rejoin_after, i, t))
                    continue
                if isinstance(r, RemoteReplica):
                    if r.index not in self._lost:
                        log.warning("%s failed its health check: out of rotation until it answers again",
                                    r.describe())
                        self._lost.add(r.index)
                    r.healthy = False
                    continue
                if suspect and r.healthy:  # a request's error, confirmed by the health check
                    log.warning("%s failed its health check after a request's error: taken out", r.describe())
                    r.healthy = False
                hung = alive and time.monotonic() - last_ok[r.index] > self.settings.hang_timeout_s
                if not alive or hung:
                    r.healthy = False
                    if self.settings.restart:
                        task = asyncio.create_task(self._restart(r), name=f"restart-replica-{r.index}")
                        busy[r.index] = task
                        task.add_done_callback(lambda t, i=r.index: self._restarted(busy, last_ok, i, t))

    def _restarted(self, busy: dict, last_ok: dict, index: int, task: asyncio.Task) -> None:
        busy.pop(index, None)
        last_ok[index] = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            log.error("restarting replica %d failed (will retry): %s", index, task.exception())
        self._wake.set()

    def _rejoined(self, busy: dict, rejoin_after: dict, index: int, task: asyncio.Task) -> None:
        busy.pop(index, None)
        if task.cancelled():
            return
        if task.exception() is None:
            rejoin_after.pop(index, None)
            return
        n = rejoin_after.get(index, (0, 0.0))[0] + 1
        wait = min(REJOIN_RETRY_MAX_S, self.settings.health_interval_s * 2 ** n)
        rejoin_after[index] = (n, time.monotonic() + wait)
        log.error("replica %d answers but could not rejoin (retried in %.0f s): %s", index, wait, task.exception())

    async def _rejoin(self, r: Replica) -> None:
        """Admit a remote replica that answers its health check again (or for the first time).
        What it holds is unknown (it may have restarted, another gateway may have loaded
        adapters), so its bookkeeping starts afresh and every live adapter is loaded, or found
        loaded, and verified before it takes traffic."""
        recent = list(reversed(r.resident.names()))
        r.resident.clear()
        r.refused.clear()
        await self._load_fixed(r)
        await self._load_live(r, recent)
        self._lost.discard(r.index)
        r.healthy = True
        log.info("%s in rotation with %d live adapters: %s", r.describe(), len(r.resident), r.resident.names())

    async def _restart(self, r: LocalReplica) -> None:
        r.healthy = False
        log.warning("restarting vLLM replica %d (alive=%s)", r.index, r.alive())
        await asyncio.to_thread(r.terminate, 5.0)
        recent = list(reversed(r.resident.names()))  # most recently used first
        r.resident.clear()
        r.refused.clear()
        r.restarts += 1
        r.spawn()
        await r.wait_ready(self.http)
        await self._load_fixed(r)
        # Every live adapter comes back at its current version; when there are more than slots,
        # the ones used last before the crash are loaded now and the others on demand.
        await self._load_live(r, recent)
        r.healthy = True
        log.info("replica %d back with %d live adapters: %s", r.index, len(r.resident), r.resident.names())
