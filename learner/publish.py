"""Publishing adapter versions: versioned folders, atomically, recorded and announced.
Owns `Publisher` (publish, import, roll back, prune, read weights back) and `PublishedWeights`.

Layout: `<adapters_dir>/<tenant>/v<N>/` holds `adapter_config.json`,
`adapter_model.safetensors` and `clora_metadata.json` (base model, step, examples seen, eval
scores, parent version, and, with a `CanaryProbe`, the version's canary: the log-probabilities
every serving replica must reproduce, `clora.canary`). A version is written under
`.tmp-v<N>-<random>` in the same folder, fsynced, then handed to the adapter storage
(`clora.storage`): the local folder (the default) renames it to `v<N>`, so a reader (vLLM, a restarted learner) sees a complete version or none;
an S3 store uploads its files and then its manifest of checksums, and only then renames it
into `adapters_dir` (the learner's cache). The registry records the version's URI
(`AdapterVersion.path`: the folder's path, or `s3://bucket/prefix/<tenant>/v<N>`). A version is
never overwritten; version numbers only grow (the next one is above every number in the
registry, on disk AND in the store, so an orphan left by a crash between upload or rename and
registry write, or a torn upload, is skipped, not reused; the registry hands the number out,
`claim_version`, above every number it handed out before, so two learners never take the same
one). Then the version's lineage (the
feedback events first trained in it, `clora.freshness`) is stored, then the version is recorded
in the registry, made live, and an `AdapterEvent` is announced through the injected
`announce` callable (a Kafka producer in the learner process, a list in tests). Every registry
write of a publish or a rollback carries the tenant's lease (`fence`, `clora.fencing`): a learner
that lost the tenant to another gets `FencedOut` and records nothing. Reading a
version back (`weights`, `rollback`'s check) fetches it through the storage (with S3: into the
local cache, every checksum verified).

`import_adapter` publishes an existing PEFT LoRA folder (a tenant's `init_adapter`) the same
way, as a version with step 0 and `imported_from` set, after checking it fits the layout.

A Tinker training run's weights saved for sampling (`clora.trainapi`) are published the same
way with `make_live=False` and `source="tinker"`: written and recorded, servable pinned as
`tenant@vN` (the gateway loads a pinned version on demand), but the tenant's live version does
not change and nothing is announced (an `AdapterEvent` tells serving to swap to the live
version; a version that is not live changes nothing there). Retention and the default rollback
target are the continuous learner's versions alone; see `prune`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Protocol

import torch

from clora.canary import AdapterCanary
from clora.fencing import Fence
from clora.freshness import VersionLineage
from clora.registry import AdapterVersion, TenantNotFound
from clora.storage import AdapterStorage, LocalStorage, StorageIntegrityError, local_versions
from clora.ingest.schemas import AdapterEvent
from clora.learner.lora import LoraLayout, LoraModel
from clora.learner.peft_io import AdapterFormatError, fsync_path, read_adapter, write_adapter

log = logging.getLogger(__name__)

METADATA_FILE = "clora_metadata.json"


class PublishError(RuntimeError):
    pass


class RegistryLike(Protocol):
    def claim_version(self, tenant_id: str, at_least: int, *, fence: Fence | None = None) -> int: ...
    def record_adapter_version(self, tenant_id: str, version: AdapterVersion, *,
                               fence: Fence | None = None) -> None: ...
    def adapter_versions(self, tenant_id: str) -> list[AdapterVersion]: ...
    def delete_adapter_versions(self, tenant_id: str, versions: list[int]) -> None: ...
    def set_live_version(self, tenant_id: str, version: int | None, *, fence: Fence | None = None) -> None: ...
    def live_version(self, tenant_id: str) -> int | None: ...
    def record_lineage(self, tenant_id: str, version: int, lineage: VersionLineage, *,
                       fence: Fence | None = None) -> None: ...


@dataclass(frozen=True)
class PublishedWeights:
    """A published version's weights. Example: `PublishedWeights(version=3, flat=<(P,) fp32>)`."""

    version: int
    flat: torch.Tensor
    """(P,) the flat LoRA weights, in `LoraLayout` order."""


