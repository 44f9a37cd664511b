"""Deleting a tenant's Tinker data: what the control plane's tenant DELETE removes for the
training API (`clora.infra.control`), after the tenant was retired (its Tinker keys no longer
open the API, and no learner schedules its runs).

It removes, for every run of the tenant (`clora:tinker:runs`, the runs' own record):

- the run's requests still queued, with their records, its queue, finished count and seq_id
  order (`clora.trainapi.queue`, `clora.trainapi.runs`), then the run's record;
- the run's state checkpoints in the learner's checkpoint storage (`tinker/<run>`);

and the tenant's sessions, sampling sessions and their answers, finished requests' records
(their results are the tenant's data too, though they would expire), and every saved weights
folder (`<checkpoints_dir>/<tenant>/`, and with the S3 store its objects). The versions its
`save_weights_for_sampler` published are ordinary adapter versions of the tenant, removed with
them. Each step is safe to repeat, so a DELETE that failed midway is retried to finish.
"""

from __future__ import annotations

import json
import logging

from clora.checkpoint_storage import CheckpointStorage
from clora.trainapi import queue
from clora.trainapi.runs import seq_key, session_key
from clora.trainapi.sampling import ASAMPLE_KEY, SESSION_KEY as SAMPLING_KEY
from clora.trainapi.weights import CheckpointDir

log = logging.getLogger(__name__)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _matching(r, pattern: str, owned) -> list[str]:
    """The keys matching `pattern` that `owned(keys) -> [bool per key]` says are the tenant's."""
    out = []
    batch: list[str] = []

    def flush() -> None:
        out.extend(k for k, mine in zip(batch, owned(batch)) if mine)
        batch.clear()

    for key in r.scan_iter(match=pattern, count=1000):
        batch.append(_text(key))
        if len(batch) >= 500:
            flush()
    flush()
    return out


def _json_tenant_is(raw, tenant: str) -> bool:
    try:
        return raw is not None and json.loads(raw).get("tenant") == tenant
    except (ValueError, AttributeError):
        return False


def delete_tenant_runs(r, tenant: str, checkpoints: CheckpointStorage | None = None,
                       saved: CheckpointDir | None = None) -> int:
    """Delete every Tinker run, session, request and saved checkpoint of `tenant` (a `redis.Redis`;
    `checkpoints`: the learner's checkpoint storage; `saved`: the saved weights' folders, and
    their S3 store). Returns the runs deleted."""
    runs = [run for run, info in queue.runs(r).items() if info.get("tenant") == tenant]
    for run in runs:
        rids = [_text(rid) for rid in r.lrange(queue.queue_key(run), 0, -1)]
        with r.pipeline(transaction=True) as p:
            p.delete(queue.queue_key(run), queue.run_meta_key(run), seq_key(run), *map(queue.request_key, rids))
            p.execute()
        if checkpoints is not None:
            checkpoints.delete(queue.run_checkpoint_name(run))
        r.hdel(queue.RUNS, run)      # last: the run stays known until its data is gone
    sessions = _matching(r, session_key("*"), lambda ks: [_json_tenant_is(v, tenant) for v in r.mget(ks)] if ks else [])
    sampling = _matching(r, SAMPLING_KEY + "*", lambda ks: [_json_tenant_is(v, tenant) for v in r.mget(ks)] if ks else [])
    sids = {k[len(SAMPLING_KEY):] for k in sampling}      # an answer is `ASAMPLE_KEY{sid}:{seq}`
    answers = _matching(r, ASAMPLE_KEY + "*", lambda ks: [k[len(ASAMPLE_KEY):].rsplit(":", 1)[0] in sids
                                                         for k in ks]) if sids else []

    def request_owners(ks: list[str]) -> list[bool]:
        with r.pipeline(transaction=False) as p:
            for k in ks:
                p.hget(k, "tenant")
            return [v is not None and _text(v) == tenant for v in p.execute()]

    requests = _matching(r, queue.request_key("*"), request_owners)
    doomed = sessions + sampling + answers + requests
    for i in range(0, len(doomed), 500):
        r.unlink(*doomed[i:i + 500])
    if saved is not None:
        saved.delete_tenant(tenant)
    if runs or doomed:
        log.info("deleted tenant %s's Tinker data: %d runs, %d sessions, %d sampling sessions, %d requests",
                 tenant, len(runs), len(sessions), len(sampling), len(requests))
    return len(runs)
