"""Publishing: versioned atomic folders, registry + announcement, rollback, crash safety, gate."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from clora.learner.gate import decide
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.peft_io import read_adapter
from clora.learner.publish import Publisher, PublishError, read_metadata

from .helpers import FakeRegistry


@pytest.fixture()
def pub(tiny, tmp_path):
    model, _ = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    events = []
    p = Publisher(tmp_path / "adapters", FakeRegistry(), events.append, "tiny-base", lm.layout)
    return p, events


def _flat(p: Publisher, seed: int) -> torch.Tensor:
    return torch.randn(p.layout.numel, generator=torch.Generator().manual_seed(seed))


def test_publish_writes_records_and_announces(pub):
    p, events = pub
    v1 = p.publish("acme", _flat(p, 1), step=3, examples_seen=24, eval_scores={"eval_loss": 1.5})
    v2 = p.publish("acme", _flat(p, 2), step=6, examples_seen=48, eval_scores={"eval_loss": 1.2}, parent_version=1)
    assert (v1.version, v2.version) == (1, 2)
    folder = p.tenant_dir("acme") / "v2"
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors", "clora_metadata.json"]
    meta = read_metadata(folder)
    assert (meta.step, meta.examples_seen, meta.parent_version, meta.base_model) == (6, 48, 1, "tiny-base")
    assert meta.eval_scores == {"eval_loss": 1.2}
    assert torch.equal(read_adapter(folder, p.layout), _flat(p, 2))
    assert p.registry.live_version("acme") == 2 and [v.version for v in p.registry.adapter_versions("acme")] == [1, 2]
    assert [(e.action, e.version, e.path) for e in events] == [("published", 1, v1.path), ("published", 2, v2.path)]


def test_prune_keeps_the_newest_the_live_one_and_its_ancestors(pub):
    p, _ = pub
    for i in range(1, 9):  # v1..v8, each the child of the one before
        p.publish("acme", _flat(p, i), step=i, examples_seen=i, eval_scores={}, parent_version=i - 1 or None)
    p.rollback("acme", 3)  # the live version is old now
    (p.tenant_dir("acme") / "v0").mkdir()  # a folder a crash left between registry and disk
    assert p.prune("acme", 2) == [4, 5, 6]
    assert [v.version for v in p.registry.adapter_versions("acme")] == [1, 2, 3, 7, 8]  # newest 2; v3, 2 ancestors
    assert p.versions_on_disk("acme") == [1, 2, 3, 7, 8]
    assert torch.equal(p.weights("acme", 8), _flat(p, 8))
    assert p.prune("acme", 0) == [] and p.prune("acme", 2) == []


def test_rollback_makes_earlier_version_live(pub):
    p, events = pub
    for i in range(3):
        p.publish("acme", _flat(p, i), step=i, examples_seen=i, eval_scores={}, parent_version=i or None)
    assert p.rollback("acme").version == 2
    assert p.registry.live_version("acme") == 2
    assert p.rollback("acme", 1).version == 1 and p.registry.live_version("acme") == 1
    assert [e.action for e in events][-2:] == ["rolled_back", "rolled_back"]
    live = p.live_weights("acme")
    assert live.version == 1 and torch.equal(live.flat, _flat(p, 0))
    with pytest.raises(PublishError, match="no recorded version v9"):
        p.rollback("acme", 9)
    # publishing after a rollback never reuses a number
    assert p.publish("acme", _flat(p, 5), step=9, examples_seen=9, eval_scores={}).version == 4


def test_failure_mid_write_leaves_no_visible_version(pub, monkeypatch):
    p, events = pub
    p.publish("acme", _flat(p, 1), step=1, examples_seen=1, eval_scores={})

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr("clora.learner.publish.write_adapter", boom)
    with pytest.raises(PublishError, match="acme v2") as e:
        p.publish("acme", _flat(p, 2), step=2, examples_seen=2, eval_scores={})
    assert isinstance(e.value.__cause__, OSError)
    assert sorted(os.listdir(p.tenant_dir("acme"))) == ["v1"]
    assert p.registry.live_version("acme") == 1 and len(events) == 1
    assert torch.equal(p.live_weights("acme").flat, _flat(p, 1))


def test_process_killed_mid_publish_leaves_live_version_loadable(pub, tiny_model_dir, tmp_path):
    """A real kill (os._exit) between writing the weights and the rename."""
    p, _ = pub
    root = p.root
    script = textwrap.dedent(f"""
        import os, torch
        from clora.learner import peft_io  # noqa: F401
        from clora.learner.base_model import load_base_model
        from clora.learner.lora import LoraModel, LoraSpec
        from clora.learner.publish import Publisher
        from tests.learner.helpers import FakeRegistry
        lm = LoraModel(load_base_model({str(tiny_model_dir)!r})[0], LoraSpec(rank=4, alpha=8))
        p = Publisher({str(root)!r}, FakeRegistry(), print, "tiny-base", lm.layout)
        p.publish("acme", torch.ones(lm.layout.numel), step=1, examples_seen=1, eval_scores={{}})
        real = peft_io.write_adapter
        def dies(folder, *a):
            real(folder, *a)
            os._exit(9)   # killed after the files are written, before the rename
        import clora.learner.publish as pub
        pub.write_adapter = dies
        p.publish("acme", torch.zeros(lm.layout.numel), step=2, examples_seen=2, eval_scores={{}})
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    names = sorted(os.listdir(root / "acme"))
    assert len(names) == 2 and names[0].startswith(".tmp-v2-") and names[1] == "v1"
    assert p.versions_on_disk("acme") == [1]
    assert torch.equal(read_adapter(root / "acme" / "v1", p.layout), torch.ones(p.layout.numel))
    assert p.clean_partial("acme") and os.listdir(root / "acme") == ["v1"]


