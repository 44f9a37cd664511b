"""The pure parts of `clora bench freshness`: each event's freshness split into learning and
serving, a row's percentiles against the publish -> served baseline, the learner's profile from
its metrics history, and which trainable events were never served."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from rich.console import Console

from clora.freshness import VersionLineage
from clora.ingest.buffers import BufferPolicy, is_heldout
from clora.infra.freshness_bench import (EventFreshness, FreshnessBenchConfig, VersionServed, _unserved,
                                         learner_profile, read_freshness, summarize, table)
from clora.registry import AdapterVersion


def test_an_events_freshness_is_its_learning_plus_its_versions_serving():
    e = EventFreshness("acme", "fb-1", 3, accepted_at=100.0, created_at=150.0, first_served_at=160.0)
    assert (e.freshness_s, e.learning_s, e.serving_s) == (60.0, 50.0, 10.0)


def test_a_row_reports_event_percentiles_and_the_baseline_over_versions_with_events():
    events = [EventFreshness("a", f"fb-{i}", 1, 100.0 - s, 98.0, 100.0) for i, s in enumerate((10.0, 20.0, 30.0))]
    versions = [VersionServed("a", 1, 2.0, 3), VersionServed("a", 2, 40.0, 0)]   # v2: imported, no events
    row = summarize(events, versions, sent=4)
    assert (row["sent"], row["measured"], row["versions"], row["p50_s"]) == (4, 3, 1, 20.0)
    assert row["published_to_served_p50_s"] == 2.0 and row["learning_p50_s"] == 18.0
    assert row["serving_share"] == pytest.approx(6.0 / 60.0)
    assert summarize([], [], sent=0)["p50_s"] is None


def test_the_learners_profile_pairs_each_publish_with_its_step():
    points = [{"time": 10.0, "step": 1, "loss": 2.0, "seconds": 3.0},
              {"time": 14.0, "step": 1, "eval": 1.5, "version": 1},          # gate + publish: 4 s
              {"time": 20.0, "step": 2, "loss": 1.0, "seconds": 5.0},        # the gate refused it: no publish
              {"time": 30.0, "failed": "OSError: disk full"}]
    assert learner_profile(points) == {"steps": 2, "publishes": 1, "step_s": 4.0, "gate_publish_s": 4.0}


def test_unserved_events_are_the_trainable_ones_no_served_version_holds():
    fraction = BufferPolicy().holdout_fraction
    sent = [f"fb-{i}" for i in range(40)]
    trainable = [e for e in sent if not is_heldout(f"{e}:sft", fraction)]
    assert 0 < len(trainable) < len(sent)                     # some are held out: never trained, never waited for
    assert _unserved(sent, set(trainable[:5])) == trainable[5:]


@pytest.mark.integration
def test_the_report_reads_each_served_versions_events_from_the_registry(registry, tenant_id):
    registry.create_tenant(tenant_id)
    for v, events in ((1, {"fb-1": 100.0, "fb-2": None}), (2, {"fb-3": 200.0})):
        registry.record_lineage(tenant_id, v, VersionLineage(accepted_at=events))
        registry.record_adapter_version(tenant_id, AdapterVersion(version=v, path=f"/a/v{v}", base_model="b",
                                                                  created_at=100.0 * v + 20))
    registry.claim_first_served(tenant_id, 1, 125.0)                         # v2 never served
    events, versions = read_freshness(registry, tenant_id)
    assert events == [EventFreshness(tenant_id, "fb-1", 1, 100.0, 120.0, 125.0)]
    assert versions == [VersionServed(tenant_id, 1, 5.0, 1)]
    row = {"tenant": tenant_id, **summarize(events, versions, 3), "unserved": ["fb-3"],
           "learner": {"steps": 2, "publishes": 2, "step_s": 1.0, "gate_publish_s": 0.5}, "gate_rejections": 0.0}
    report = {"config": asdict(FreshnessBenchConfig()), "rows": [row], "all": summarize(events, versions, 3)}
    console = Console(width=400, record=True)
    console.print(table(report))
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in console.export_text().splitlines()]
    rows = {c[0]: c for c in cells if c and c[0] in (tenant_id, "all")}
    assert rows[tenant_id][2] == rows["all"][2] == "1 (1)"                    # measured (unserved)


def test_a_benchmarks_data_folder_goes_when_it_succeeds_and_stays_when_it_fails(tmp_path):
    from clora.infra.bench_platform import PlatformLauncher

    def launcher(name: str) -> PlatformLauncher:
        root = tmp_path / name
        (root / "run-0").mkdir(parents=True)
        return PlatformLauncher(model="smollm2", models_dir=".clora/models", slots=1, training_mode="serial",
                                root=root)

    console = Console(record=True, width=200)
    ok, kept, failed = launcher("ok"), launcher("kept"), launcher("failed")
    with ok.data_kept_on_failure(keep=False, console=console):
        pass
    with kept.data_kept_on_failure(keep=True, console=console):
        pass
    with pytest.raises(RuntimeError, match="engine died"):
        with failed.data_kept_on_failure(keep=False, console=console):
            raise RuntimeError("engine died")
    assert not ok.root.exists() and (kept.root / "run-0").exists() and (failed.root / "run-0").exists()
    assert console.export_text().strip() == f"failed: platform logs kept under {failed.root}"
