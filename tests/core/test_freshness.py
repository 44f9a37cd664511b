"""Freshness records (clora.freshness): a version's lineage keeps each event once, lists at most
its cap and counts the rest, and its summary measures from each event's 202 to the version's
first completion."""

from __future__ import annotations

import pytest

from clora.freshness import FreshnessSummary, VersionLineage, percentile


def test_percentiles_interpolate_between_the_nearest_ranks():
    assert percentile([60.0, 30.0], 50) == 45.0
    assert percentile([30.0, 60.0], 99) == pytest.approx(59.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 90) == 90.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_a_lineage_lists_each_event_once_and_counts_what_is_past_its_cap():
    lineage = VersionLineage().extended([("fb-1", 100.0), ("fb-2", 130.0)], cap=3)
    # fb-1 again (its correction's preference pair), then two new ones: one fits, one is counted
    lineage = lineage.extended([("fb-1", 100.0), ("fb-3", None), ("fb-4", 140.0)], cap=3)
    assert lineage.accepted_at == {"fb-1": 100.0, "fb-2": 130.0, "fb-3": None}
    assert lineage.over_cap == 1 and lineage.events == 4
    assert VersionLineage.model_validate_json(lineage.model_dump_json()) == lineage


def test_a_summary_measures_each_timed_event_and_counts_the_others_unmeasured():
    lineage = VersionLineage(accepted_at={"fb-1": 100.0, "fb-2": 130.0, "fb-old": None}, over_cap=2)
    s = FreshnessSummary.of(lineage, first_served_at=160.0, created_at=150.0)
    assert (s.events, s.unmeasured, s.p50_s, s.published_to_served_s) == (2, 3, 45.0, 10.0)
    assert s.p99_s == pytest.approx(59.7)
    # another host's clock a little ahead: a span below 0 reads 0, not a negative latency
    assert VersionLineage(accepted_at={"fb-9": 161.0}).freshness(160.0) == [0.0]
    empty = FreshnessSummary.of(VersionLineage(), first_served_at=160.0, created_at=None)
    assert (empty.events, empty.p50_s, empty.published_to_served_s) == (0, None, None)
