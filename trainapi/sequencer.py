"""Per-model `seq_id` order (docs/tinker-protocol.md §6).

The SDK numbers a training client's requests 1, 2, 3, ... and sends each only after the
previous POST returned (`parallel_fwdbwd_chunks` is off), so a server sees them in order except
for retries. The rule, per model:

    seq_id == next           accepted; next += 1
    seq_id <  next, known    a retried POST: the same request id again, nothing new runs
    anything else            a gap (or a stale id no longer remembered): 400, nothing changes

A request refused after its seq_id was read (an unknown loss, a bad input) still uses up its
seq_id (`refuse`): the SDK moves on to the next one whatever the answer, and a retry of it gets
the same refusal. Accepted requests run in seq_id order: the service enqueues them for the
learner in the order they were accepted. The service keeps each model's order in Redis too
(`clora.trainapi.runs.RunStore`), so a restarted service goes on from the same seq_id.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class SeqError(ValueError):
    """A seq_id out of order: nothing was accepted."""


@dataclass(frozen=True)
class Admitted:
    """What a seq_id already led to: the request id of its future, or the error it was refused
    with (its status and message)."""

    request_id: str | None = None
    refused: tuple[int, str, str] | None = None
    """(status, field, message)."""


class Sequencer:
    def __init__(self, first: int = 1, keep: int = 1024, seen: dict[int, Admitted] | None = None):
        self.next = first
        self.keep = keep
        self._seen: OrderedDict[int, Admitted] = OrderedDict(sorted((seen or {}).items()))

    def check(self, seq_id: int) -> Admitted | None:
        """What `seq_id` already led to (a retry), None when it is the next one; `SeqError`
        for a gap or a stale id. Changes nothing."""
        if seq_id == self.next:
            return None
        if seq_id in self._seen:
            return self._seen[seq_id]
        if seq_id > self.next:
            raise SeqError(f"seq_id {seq_id} is ahead of the next expected {self.next}: requests must come in "
                           "order (an earlier one may have been refused before its seq_id could be read)")
        raise SeqError(f"seq_id {seq_id} is stale: the next expected is {self.next}")

    def accept(self, seq_id: int, request_id: str) -> None:
        self._record(seq_id, Admitted(request_id=request_id))

    def refuse(self, seq_id: int, status: int, field: str, message: str) -> None:
        self._record(seq_id, Admitted(refused=(status, field, message)))

    def dropped_before(self) -> int:
        """seq_ids below this are no longer remembered."""
        return min(self._seen, default=self.next)

    def _record(self, seq_id: int, admitted: Admitted) -> None:
        if seq_id != self.next:
            raise SeqError(f"seq_id {seq_id} is not the next expected {self.next}")
        self._seen[seq_id] = admitted
        self.next += 1
        while len(self._seen) > self.keep:
            self._seen.popitem(last=False)
