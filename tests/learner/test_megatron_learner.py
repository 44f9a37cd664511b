"""`clora learner` on the megatron backend: torchrun runs it as two ranks (two tensor-parallel
ranks, or two data-parallel replicas) against the suite's real Kafka-protocol broker and Redis;
it trains and publishes a tenant's versions. Then one rank is killed with -9. The group must not
stall: it stops within 30 s (its timeout is 300 s), and torchrun exits. Started
again, the learner resumes from its checkpoints: no version number is published twice and every
example is trained on exactly once along the weights that live on. Killing the launcher itself
leaves no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from clora.ingest.buffers import BufferPolicy, ReplayBuffer
from clora.checkpoint_storage import LocalCheckpoints
from clora.learner.checkpoint import Checkpoints, tenant_checkpoint
from clora.learner.lora import LoraSpec
from clora.registry import LearningPolicy, Registry

from .helpers import sft

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.integration

REDIS_DB = 11
"""A database of the suite's Redis of its own: this learner trains every tenant it lists, so it
must not see the other tests' tenants."""


def _start(env: dict, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "clora.infra.cli", "learner"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _rank(proc: subprocess.Popen, rank: int) -> psutil.Process | None:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "clora.infra.cli" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (1, 2)], ids=["T2", "T1xD2"])
def test_a_killed_rank_stops_the_group_which_restarts_from_its_checkpoints(
        stack, tiny_model_dir, tenant_id, tmp_path, wait_for, tp, dp):
    import redis

    url = stack.redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    registry = Registry(client)
    registry.create_tenant(tenant_id, policy=LearningPolicy(
        algorithm="sft", learning_rate=1e-2, batch_size=2, min_new_examples=2, fresh_fraction=1.0,
        drift_tolerance=None, reward_guard=False, hacking_guard=False))
    writer = ReplayBuffer(client, BufferPolicy(holdout_fraction=0.0))

    def feed(start: int, n: int) -> None:
        for i in range(start, start + n):
            writer.add_examples(tenant_id, f"fb-{i}", [sft(tenant_id, i, f"q{i}?", "blue")], now=time.time())

    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "CLORA_REDIS_URL": url, "CLORA_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
           "CLORA_LEARNER_BACKEND": "megatron", "CLORA_LEARNER_TENSOR_PARALLEL": str(tp),
           "CLORA_LEARNER_DATA_PARALLEL": str(dp),
           "CLORA_LEARNER_BASE_MODEL": str(tiny_model_dir), "CLORA_LEARNER_RANK": "4", "CLORA_LEARNER_ALPHA": "8",
           "CLORA_LEARNER_MAX_SEQ_LEN": "64", "CLORA_LEARNER_METRICS_PORT": "0", "CLORA_LEARNER_IDLE_SLEEP_S": "0.05",
           "CLORA_LEARNER_LEASE_TTL_S": "2", "CLORA_LEARNER_PARALLEL_TIMEOUT_S": "300",
           "CLORA_LEARNER_ADAPTERS_DIR": str(tmp_path / "adapters"), "CLORA_LEARNER_CHECKPOINTS_DIR": str(ckpt),
           "CLORA_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    checkpoints = Checkpoints(LocalCheckpoints(ckpt), _numel(tiny_model_dir))

    def saved():
        st = checkpoints.load(tenant_checkpoint(tenant_id))
        return (st.step, st.examples_seen) if st is not None else (0, 0)

    log_path = tmp_path / "learner.log"
    with open(log_path, "ab") as log:
        first = _start(env, log)
        try:
            feed(0, 4)
            wait_for(lambda: registry.live_version(tenant_id) == 2 and saved() == (2, 4), timeout=240,
                     what="v2 published and checkpointed by the two-rank learner")
            follower = _rank(first, 1)
            assert follower is not None, "no rank-1 process under torchrun"
            rank0 = _rank(first, 0)
            killed = time.monotonic()
            follower.send_signal(signal.SIGKILL)
            # the group must not stall: rank 0's next collective fails and it exits (or torchrun,
            # seeing rank 1 gone, stops it first), in seconds, far inside the group's timeout
            code = first.wait(timeout=150)
            took = time.monotonic() - killed
            assert code != 0
            assert took < 30, f"the group took {took:.0f} s to stop after rank 1 died"
            assert not psutil.wait_procs([rank0], timeout=5)[1], "rank 0 outlived its group"
            # (rank 0 either met the broken group in a collective and exited, or torchrun stopped it first)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
        feed(4, 4)                                  # accepted while no learner ran
        log.flush()
        offset = log_path.stat().st_size
        second = _start(env, log)
        try:
            wait_for(lambda: saved() == (4, 8) and registry.live_version(tenant_id) == 4, timeout=240,
                     what="the restarted group training the rest from its checkpoint")
            second.send_signal(signal.SIGTERM)   # torchrun passes it on; rank 0 stops the others when done
            second.wait(timeout=120)
            assert "learner stopped" in log_path.read_bytes()[offset:].decode(errors="replace")   # rank 0's graceful stop
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
        # the launcher killed on its own (what `clora up` does to a hung learner kills its process
        # group, and torchrun runs each rank in a session of its own): no rank outlives it
        log.flush()
        offset = log_path.stat().st_size
        third = _start(env, log)
        try:
            wait_for(lambda: b"sharing tenants" in log_path.read_bytes()[offset:], timeout=120,
                     what="the third learner running")
            ranks = [_rank(third, 0), _rank(third, 1)]
            third.send_signal(signal.SIGKILL)
            third.wait(timeout=30)
            gone, alive = psutil.wait_procs(ranks, timeout=30)
            assert not alive, f"ranks {[p.pid for p in alive]} outlived their launcher"
        finally:
            if third.poll() is None:
                os.killpg(third.pid, signal.SIGKILL)
    versions = [v.version for v in registry.adapter_versions(tenant_id)]
    assert versions == [1, 2, 3, 4], versions
    assert saved() == (4, 8)          # 8 examples, batch 2: each trained once
    client.flushdb()


def _numel(model_dir) -> int:
    from clora.learner.base_model import load_base_model
    from clora.learner.lora import LoraModel

    model, _ = load_base_model(model_dir)
    return LoraModel(model, LoraSpec(rank=4, alpha=8)).layout.numel