class Publisher:
    def __init__(self, adapters_dir: Path | str, registry: RegistryLike, announce: Callable[[AdapterEvent], None],
                 base_model: str, layout: LoraLayout, *, storage: AdapterStorage | None = None,
                 fence: Callable[[str], Fence | None] = lambda tenant: None,
                 canary: Callable[[torch.Tensor], AdapterCanary] | None = None):
        self.canary = canary
        """Computes each version's canary from its flat weights (`CanaryProbe`); None: versions carry none."""
        self.fence = fence
        """The tenant's lease every registry write presents (`Leases.check`: `FencedOut` once lost)."""
        self.storage = storage if storage is not None else LocalStorage(adapters_dir)
        """Where versions are stored; its local folder (`root`) is `adapters_dir`."""
        self.root = self.storage.root
        self.registry = registry
        self.announce = announce
        self.base_model = base_model
        self.layout = layout

    def tenant_dir(self, tenant: str) -> Path:
        return self.root / tenant

    def versions_on_disk(self, tenant: str) -> list[int]:
        return local_versions(self.tenant_dir(tenant))

    def next_version(self, tenant: str) -> int:
        known = (self.versions_on_disk(tenant) + self.storage.versions(tenant)
                 + [v.version for v in self.registry.adapter_versions(tenant)])
        return max(known, default=0) + 1

    def clean_partial(self, tenant: str) -> list[Path]:
        """Remove temporary folders a crash left behind (never visible as versions)."""
        d = self.tenant_dir(tenant)
        removed = [p for p in d.glob(".tmp-*")] if d.is_dir() else []
        for p in removed:
            shutil.rmtree(p)
        return removed

    def prune(self, tenant: str, keep: int) -> list[int]:
        """Delete every version but the newest `keep` the learner made, the live one and its
        `keep` newest ancestors (where the reward guard rolls back to), the newest `keep` a Tinker
        run saved without a name (`save_weights_and_get_sampling_client`, one per RL step), and
        every one a Tinker run saved by name (its `tinker://` path stays valid): their registry
        records first, so nothing resolves them from then on, then their stored copies and
        folders (and those a crash left between the two). A replica that has one loaded keeps
        serving it until it unloads it. Returns the versions deleted."""
        if keep < 1:
            return []
        versions = {v.version: v for v in self.registry.adapter_versions(tenant)}
        learner = sorted(n for n, v in versions.items() if v.source is None)
        unnamed = sorted(n for n, v in versions.items() if v.source is not None and v.tinker_path is None)
        named = {n for n, v in versions.items() if v.source is not None and v.tinker_path is not None}
        kept = set(learner[-keep:]) | set(unnamed[-keep:]) | named
        v = self.registry.live_version(tenant)
        for _ in range(keep + 1):
            if v is None or v not in versions:
                break
            kept.add(v)
            v = versions[v].parent_version
        gone = sorted(set(versions) - kept)
        self.registry.delete_adapter_versions(tenant, gone)
        oldest_kept = min(kept, default=0)

        def doomed(n: int) -> bool:
            return n not in kept and (n in gone or n < oldest_kept)
        self.storage.delete(tenant, [n for n in self.storage.versions(tenant) if doomed(n)])
        for n in self.versions_on_disk(tenant):
            if doomed(n):
                shutil.rmtree(self.tenant_dir(tenant) / f"v{n}", ignore_errors=True)
        return gone

    def publish(self, tenant: str, flat: torch.Tensor, *, step: int, examples_seen: int,
                eval_scores: dict[str, float], parent_version: int | None = None,
                feedback_window: tuple[float, float] | None = None,
                lineage: VersionLineage | None = None,
                imported_from: str | None = None, make_live: bool = True,
                source: Literal["tinker"] | None = None, tinker_path: str | None = None) -> AdapterVersion:
        """Write, record, make live and announce a new version of `tenant`'s adapter. `lineage`:
        the feedback events first trained in it (None: none), stored before the version is
        live, so that the gateway that serves it first finds them. `make_live=False` stops after
        recording it (no live change, no announcement). `source`, `tinker_path`: who made it
        (`AdapterVersion.source`: "tinker" for a Tinker run's sampler weights) and the path the
        Tinker SDK knows it by."""
        fence = self.fence(tenant)
        version = self.registry.claim_version(tenant, self.next_version(tenant), fence=fence)
        d = self.tenant_dir(tenant)
        d.mkdir(parents=True, exist_ok=True)
        uri, tmp = self.storage.uri(tenant, version), d / f".tmp-v{version}-{uuid.uuid4().hex[:8]}"
        meta = AdapterVersion(version=version, path=uri, base_model=self.base_model,
                              parent_version=parent_version, step=step, examples_seen=examples_seen,
                              eval_scores=eval_scores, feedback_window=feedback_window,
                              imported_from=imported_from, source=source, tinker_path=tinker_path,
                              canary=self._canary(tenant, version, flat))
        try:
            tmp.mkdir()
            write_adapter(tmp, self.layout, flat, self.base_model)
            (tmp / METADATA_FILE).write_text(meta.model_dump_json(indent=2))
            fsync_path(tmp / METADATA_FILE)
            fsync_path(tmp)
            self.storage.publish(tenant, version, tmp)   # local: renamed to v<N>; S3: uploaded, then renamed
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublishError(f"publishing {tenant} v{version} to {uri} failed") from e
        if lineage is not None and lineage.events:
            self.registry.record_lineage(tenant, version, lineage, fence=fence)
        try:
            self.registry.record_adapter_version(tenant, meta, fence=fence)
        except TenantNotFound:   # deleted while this version was written: leave nothing of it behind
            self.storage.delete(tenant, [version])
            raise
        if not make_live:
            return meta
        self.registry.set_live_version(tenant, version, fence=fence)
        self._announce(AdapterEvent(tenant=tenant, action="published", version=version, path=meta.path,
                                    base_model=self.base_model, parent_version=parent_version,
                                    metrics={k: float(v) for k, v in eval_scores.items()}))
        return meta

    def _canary(self, tenant: str, version: int, flat: torch.Tensor) -> AdapterCanary | None:
        """The version's canary; None (serving then only checks that the adapter changes the
        base's answer) when there is no probe or it failed: a canary must not cost a publish."""
        if self.canary is None:
            return None
        try:
            return self.canary(flat)
        except Exception as e:  # noqa: BLE001 - whatever the forward raised, the version stands
            log.warning("no canary for %s v%d: %s", tenant, version, e)
            return None

    def _announce(self, event: AdapterEvent) -> None:
        """Best effort: the registry already holds the change, and serving polls it; the event
        only makes the swap sooner. A broker outage must not fail (and so repeat) a publish."""
        try:
            self.announce(event)
        except Exception as e:  # noqa: BLE001 - whatever the producer raises, the version stands
            log.warning("announcing %s v%d (%s) failed; serving will find it by polling: %s", event.tenant,
                        event.version, event.action, e)

    def import_adapter(self, tenant: str, folder: Path | str) -> tuple[AdapterVersion, torch.Tensor]:
        """Publish the PEFT LoRA adapter in `folder` as `tenant`'s next version (step 0, no
        examples, no eval scores). Returns (version, flat weights (P,)). Raises
        `AdapterFormatError` (nothing published) when it does not match the layout."""
        flat = read_adapter(Path(folder), self.layout)
        version = self.publish(tenant, flat, step=0, examples_seen=0, eval_scores={},
                               imported_from=str(folder))
        return version, flat

    def rollback(self, tenant: str, to_version: int | None = None) -> AdapterVersion:
        """Make an earlier version live: `to_version`, or the learner's newest version before the
        live one (a Tinker run's saved weights are never picked: they only go live when named)."""
        versions = {v.version: v for v in self.registry.adapter_versions(tenant)}
        live = self.registry.live_version(tenant)
        if to_version is None:
            older = [n for n, v in versions.items() if v.source is None and (live is None or n < live)]
            if not older:
                raise PublishError(f"{tenant} has no version older than live v{live} to roll back to")
            to_version = max(older)
        if to_version not in versions:
            raise PublishError(f"{tenant} has no recorded version v{to_version} (known: {sorted(versions)})")
        target = versions[to_version]
        self._read(target.path)  # refuse to make a missing/broken version live
        self.registry.set_live_version(tenant, to_version, fence=self.fence(tenant))
        self._announce(AdapterEvent(tenant=tenant, action="rolled_back", version=to_version, path=target.path,
                                    base_model=self.base_model, parent_version=target.parent_version,
                                    metrics={"rolled_back_from": float(live) if live is not None else -1.0}))
        return target

    def live_weights(self, tenant: str) -> PublishedWeights | None:
        """The live version's weights, or None when nothing is live."""
        live = self.registry.live_version(tenant)
        if live is None:
            return None
        return PublishedWeights(live, self.weights(tenant, live))

    def weights(self, tenant: str, version: int) -> torch.Tensor:
        """The flat weights (P,) of a published version (`AdapterFormatError` when unreadable)."""
        return self._read(self.storage.uri(tenant, version))

    def _read(self, uri: str) -> torch.Tensor:
        """The flat weights (P,) of the version stored at `uri`, fetched and verified first:
        `AdapterFormatError` when it is missing, torn or corrupt, `StorageError` when the store
        cannot be reached."""
        try:
            folder = self.storage.fetch(uri)
        except StorageIntegrityError as e:
            raise AdapterFormatError(f"fetching the adapter at {uri} failed: {e}") from e
        return read_adapter(folder, self.layout)


