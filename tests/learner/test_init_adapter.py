"""A tenant that starts from an existing PEFT LoRA adapter (`Tenant.init_adapter`): the import
is published as its v1 and training starts from it; a folder that does not fit the layout is
refused before anything is published; a tenant whose checkpoint is lost restarts from its
live version, not from a fresh init (and is not imported again)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clora.registry import LearningPolicy, Tenant
from clora.learner.adapter_store import EXP_AVG, EXP_AVG_SQ, MASTER
from clora.learner.backoff import Backoff
from clora.learner.base_model import load_base_model
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.metrics import LearnerMetrics
from clora.learner.peft_io import WEIGHTS_FILE, read_adapter, write_adapter
from clora.learner.process import Learner
from clora.learner.publish import read_metadata
from clora.learner.settings import LearnerSettings

from .helpers import FakeBuffer, FakeRegistry, sft

LR = 1e-2


def _tenant(tid: str, init_adapter=None, paused: bool = False) -> Tenant:
    return Tenant(id=tid, init_adapter=str(init_adapter) if init_adapter else None,
                  policy=LearningPolicy(algorithm="sft", learning_rate=LR, batch_size=4, min_new_examples=4,
                                        paused=paused))


def _settings(tmp_path, **kw) -> LearnerSettings:
    return LearnerSettings(rank=4, alpha=8, adapters_dir=tmp_path / "adapters", max_seq_len=64,
                           checkpoints_dir=tmp_path / "ckpt", metrics_port=0, idle_sleep_s=0.01, **kw)


def _learner(settings, reg, buf, tiny_model_dir, events=None) -> Learner:
    model, tok = load_base_model(tiny_model_dir)
    events = events if events is not None else []
    return Learner(settings, model, tok, registry=reg, buffer=buf, announce=events.append,
                   base_model_name=str(tiny_model_dir), metrics=LearnerMetrics())


def _peft_folder(folder, layout, seed: int):
    """A PEFT adapter folder with random (non-init-like) weights: (path, flat (P,))."""
    folder.mkdir(parents=True)
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed)) * 0.05
    write_adapter(folder, layout, flat, "tiny-base")
    return folder, flat


def _buffer(tenant: str, n: int = 4) -> FakeBuffer:
    buf = FakeBuffer()
    for i in range(n):
        buf.add(sft(tenant, i, f"q{i}?", "blue"))
    return buf


@pytest.mark.parametrize("mode", ["serial", "fused"])
def test_init_adapter_is_published_as_v1_and_training_starts_from_it(tmp_path, tiny_model_dir, mode):
    reg, buf, events = FakeRegistry(), _buffer("fork"), []
    settings = _settings(tmp_path, training_mode=mode, fused_max_tenants=2)
    lr = _learner(settings, reg, buf, tiny_model_dir, events)
    src, imported = _peft_folder(tmp_path / "my-lora", lr.model.layout, seed=7)
    reg.tenants["fork"] = _tenant("fork", src, paused=True)

    assert lr.tick() is None  # registered (and imported), not trained: paused
    v1 = reg.adapter_versions("fork")
    assert [v.version for v in v1] == [1] and reg.live_version("fork") == 1
    assert (v1[0].step, v1[0].examples_seen, v1[0].eval_scores, v1[0].parent_version) == (0, 0, {}, None)
    assert v1[0].imported_from == str(src) and read_metadata(v1[0].path).imported_from == str(src)
    published = load_file(f"{v1[0].path}/{WEIGHTS_FILE}")
    assert published.keys() == load_file(src / WEIGHTS_FILE).keys()
    assert all(torch.equal(t, load_file(src / WEIGHTS_FILE)[k]) for k, t in published.items())
    assert [(e.action, e.version) for e in events] == [("published", 1)]
    st = lr.store.state("fork")
    assert torch.equal(st.buffer[MASTER], imported) and st.step == 0
    assert not st.buffer[EXP_AVG].any() and not st.buffer[EXP_AVG_SQ].any()

    reg.tenants["fork"] = _tenant("fork", src)
    assert lr.tick() == "fork"
    after = lr.store.state("fork").master  # (the fused copy was written back before publishing)
    # Adam's first step moves each weight by at most the learning rate: it started from the import
    assert 0 < float((after - imported).abs().max()) <= LR * 1.001
    v2 = reg.adapter_versions("fork")[-1]
    assert (v2.version, v2.parent_version, v2.imported_from) == (2, 1, None)
    assert torch.equal(read_adapter(v2.path, lr.model.layout), after)
    lr.shutdown()


def test_adapter_that_does_not_fit_the_layout_is_refused_and_never_trains(tmp_path, tiny_model_dir, caplog):
    reg, buf = FakeRegistry(), _buffer("wrongrank")
    for i in range(4):
        buf.add(sft("wrongkeys", i, f"q{i}?", "blue"))
    lr = _learner(_settings(tmp_path), reg, buf, tiny_model_dir)
    rank2 = LoraModel(load_base_model(tiny_model_dir)[0], LoraSpec(rank=2, alpha=8)).layout
    wrong_rank, _ = _peft_folder(tmp_path / "rank2", rank2, seed=1)
    wrong_keys, _ = _peft_folder(tmp_path / "keys", lr.model.layout, seed=2)
    tensors = load_file(wrong_keys / WEIGHTS_FILE)
    save_file({k.replace("base_model.model.", "model."): t for k, t in tensors.items()}, wrong_keys / WEIGHTS_FILE)
    reg.tenants.update(wrongrank=_tenant("wrongrank", wrong_rank), wrongkeys=_tenant("wrongkeys", wrong_keys))

    with caplog.at_level(logging.ERROR, logger="clora.learner.lifecycle"):
        assert [lr.tick() for _ in range(3)] == [None] * 3
    errors = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert len(errors) == 2  # once each: a refused tenant is not retried every tick
    assert errors[0].startswith("tenant wrongkeys will not train: adapter in ")
    assert "adapter keys do not match" in errors[0]
    assert errors[1].startswith("tenant wrongrank will not train: adapter in ") and "r=2" in errors[1]
    assert "expects r=4" in errors[1]
    assert lr.store.tenants() == [] and lr.lifecycle.rejected == {"wrongrank", "wrongkeys"}
    assert reg.versions == {} and not (tmp_path / "adapters").exists()


def test_lost_checkpoint_restarts_from_the_live_version_not_a_fresh_init(tmp_path, tiny_model_dir):
    reg, buf = FakeRegistry(), _buffer("fork")
    for i in range(4):
        buf.add(sft("acme", i, f"q{i}?", "green"))
    settings = _settings(tmp_path)
    first = _learner(settings, reg, buf, tiny_model_dir)
    src, imported = _peft_folder(tmp_path / "my-lora", first.model.layout, seed=7)
    reg.tenants.update(fork=_tenant("fork", src), acme=_tenant("acme"))
    assert sorted(first.tick() for _ in range(2)) == ["acme", "fork"]
    first.shutdown()
    assert (reg.live_version("acme"), reg.live_version("fork")) == (1, 2)  # fork: v1 imported, v2 trained
    shutil.rmtree(settings.checkpoints_dir)  # checkpoints lost; registry and adapters kept

    reg.tenants.update(fork=_tenant("fork", src, paused=True), acme=_tenant("acme", paused=True))
    second = _learner(settings, reg, buf, tiny_model_dir)
    assert second.tick() is None
    for tenant in ("acme", "fork"):
        live = reg.adapter_versions(tenant)[-1]
        st = second.store.state(tenant)
        assert torch.equal(st.master, read_adapter(live.path, second.model.layout)) and st.step == 0
    assert not torch.equal(second.store.state("fork").master, imported)
    assert [v.version for v in reg.adapter_versions("fork")] == [1, 2]  # not imported again
    second.shutdown()


def test_a_failed_import_backs_its_tenant_off_and_a_deleted_ones_is_dropped_while_the_others_train(
        tmp_path, tiny_model_dir, caplog):
    """An import that fails (a store error, or the tenant deleted while its v1 was written, which
    removes its folder) is the tenant's: the learner trains the others on, retries a failed import
    after its back-off, and forgets a deleted tenant without counting a failure."""
    from clora.learner.publish import PublishError

    buf = _buffer("other")
    for tid in ("flaky", "doomed"):
        for i in range(4):
            buf.add(sft(tid, i, f"q{i}?", "blue"))
    reg = FakeRegistry()
    lr = _learner(_settings(tmp_path), reg, buf, tiny_model_dir)
    src, _ = _peft_folder(tmp_path / "my-lora", lr.model.layout, seed=3)
    reg.tenants.update(other=_tenant("other"), flaky=_tenant("flaky", src), doomed=_tenant("doomed", src))
    real_import = lr.publisher.import_adapter

    def failing_import(tenant, folder):
        if tenant == "doomed":          # deleted meanwhile: its adapters folder is gone
            del reg.tenants["doomed"]
            raise PublishError("publishing doomed v1 failed") from FileNotFoundError("adapters/doomed/.tmp-v1")
        raise PublishError(f"publishing {tenant} v1 failed") from OSError("store unreachable")

    lr.publisher.import_adapter = failing_import
    with caplog.at_level(logging.INFO, logger="clora.learner"):
        assert lr.tick() == "other"
    assert "doomed" not in lr.store and "flaky" not in lr.store
    failures = lr.metrics.registry.get_sample_value
    assert failures("clora_learner_failures_total", {"tenant": "flaky"}) == 1
    assert failures("clora_learner_failures_total", {"tenant": "doomed"}) is None
    assert any("doomed was deleted" in r.getMessage() for r in caplog.records)

    lr.publisher.import_adapter = real_import            # the store is back
    assert lr.tick() is None and "flaky" not in lr.store     # still backing off: not retried yet
    lr.tenants["flaky"].backoff = Backoff(failures=1, wait_s=5.0, retry_at=0.0)   # the back-off is over
    assert lr.tick() == "flaky" and [v.version for v in reg.adapter_versions("flaky")] == [1, 2]
    lr.shutdown()
