"""A local, append-only, fsync'd spool of Kafka records the broker did not take.

Layout in `dir`: `spool.jsonl` (one `{"topic", "key", "value"}` record per line) and
`spool.offset` (byte offset up to which records were acknowledged by the broker). A record
is durable once `append` returns. `pending()` yields what is left; `ack(offset)` moves the
offset (written to a temp file, fsync'd, renamed) and, once everything was sent, empties both
files. Delivery is at least once: a crash between a send and its ack resends the record, and
consumers de-duplicate on the event id.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpooledRecord:
    topic: str
    key: str
    value: str
    end: int
    """Byte offset just past this record's line: `ack(end)` marks it (and all before) sent."""


class DiskSpool:
    def __init__(self, dir: Path | str):
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data = self.dir / "spool.jsonl"
        self.offset_file = self.dir / "spool.offset"
        self.rejected_file = self.dir / "rejected.jsonl"
        self._fh = open(self.data, "ab")
        self._cut_torn_tail()
        size = self._fh.tell()
        self._offset = self._read_offset()
        if self._offset > size:  # crashed between truncating the data and resetting the offset
            self._write_offset(0)

    def _cut_torn_tail(self) -> None:
        """A crash in the middle of `append` leaves part of a line at the end. That record was
        never durable (its `append` did not return); cut it, or the next append would be glued
        to it and make a line no one can read."""
        size = self._fh.tell()
        with open(self.data, "rb") as f:
            end = size
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                newline = f.read(end - start).rfind(b"\n")
                if newline >= 0:
                    end = start + newline + 1
                    break
                end = start
        if end < size:
            self._fh.truncate(end)
            self._fh.seek(end)
            os.fsync(self._fh.fileno())

    def _read_offset(self) -> int:
        try:
            return int(self.offset_file.read_text().strip() or 0)
        except FileNotFoundError:
            return 0

    def _write_offset(self, offset: int) -> None:
        tmp = self.offset_file.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(str(offset))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.offset_file)
        self._offset = offset

    def append(self, records: list[tuple[str, str, str]]) -> None:
        """Durably append (topic, key, value) records: they survive a crash once this returns."""
        if not records:
            return
        lines = b"".join(json.dumps({"topic": t, "key": k, "value": v}).encode() + b"\n" for t, k, v in records)
        self._fh.write(lines)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def size(self) -> int:
        return self._fh.tell()

    def pending_bytes(self) -> int:
        return max(0, self.size() - self._offset)

    def empty(self) -> bool:
        return self._offset >= self.size()

    def pending(self, limit: int = 1000) -> list[SpooledRecord]:
        """Up to `limit` unsent records, oldest first."""
        out: list[SpooledRecord] = []
        with open(self.data, "rb") as f:
            f.seek(self._offset)
            pos = self._offset
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a torn last line from a crash mid-write: never acknowledged, skip
                pos += len(line)
                try:
                    rec = json.loads(line)
                    out.append(SpooledRecord(rec["topic"], rec["key"], rec["value"], pos))
                except (ValueError, KeyError, TypeError):  # a damaged line (the disk, not a crash)
                    self.set_aside({"unreadable_spool_line": line.decode(errors="replace")})
                    log.error("set aside an unreadable line of %s in %s", self.data, self.rejected_file)
                    if out:  # acknowledged with the record before it
                        out[-1] = dataclasses.replace(out[-1], end=pos)
                    else:    # nothing before it to send: passed at once
                        self._write_offset(pos)
                if len(out) >= limit:
                    break
        return out

    def set_aside(self, entry: dict) -> None:
        """Durably keep what can never be sent (an unreadable line, a record the broker refuses
        for good) in `rejected.jsonl`, so that it holds up nothing after it."""
        with open(self.rejected_file, "ab") as f:
            f.write(json.dumps(entry).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def count(self) -> int:
        """Records not yet acknowledged (reads the file: for tests and metrics)."""
        with open(self.data, "rb") as f:
            f.seek(self._offset)
            return sum(1 for line in f if line.endswith(b"\n"))

    def ack(self, end: int) -> None:
        """Mark every record before byte `end` as delivered; empty the spool when all are."""
        if end >= self.size():
            self._fh.truncate(0)
            self._fh.seek(0)
            os.fsync(self._fh.fileno())
            self._write_offset(0)
        else:
            self._write_offset(end)

    def close(self) -> None:
        self._fh.close()
