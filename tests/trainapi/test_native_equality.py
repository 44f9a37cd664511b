"""The SDK's supervised loop through the Tinker API equals the learner's own SFT path on the same data.

The same corrections, encoded by the learner's chat encoder, are trained two ways from the same
LoRA init (the same seed): natively (`Trainer.train_step`, SFT) and by the unchanged SDK
(`forward_backward(cross_entropy)` + `optim_step`, with the native optimizer's settings). Tinker's
loss is the token sum and the learner's the token mean, so step by step `loss:sum / tokens` must
equal the native loss, and since Adam is invariant to a constant gradient scale (up to `eps`), the
weights after every step must match too, to a thousandth of a step's move per step.
"""

from __future__ import annotations

import pytest
import torch

tinker = pytest.importorskip("tinker")

from clora.learner.adapter_store import AdapterStore  # noqa: E402
from clora.learner.base_model import load_base_model  # noqa: E402
from clora.learner.batches import ChatEncoder  # noqa: E402
from clora.learner.lora import LoraModel, LoraSpec  # noqa: E402
from clora.learner.optim import AdamConfig  # noqa: E402
from clora.learner.trainer import Trainer, TrainerConfig, TrainingPolicy  # noqa: E402
from tests.learner.helpers import sft  # noqa: E402

from .conftest import RANK  # noqa: E402

SEED, LR, STEPS = 1234, 1e-2, 4
QA = [("what color is the sky?", "blue"), ("and the grass?", "green, mostly"), ("snow?", "white")]


def test_sdk_supervised_steps_equal_the_native_sft_steps(service):
    model, tok = load_base_model(service.tiny_dir)
    lm = LoraModel(model, LoraSpec(rank=RANK, alpha=2 * RANK))
    adam = AdamConfig(beta1=0.9, beta2=0.999, eps=1e-12, weight_decay=0.0, max_grad_norm=None)   # the SDK's eps
    native = Trainer(lm, ChatEncoder(tok, 64), AdapterStore(lm, prefetch=False),
                     TrainerConfig(micro_batch_size=len(QA), max_seq_len=64, adam=adam))
    native.store.register("native", SEED)
    examples = [sft("native", i, q, a) for i, (q, a) in enumerate(QA)]
    policy = TrainingPolicy(algorithm="sft", learning_rate=LR, batch_size=len(QA))

    data, tokens = [], 0
    for e in examples:
        seq = native.encoder.encode(e.messages, e.target)
        ids = seq.prompt_ids + seq.completion_ids
        weights = [0.0] * (len(seq.prompt_ids) - 1) + [1.0] * len(seq.completion_ids)
        data.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                                 loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}))
        tokens += len(seq.completion_ids)

    client = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    key = f"acme/tinker/{training.model_id}"
    assert torch.equal(service.learner.store.state(key).master, native.store.state("native").master)  # one init

    params = tinker.AdamParams(learning_rate=LR, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps,
                               weight_decay=0.0, grad_clip_norm=0.0)
    losses = []
    for step in range(STEPS):
        out = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(params).result()
        mine = native.train_step("native", examples, policy)
        assert out.metrics["loss:sum"] / tokens == pytest.approx(mine.loss, rel=1e-4), step
        theirs, ours = service.learner.store.state(key).master, native.store.state("native").master
        # each Adam step moves a weight by at most about LR, whatever the gradient's scale;
        # the two paths may differ by a thousandth of that per step (rounding, and eps)
        gap = float((theirs - ours).abs().max())
        assert gap <= 1e-3 * LR * (step + 1), (step, gap)
        losses.append(mine.loss)
    assert losses[-1] < losses[0], losses   # and both paths learned
