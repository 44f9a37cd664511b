"""The disk spool (clora.serving.spool): durable appends, acks that survive a restart, and torn or
damaged lines that neither replay nor block the rest."""

from __future__ import annotations

from clora.serving.spool import DiskSpool


def test_spool_append_ack_reopen(tmp_path):
    s = DiskSpool(tmp_path)
    s.append([("t", "k1", "v1"), ("t", "k2", "v2")])
    s.append([("t", "k3", "v3")])
    recs = s.pending(2)
    assert [r.value for r in recs] == ["v1", "v2"]
    s.ack(recs[-1].end)
    s.close()
    s = DiskSpool(tmp_path)  # survives a restart, offset included
    assert [r.value for r in s.pending()] == ["v3"] and s.count() == 1
    with open(s.data, "ab") as f:
        f.write(b'{"topic": "t", "key"')  # a torn write from a crash is not replayed
    assert [r.value for r in s.pending()] == ["v3"]
    s.ack(s.pending()[-1].end)
    assert s.count() == 0


def test_spool_cuts_a_torn_last_line_before_appending_after_it(tmp_path):
    """A crash mid-append leaves half a line; the next append must not be glued to it (the glued
    line could never be read, and every later event would queue behind it)."""
    s = DiskSpool(tmp_path)
    s.append([("t", "k1", "v1")])
    s.close()
    with open(s.data, "ab") as f:
        f.write(b'{"topic": "t", "key"')  # the crash
    s = DiskSpool(tmp_path)
    s.append([("t", "k2", "v2")])
    assert [r.value for r in s.pending()] == ["v1", "v2"] and s.count() == 2
    s.close()
    with open(s.data, "wb") as f:
        f.write(b'{"topic": "t"')  # nothing whole at all
    s = DiskSpool(tmp_path)
    assert s.empty() and s.size() == 0


def test_a_damaged_spool_line_is_set_aside_not_blocking_the_rest(tmp_path):
    s = DiskSpool(tmp_path)
    with open(s.data, "ab") as f:  # damaged by the disk: whole lines that are not records
        f.write(b"\x00\x00garbage\n")
    s.close()
    s = DiskSpool(tmp_path)
    s.append([("t", "k1", "v1")])
    with open(s.data, "ab") as f:
        f.write(b'{"topic": "t"}\n')
    s.append([("t", "k2", "v2")])
    recs = s.pending()
    assert [r.value for r in recs] == ["v1", "v2"]
    s.ack(recs[-1].end)
    assert s.empty()
    rejected = (tmp_path / "rejected.jsonl").read_text().splitlines()
    assert len(rejected) == 2 and "garbage" in rejected[0]
