"""Two real CPU vLLM engines behind one engine manager: a local child it starts, and a "remote"
one the test starts as a plain `vllm.entrypoints.openai.api_server` with its own API key and
attaches by URL (`EngineSettings.remote_urls`). Each version carries the canary the learner's
publisher computes (`CanaryProbe`, from the tiny base model and the pool adapter): it loads into
both replicas, passes the canary on both, and serves from both; a replica that holds another
adapter under the version's name fails the canary and leaves rotation for that version only,
and rejoins it once a retry loads the right folder."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import torch

from clora.procs import free_port
from clora.serving.aliases import AdapterRef
from clora.serving.engine import EngineManager
from clora.serving.replica import LocalReplica, RemoteReplica
from clora.serving.settings import EngineSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REMOTE_KEY = "remote-engine-key"


def learner_canary(model_dir, folder):
    """The canary the learner's publisher stores for the adapter in `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clora.learner.lora import LoraModel, LoraSpec
    from clora.learner.peft_io import read_adapter
    from clora.learner.publish import CanaryProbe
    from tests.serving.tiny import TARGETS

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lm = LoraModel(base, LoraSpec(rank=8, alpha=16, target_modules=tuple(TARGETS)))
    return CanaryProbe(lm, AutoTokenizer.from_pretrained(model_dir))(read_adapter(folder, lm.layout))


def test_a_version_loads_verified_into_a_local_and_a_remote_engine_and_a_wrong_one_leaves_rotation(
        model_dir, adapter_pool, tmp_path, caplog):
    versions = {v: shutil.copytree(adapter_pool[seed], tmp_path / "acme" / f"v{v}") for v, seed in ((1, 11), (2, 12))}
    refs = {v: AdapterRef("acme", v, str(folder), learner_canary(model_dir, folder)) for v, folder in versions.items()}
    common = dict(model=str(model_dir), max_loras=2, max_cpu_loras=4, max_lora_rank=8, max_model_len=512,
                  max_num_seqs=8, start_timeout_s=400, keep_alive_s=8, health_interval_s=0.5, log_dir=tmp_path / "logs")
    remote_port = free_port()
    remote = LocalReplica(9, remote_port, EngineSettings(**common, ports=[remote_port]), api_key=REMOTE_KEY)
    remote.spawn()                                                     # a vLLM server clora does not manage
    engine = EngineManager(EngineSettings(**common, ports=[free_port()], remote_urls=[remote.url],
                                          remote_api_key=REMOTE_KEY, adapter_retry_s=2.0), adapter_wait_s=30)

    async def complete(lease) -> dict:
        r = await engine.http.post(lease.replica.url + "/v1/completions", headers=lease.replica.headers, timeout=120,
                                   json={"model": lease.model, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    async def lease_on(ref, index: int):
        """A lease for `ref` with every other replica far busier: `index` unless it is out of rotation for `ref`."""
        for r in engine.replicas:
            r.in_flight = 0 if r.index == index else 100
        try:
            async with engine.lease(ref) as lease:
                return lease.replica.index, (await complete(lease))["model"]
        finally:
            for r in engine.replicas:
                r.in_flight = 0

    async def run():
        try:
            await check()
        finally:
            await engine.stop()

    async def check():
        await engine.start()                                           # starts the local child only
        local, attached = engine.replicas
        assert isinstance(local, LocalReplica) and isinstance(attached, RemoteReplica) and attached.url == remote.url
        await remote.wait_ready(engine.http)
        for _ in range(60):                                            # the monitor attaches it once it answers
            if attached.healthy:
                break
            await asyncio.sleep(0.5)
        assert attached.healthy, engine.report()
        # Another party loaded a different adapter under v2's name on the remote engine.
        r = await engine.http.post(remote.url + "/v1/load_lora_adapter", headers=remote.headers,
                                   json={"lora_name": "acme@v2", "lora_path": str(adapter_pool[13])})
        assert r.status_code == 200, r.text

        await engine.preload(refs[1])                                  # into both, canary passing on both
        assert all("acme@v1" in r.resident for r in engine.replicas) and not any(r.refused.items() for r in
                                                                                 engine.replicas)
        assert [await lease_on(refs[1], i) for i in (0, 1)] == [(0, "acme@v1"), (1, "acme@v1")]

        now = [time.monotonic()]                                       # the remote's refusal waits on this clock,
        attached.refused.clock = lambda: now[0]                        # not on how long the local load takes
        await engine.preload(refs[2])                                  # the remote holds the wrong one
        assert "acme@v2" in local.resident and "acme@v2" not in attached.resident
        [refusal] = engine.report()[1]["refused"]
        assert (refusal["adapter"], refusal["reason"]) == ("acme@v2", "canary_mismatch"), refusal
        assert attached.load_failures == {"canary_mismatch": 1}
        assert await lease_on(refs[2], 1) == (0, "acme@v2")            # v2 avoids the remote ...
        assert await lease_on(refs[1], 1) == (1, "acme@v1")            # ... v1 does not

        now[0] += 2.2                                                  # past the retry wait: it was unloaded,
        assert await lease_on(refs[2], 1) == (1, "acme@v2")            # so the retry loads the right folder
        assert engine.report()[1]["refused"] == []

    try:
        with caplog.at_level("INFO", logger="clora.serving.engine"):
            asyncio.run(run())
    finally:
        remote.terminate()
    matched = [m for m in caplog.messages if "matches the version's canary" in m]
    assert len(matched) == 4, caplog.messages                         # v1 on both, v2 locally, v2 on the retry
    print("\n".join(matched))
