"""The official `tinker` SDK 0.38, unchanged, drives the training API on the tiny model."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from .conftest import RANK  # noqa: E402


def sft_datum(prompt: list[int], answer: list[int]):
    """Position i predicts token i+1; only the answer's tokens weigh."""
    tokens = prompt + answer
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})


def test_the_sdk_trains_a_lora_run_and_its_summed_loss_decreases(service):
    url, backend = service.url, service.work.backend
    client = tinker.ServiceClient(base_url=url, api_key=service.keys["acme"])
    training = client.create_lora_training_client(base_model="tiny", rank=RANK, train_unembed=True).result()
    data = [sft_datum([10, 11, 12], [40, 41, 42, 43]), sft_datum([20, 21], [40, 41, 42, 43])]
    losses = []
    for _ in range(6):
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(tinker.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8))
        out, _ = fb.result(), step.result()
        losses.append(out.metrics["loss:sum"])
        # the loss is the token sum of -logprob * weight, exactly what the client can rebuild
        nll = sum(-float(np.dot(o["logprobs"].to_numpy(), d.loss_fn_inputs["weights"].to_numpy()))
                  for o, d in zip(out.loss_fn_outputs, data))
        assert nll == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
    assert losses[-1] < 0.8 * losses[0], losses
    info = training.get_info()
    assert info.model_data.model_name == "tiny" and info.lora_rank == RANK
    key = f"acme/tinker/{training.model_id}"
    assert backend.store.peek(key).step == 6
