"""An adapter the megatron learner backend published (tensor parallel 2, two gloo processes) is
served by the session's real vLLM engine exactly as the default backend's adapter from the same
tenant data: the same greedy completions, which are not the base model's."""

from __future__ import annotations

import importlib.util
import shutil
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.integration

_LEARNER_TESTS = Path(__file__).parents[1] / "learner"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"clora_megatron_{name}", _LEARNER_TESTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROMPTS = ["q1?", "what colour is the sky?", "name a fruit", "2+2?"]


def test_a_megatron_published_adapter_serves_the_default_backends_greedy_completions(
        serving, model_dir, redis_client, client_for, tmp_path):
    from clora.ingest.schemas import Message, SFTExample
    from clora.learner.base_model import load_base_model
    from clora.learner.lora import LoraModel, LoraSpec
    from clora.registry import AdapterVersion, Registry

    job_module = _load("megatron_job")
    spec = dict(rank=4, alpha=8.0)
    model, tok = load_base_model(model_dir)
    default = LoraModel(model, LoraSpec(**spec))
    g = torch.Generator().manual_seed(3)
    init = torch.randn(default.layout.numel, generator=g) * 0.2     # far from the base: greedy output moves
    examples = [SFTExample(example_id=f"e{i}", tenant="m", interaction_id=f"i{i}", feedback_event_id=f"f{i}",
                           time=1.0 + i, messages=[Message(role="user", content=p)],
                           target=Message(role="assistant", content="blue"))
                for i, p in enumerate(PROMPTS)]
    sft = dict(algorithm="sft", learning_rate=1e-2, batch_size=4)
    job = {"model_dir": str(model_dir), "spec": spec, "flat": init, "probe": examples[:2], "init": {"m": init},
           "steps": [("m", 1, sft, examples)] * 2}
    (tmp_path / "default").mkdir()
    job_module.run(default, tok, job, tmp_path / "default")
    job_module.torchrun(job, 2, tmp_path / "tp2")

    registry = Registry(redis_client)
    keys, tenants = {}, {}
    for backend in ("default", "tp2"):
        tenants[backend] = tenant = f"t-{uuid.uuid4().hex[:8]}"
        _, keys[backend] = registry.create_tenant(tenant)
        folder = tmp_path / "versions" / tenant / "v1"
        shutil.copytree(tmp_path / backend / "adapter-m", folder)
        registry.record_adapter_version(tenant, AdapterVersion(version=1, path=str(folder), base_model="tiny", step=2))
        registry.set_live_version(tenant, 1)

    def greedy(key: str, model: str) -> list[str]:
        client = client_for(key)
        return [client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                               temperature=0, max_tokens=12).choices[0].message.content
                for p in PROMPTS]

    megatron, reference = greedy(keys["tp2"], tenants["tp2"]), greedy(keys["default"], tenants["default"])
    assert megatron == reference
    base = greedy(keys["default"], serving.engine_settings.base_name)
    assert base != reference, "the adapters do not change the greedy completions: the check would prove nothing"