CANARY_MESSAGES = ({"role": "user", "content": "Name the three primary colours of paint."},
                   {"role": "assistant", "content": "Red, yellow and blue."})
"""The exchange each version's canary scores: a general one, which every tenant's adapter changes."""
CANARY_MAX_TOKENS = 64


class CanaryProbe:
    """Computes a version's canary (`clora.canary.AdapterCanary`) with the learner's own model:
    the log-probability of each token of `CANARY_MESSAGES` (chat template applied, at most
    `CANARY_MAX_TOKENS`) with the version's flat weights bound in fp32, and with the adapter
    disabled. The model's bound tenant, its modules' train/eval modes and any fused multi-tenant
    binding are left as they were.

    The base's half is computed once (the base is frozen within a process), and the last
    `REMEMBERED` canaries are kept by the weights' digest: tenants created from one starting
    adapter import the same weights, and each import after the first costs no forward. So a
    publish costs one forward over a few dozen tokens, an import of weights seen just before none."""

    REMEMBERED = 4

    def __init__(self, model: LoraModel, tokenizer):
        text = tokenizer.apply_chat_template(list(CANARY_MESSAGES), tokenize=False)
        self.prompt: list[int] = list(tokenizer(text, add_special_tokens=False)["input_ids"])[:CANARY_MAX_TOKENS]
        self.model = model
        self._base: list[float] | None = None
        self._seen: OrderedDict[bytes, list[float]] = OrderedDict()
        """Adapter log-probabilities by the digest of the fp32 weights they were computed from."""

    @torch.no_grad()
    def __call__(self, flat: torch.Tensor) -> AdapterCanary:
        model = self.model
        weight = next(model.model.parameters())
        flat = flat.detach().to(weight.device, torch.float32)
        digest = hashlib.blake2b(flat.cpu().contiguous().numpy().tobytes(), digest_size=16).digest()
        adapter = self._seen.get(digest)
        if adapter is None or self._base is None:
            ids = torch.tensor([self.prompt], device=weight.device)               # (1, T)
            bound, fused, modes = model.bank.params, model.bank.fused, [(m, m.training) for m in model.modules()]
            model.eval()
            model.bank.fused = None                                               # this version alone
            try:
                if adapter is None:
                    model.bind(model.layout.views(flat))
                    adapter = self._logprobs(ids)
                if self._base is None:
                    with model.adapter_disabled():
                        self._base = self._logprobs(ids)
            finally:
                model.bind(bound)
                model.bank.fused = fused
                for m, training in modes:
                    m.training = training
        self._seen[digest] = adapter
        self._seen.move_to_end(digest)
        while len(self._seen) > self.REMEMBERED:
            self._seen.popitem(last=False)
        return AdapterCanary(prompt_token_ids=self.prompt, logprobs=list(adapter), base_logprobs=list(self._base),
                             dtype=str(weight.dtype).removeprefix("torch."))

    def _logprobs(self, ids: torch.Tensor) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1 under the model as bound now."""
        logits = self.model(ids)[0, :-1].float()                                  # (T-1, V)
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


def read_metadata(folder: Path) -> AdapterVersion:
    return AdapterVersion.model_validate(json.loads((Path(folder) / METADATA_FILE).read_text()))
