"""`clora bench tinker` at its smallest (tiny model, 2 steps, 1 and 2 clients): it stands the
training API, Redis and a learner up in-process, times the SDK, direct and native RL steps and the
concurrent clients, and writes every measurement. Behaviour only: no speed is asserted."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

pytest.importorskip("tinker")

from clora.infra.tinker_bench import TinkerBenchConfig, parse_args, run  # noqa: E402

SPLIT = ("to_learner_s", "fb_request_s", "between_s", "optim_request_s", "back_s")


def test_the_smallest_bench_writes_every_measurement_and_both_paths_take_the_same_step(tmp_path):
    out = tmp_path / "tinker.json"
    config = TinkerBenchConfig(model="tiny", steps=2, clients=(1, 2), batch=4, group_size=2, seq_len=64,
                               micro_batch=4, out=str(out))
    console = Console(record=True, width=300)
    returned = run(config, console)
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["config"]["clients"] == [1, 2] and report["machine"]["cores"] >= 1
    assert report["batch"] == {"sequences": 4, "tokens": 4 * 64, "target_tokens": report["batch"]["target_tokens"]}

    step = report["rl_step"]
    for path in ("sdk", "direct", "native"):
        assert len(step[path]["steps"]) == 2 and all(s["seconds"] > 0 for s in step[path]["steps"])
        assert 0 < step[path]["min_s"] <= step[path]["p50_s"] <= step[path]["max_s"]
    for s in step["sdk"]["steps"]:          # the split accounts for the whole SDK step, on one clock
        assert all(s[k] >= 0 for k in SPLIT) and s["compute_s"] > 0 and s["checkpoint_s"] > 0
        assert sum(s[k] for k in SPLIT) == pytest.approx(s["seconds"], abs=1e-3)
        assert s["compute_s"] + s["checkpoint_s"] + s["executor_s"] <= s["fb_request_s"] + s["optim_request_s"] + 1e-9
    assert step["ratio_mean"] > 0 and step["compute_ratio"] > 0
    # the SDK's advantages are scaled so that Tinker's token sum is the native mean: one step, two roads
    # (Adam moves a weight whose gradient is ~0 by up to lr either way, so the weights get a margin)
    assert step["loss_max_gap"] < 1e-5
    assert step["weights_max_gap"] < 0.25 * step["weights_step_scale"]

    assert [r["clients"] for r in report["concurrency"]] == [1, 2]
    for r in report["concurrency"]:
        for mode in ("sequential", "concurrent"):
            phase = r[mode]
            assert phase["wall_s"] > 0 and phase["steps"] == 2 * r["clients"] and 0 < phase["learner_busy_share"] <= 1
            assert sorted(phase["per_client_steps_s"]) == [f"bench{i}" for i in range(r["clients"])]
            assert all(len(v) == 2 for v in phase["per_client_steps_s"].values())
        assert r["speedup"] == pytest.approx(r["sequential"]["wall_s"] / r["concurrent"]["wall_s"])

    text = console.export_text()
    assert "SDK" in text and "native" in text and "speed-up" in text


def test_bad_settings_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="multiple of --group-size"):
        TinkerBenchConfig(batch=6, group_size=4)
    with pytest.raises(ValueError, match="--clients"):
        TinkerBenchConfig(clients=())
    assert parse_args(["--clients", "1,3", "--model", "smollm2", "--seq-len", "96"]) == (TinkerBenchConfig(
        model="smollm2", clients=(1, 3), seq_len=96), "WARNING")
