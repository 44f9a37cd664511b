"""`clora bench scale` at its smallest (the generated tiny model, tens of events, a few completions):
it runs its cluster (`clora.infra.cluster`), measures ingest and serving with 1 and 2 instances and a
learner's failover, and writes every measurement. Behaviour only: no speed is asserted. And the
pure parts: the options it refuses, tenants that cover every partition, each replica's cores."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from clora.infra.cluster import core_share, partition_of, tenants_over_partitions
from clora.infra.scale_bench import ScaleBench, ScaleBenchConfig


def test_bad_settings_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="--clients and --concurrency"):
        ScaleBenchConfig(clients=1)
    with pytest.raises(ValueError, match="--events"):
        ScaleBenchConfig(events=0)
    with pytest.raises(ValueError, match="--partitions"):
        ScaleBenchConfig(partitions=1)


def test_the_ingest_tenants_cover_every_partition_once():
    tenants = tenants_over_partitions("ing", 4)
    assert [partition_of(t, 4) for t in tenants] == [0, 1, 2, 3]
    assert len(set(tenants)) == 4 and all(t.startswith("ing-") for t in tenants)


def test_each_replica_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert [core_share(i, 2) for i in range(2)] == ["0", "1"]
    assert core_share(0, 1) == "0,1"
    assert [core_share(i, 3) for i in range(3)] == ["0", "1", "0"]     # more replicas than cores: round robin


@pytest.mark.integration
@pytest.mark.slow
def test_the_smallest_bench_writes_every_measurement(tmp_path):
    out = tmp_path / "scale.json"
    config = ScaleBenchConfig(events=40, batch=10, clients=2, requests=4, concurrency=2, max_tokens=4,
                              lease_ttl_s=4.0, out=str(out))
    console = Console(record=True, width=300)
    returned = ScaleBench(config, console, root=tmp_path / "bench").run()
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["config"]["events"] == 40 and report["machine"]["cores"] >= 1 and report["wall_s"] > 0

    for n in (1, 2):
        ingest = report["ingest"][str(n)]
        assert (ingest["instances"], len(ingest["webhooks"])) == (n, n)
        assert (ingest["events"], ingest["accepted"], ingest["stored"], ingest["errors"]) == (40, 40, 40, 0)
        assert ingest["seconds"] > 0 and ingest["events_per_s"] > 0 and ingest["accepted_per_s"] > 0
        serving = report["serving"][str(n)]
        assert (serving["gateways"], serving["replicas"]) == (n, n)
        assert (serving["completed"], serving["errors"], serving["tokens"]) == (4, 0, 16)   # ignore_eos: 4 tokens each
        assert serving["completions_per_s"] > 0 and serving["tokens_per_s"] > 0
        assert 0 < serving["p50_s"] <= serving["p99_s"]
    for key in ("ratio_events_per_s", "ratio_accepted_per_s"):
        assert report["ingest"][key] > 0
    for key in ("ratio_completions_per_s", "ratio_tokens_per_s"):
        assert report["serving"][key] > 0

    failover = report["failover"]
    assert failover["tenant"] == "fail" and failover["killed"] != failover["survivor"]
    assert {failover["killed"], failover["survivor"]} == {"learner-0", "learner-1"}
    assert failover["version_after"] > failover["version_before"] >= 1
    assert 0 < failover["takeover_s"] <= failover["next_version_s"]
    assert failover["bound_s"] == pytest.approx(4.0 + failover["tick_s"])
    assert isinstance(failover["within_bound"], bool)

    text = console.export_text()
    assert "ingest: webhook -> buffer" in text and "serving: tokens/s" in text and "learner failover" in text
