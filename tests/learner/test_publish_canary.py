"""Each published version's canary (clora.learner.publish.CanaryProbe, clora.canary): the learner's
log-probabilities of a fixed prompt with and without the version, which every serving replica
must reproduce. They equal PEFT's on the published folder, and the probe leaves the model as it
found it."""

from __future__ import annotations

import torch
from peft import PeftModel

from clora.learner.base_model import load_base_model
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.publish import CanaryProbe, Publisher, read_metadata

from .helpers import FakeRegistry


def _flat(lm: LoraModel, seed: int) -> torch.Tensor:
    return torch.randn(lm.layout.numel, generator=torch.Generator().manual_seed(seed)) * 0.2


def _peft_logprobs(model, ids: list[int]) -> list[float]:
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=t).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, t[0, 1:, None]).squeeze(-1).tolist()


def test_a_published_versions_canary_is_what_peft_computes_from_its_folder(tiny, tiny_model_dir, tmp_path):
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    lm.train()                                                   # as the trainer leaves it
    other = lm.layout.views(_flat(lm, 7))
    lm.bind(other)                                               # another tenant is bound
    registry = FakeRegistry()
    p = Publisher(tmp_path / "adapters", registry, lambda e: None, "tiny-base", lm.layout, canary=CanaryProbe(lm, tok))
    v = p.publish("acme", _flat(lm, 1), step=3, examples_seen=8, eval_scores={})

    canary = v.canary
    assert canary is not None and canary.dtype == "float32" and len(canary.prompt_token_ids) > 8
    assert read_metadata(p.tenant_dir("acme") / "v1").canary == canary
    assert registry.adapter_versions("acme")[0].canary == canary
    assert lm.bank.params is other and lm.training and all(m.training for m in lm.modules() if m is not lm.model)

    fresh, _ = load_base_model(tiny_model_dir)
    base = _peft_logprobs(fresh, canary.prompt_token_ids)
    peft = PeftModel.from_pretrained(fresh, p.tenant_dir("acme") / "v1").eval()
    adapter = _peft_logprobs(peft, canary.prompt_token_ids)
    torch.testing.assert_close(torch.tensor(canary.logprobs), torch.tensor(adapter), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(canary.base_logprobs), torch.tensor(base), rtol=0, atol=1e-5)
    assert canary.separation() > 0.05                            # a trained-looking adapter: the canary tells


def test_a_probe_that_fails_costs_the_version_its_canary_not_its_publish(tiny, tmp_path, caplog):
    model, _ = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))

    def broken(flat):
        raise RuntimeError("out of memory")

    p = Publisher(tmp_path / "adapters", FakeRegistry(), lambda e: None, "tiny-base", lm.layout, canary=broken)
    v = p.publish("acme", _flat(lm, 1), step=1, examples_seen=1, eval_scores={})
    assert v.version == 1 and v.canary is None and "no canary for acme v1: out of memory" in caplog.text


def test_the_base_half_is_computed_once_and_weights_seen_just_before_cost_no_forward(tiny, tmp_path):
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    probe = CanaryProbe(lm, tok)
    forwards = []
    lm.model.register_forward_hook(lambda m, i, out: forwards.append(1))
    p = Publisher(tmp_path / "adapters", FakeRegistry(), lambda e: None, "tiny-base", lm.layout, canary=probe)
    start = _flat(lm, 1)
    first = p.publish("acme", start, step=0, examples_seen=0, eval_scores={}).canary
    assert len(forwards) == 2                                    # the version's and the base's
    again = p.publish("globex", start.clone(), step=0, examples_seen=0, eval_scores={}).canary
    assert len(forwards) == 2 and again == first                 # a second tenant from the same start
    trained = p.publish("acme", _flat(lm, 2), step=1, examples_seen=4, eval_scores={}).canary
    assert len(forwards) == 3                                    # the version's only
    assert trained == CanaryProbe(lm, tok)(_flat(lm, 2)) and trained.logprobs != first.logprobs
    for seed in range(3, 3 + CanaryProbe.REMEMBERED):            # the start falls out of the last few
        probe(_flat(lm, seed))
    before = len(forwards)
    assert probe(start) == first and len(forwards) == before + 1