def test_orphan_folder_is_skipped_not_reused(pub):
    p, _ = pub
    (p.tenant_dir("acme") / "v3").mkdir(parents=True)  # renamed, then crashed before the registry write
    assert p.publish("acme", _flat(p, 1), step=1, examples_seen=1, eval_scores={}).version == 4


def test_gate_publishes_within_tolerance_only():
    assert decide(1.0, None, 0.02).publish
    assert decide(1.01, 1.0, 0.02).publish
    assert not decide(1.05, 1.0, 0.02).publish
    assert "worse than live" in decide(1.05, 1.0, 0.02).reason
    assert not decide(float("nan"), 1.0, 0.02).publish
    # near 0 the absolute floor decides: 0.0098 vs 0.0032 is noise, 0.05 vs 0.0032 is not
    assert not decide(0.0098, 0.0032, 0.02).publish
    assert decide(0.0098, 0.0032, 0.02, min_margin=0.01).publish
    assert not decide(0.05, 0.0032, 0.02, min_margin=0.01).publish
    assert "beyond 0.01" in decide(0.05, 0.0032, 0.02, min_margin=0.01).reason
    assert not decide(1.05, 1.0, 0.02, min_margin=0.01).publish     # far from 0 the relative tolerance rules


def test_only_whole_version_folder_names_count_as_versions(pub):
    pub, _ = pub
    tenant_dir = pub.tenant_dir("acme")
    for name in ("v3", "v12", "v4\n", "v٧", "v5.tmp", "xv6", "v"):  # '٧' is an Arabic-Indic 7
        (tenant_dir / name).mkdir(parents=True)
    assert pub.versions_on_disk("acme") == [3, 12]
    assert pub.next_version("acme") == 13


# --- a Tinker training run's sampler weights (clora.trainapi) ------------------------------

TINKER_PATH = "tinker://s1:train:0/sampler_weights/final"


def test_a_tinker_version_is_recorded_and_servable_but_neither_made_live_nor_announced(pub):
    p, events = pub
    live = p.publish("acme", _flat(p, 1), step=3, examples_seen=24, eval_scores={})
    tinker = p.publish("acme", _flat(p, 2), step=5, examples_seen=0, eval_scores={}, make_live=False,
                       source="tinker", tinker_path=TINKER_PATH)
    assert tinker.version == 2 and (tinker.source, tinker.tinker_path, tinker.parent_version) == \
        ("tinker", TINKER_PATH, None)
    assert p.registry.live_version("acme") == live.version == 1          # serving keeps the live one
    assert [e.version for e in events] == [1]                             # an event would mean "swap to live"
    recorded = p.registry.adapter_versions("acme")[-1]
    assert (recorded.source, recorded.tinker_path) == ("tinker", TINKER_PATH)
    meta = read_metadata(p.tenant_dir("acme") / "v2")
    assert (meta.source, meta.tinker_path, meta.step) == ("tinker", TINKER_PATH, 5)
    assert torch.equal(p.weights("acme", 2), _flat(p, 2))                # a whole PEFT folder, as any version
    assert p.live_weights("acme").version == 1
    # the learner's next version still numbers past it and names the live one as its parent
    assert p.publish("acme", _flat(p, 3), step=4, examples_seen=32, eval_scores={}, parent_version=1).version == 3


def test_a_learner_version_is_recorded_with_no_source(pub):
    p, _ = pub
    v = p.publish("acme", _flat(p, 1), step=1, examples_seen=1, eval_scores={})
    assert (v.source, v.tinker_path) == (None, None)
    assert read_metadata(p.tenant_dir("acme") / "v1").source is None


def test_prune_counts_the_learners_versions_apart_and_keeps_every_named_tinker_version(pub):
    p, _ = pub
    made = {}
    for i in range(1, 11):   # learner, unnamed Tinker, named Tinker, in turn
        kind = ("learner", "unnamed", "named")[i % 3]
        made[i] = kind
        if kind == "learner":
            p.publish("acme", _flat(p, i), step=i, examples_seen=i, eval_scores={})
        else:
            p.publish("acme", _flat(p, i), step=i, examples_seen=0, eval_scores={}, make_live=False, source="tinker",
                      tinker_path=f"tinker://s1:train:0/sampler_weights/n{i}" if kind == "named" else None)
    assert made == {1: "unnamed", 2: "named", 3: "learner", 4: "unnamed", 5: "named", 6: "learner",
                    7: "unnamed", 8: "named", 9: "learner", 10: "unnamed"}
    assert p.registry.live_version("acme") == 9
    gone = p.prune("acme", 2)
    assert gone == [1, 3, 4]      # the oldest learner version and all but the newest 2 unnamed Tinker ones
    assert [v.version for v in p.registry.adapter_versions("acme")] == [2, 5, 6, 7, 8, 9, 10]
    assert p.versions_on_disk("acme") == [2, 5, 6, 7, 8, 9, 10]


def test_rollback_by_default_goes_to_the_learners_previous_version_never_a_tinker_one(pub):
    p, _ = pub
    p.publish("acme", _flat(p, 1), step=1, examples_seen=1, eval_scores={})
    p.publish("acme", _flat(p, 2), step=2, examples_seen=0, eval_scores={}, make_live=False, source="tinker")
    p.publish("acme", _flat(p, 3), step=3, examples_seen=3, eval_scores={}, parent_version=1)
    assert p.rollback("acme").version == 1
    with pytest.raises(PublishError, match="no version older"):
        p.rollback("acme")
    assert p.rollback("acme", 2).version == 2        # named explicitly: an operator's choice
