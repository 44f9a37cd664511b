"""Training behaviour on a tiny fixed-seed model: known loss curve, and each algorithm learns."""

from __future__ import annotations

import pytest
import torch

from clora.ingest.schemas import Message
from clora.learner.adapter_store import AdapterStore
from clora.learner.batches import ChatEncoder
from clora.learner.losses import token_logprobs
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.trainer import Trainer, TrainerConfig, TrainingPolicy

from .helpers import pref, rl, sft, sft_set


def _trainer(tiny, **spec) -> Trainer:
    model, tok = tiny
    lm = LoraModel(model, LoraSpec(**({"rank": 4, "alpha": 8} | spec)))
    return Trainer(lm, ChatEncoder(tok, 64), AdapterStore(lm))


KNOWN_CURVE = [7.5188, 5.95104, 3.97379, 2.38714, 1.33387, 0.63325]
"""SFT, tiny model seed 0, tenant seed 0, rank 4 / alpha 8, lr 1e-2, 4 examples of answer 'blue'."""


def test_known_good_loss_curve(tiny):
    tr = _trainer(tiny)
    tr.store.register("acme", seed=0)
    policy = TrainingPolicy(learning_rate=1e-2, batch_size=4)
    losses = [tr.train_step("acme", sft_set("acme", "blue"), policy).loss for _ in range(len(KNOWN_CURVE))]
    assert losses == pytest.approx(KNOWN_CURVE, abs=2e-3)


def test_lm_head_on_target_positions_matches_the_full_forward(tiny):
    tr = _trainer(tiny)
    tr.store.register("acme", seed=0)
    tr.store.activate("acme")
    assert tr._head is not None                    # a Llama-style model: the head can be split off
    batch = tr.encoder.sft([sft("acme", 0, "a longer question?", "blue"), sft("acme", 1, "q?", "green sky")])
    where = batch.loss_mask.bool()
    full = token_logprobs(tr.model(batch.input_ids, batch.attention_mask), batch.input_ids)
    only = tr._logprobs(batch)
    assert torch.allclose(only[where], full[where], atol=1e-5) and not only[~where].any()


def _greedy(tr: Trainer, tenant: str, question: str, n: int) -> str:
    from clora.ingest.schemas import Message

    tr.store.activate(tenant)
    seq = tr.encoder.encode([Message(role="user", content=question)], Message(role="assistant", content="x"))
    ids = torch.tensor([seq.prompt_ids])
    with torch.no_grad():
        out = tr.model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                      pad_token_id=tr.encoder.tok.pad_token_id)
    return tr.encoder.tok.decode(out[0, ids.shape[1]:])


def test_sft_makes_each_tenant_produce_its_own_target(tiny):
    tr = _trainer(tiny)
    targets = {"acme": "blue sky", "beta": "red fox"}
    for i, t in enumerate(targets):
        tr.store.register(t, seed=i)
    policy = TrainingPolicy(learning_rate=1e-2, batch_size=4)
    for _ in range(15):
        for t, answer in targets.items():
            tr.train_step(t, sft_set(t, answer), policy)
    for t, answer in targets.items():
        assert _greedy(tr, t, "q2?", len(answer)) == answer


def test_dpo_prefers_chosen_over_rejected(tiny):
    tr = _trainer(tiny)
    tr.store.register("acme", seed=0)
    policy = TrainingPolicy(algorithm="dpo", learning_rate=1e-2, batch_size=4, dpo_beta=0.5)
    pairs = [pref("acme", i, f"q{i}?", "yes", "no") for i in range(4)]
    losses = [tr.train_step("acme", pairs, policy).loss for _ in range(8)]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # fresh adapter == reference: log 2
    assert losses[-1] < 0.2 and all(b < a for a, b in zip(losses, losses[1:]))
    assert tr.eval_loss("acme", [pref("acme", 9, "q9?", "yes", "no")], policy) < 0.3  # generalises to a new prompt


def test_rl_moves_probability_to_rewarded_completions(tiny):
    tr = _trainer(tiny)
    tr.store.register("acme", seed=0)
    enc = tr.encoder
    samples = []
    for i in range(4):  # one group per prompt: a rewarded and an unrewarded rollout
        for j, (answer, reward) in enumerate((("42", 1.0), ("17", 0.0))):
            s = rl("acme", 10 * i + j, f"q{i}?", answer, reward, f"g{i}")
            seq = enc.encode(s.messages, s.response)
            ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
            with torch.no_grad(), tr.model.adapter_disabled():  # the serving-time (behaviour) policy
                lp = token_logprobs(tr.model(ids), ids)[0, len(seq.prompt_ids) - 1:]
            samples.append(rl("acme", 10 * i + j, f"q{i}?", answer, reward, f"g{i}",
                              prompt_token_ids=seq.prompt_ids, completion_token_ids=seq.completion_ids,
                              behaviour_logprobs=lp.tolist()))
    policy = TrainingPolicy(algorithm="rl", learning_rate=1e-2, batch_size=8, rl_clip_eps=0.2)
    good_nll_before = tr.eval_loss("acme", samples, policy)
    losses = [tr.train_step("acme", samples, policy).loss for _ in range(6)]
    assert losses[0] == pytest.approx(0.0, abs=1e-5)  # ratio 1 and zero-mean advantages
    # Rewarded ratios rise to the clip (1.2), unrewarded fall to it (0.8): the surrogate's floor
    # with advantages +-1 is (-1.2 + 0.8) / 2 = -0.2, where the clipped tokens stop the gradient.
    assert losses[1] < losses[0] and losses[-1] == pytest.approx(-0.2, abs=0.02) and min(losses) > -0.2 - 1e-4
    assert tr.eval_loss("acme", samples, policy) < good_nll_before - 0.5


def test_validation_of_policies():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        TrainingPolicy(algorithm="ppo")
    with pytest.raises(ValidationError):
        TrainingPolicy(learning_rate=0)
    with pytest.raises(ValidationError):
        TrainingPolicy(rl_clip_eps=1.5)


def test_tool_calls_encode_as_the_serving_template_renders_them(tmp_path):
    """The learner tokenizes a tool-use correction exactly as vLLM renders it (same template):
    prompt tokens + completion tokens == tokens of the template's full rendering."""
    from tests.chat_template import render
    from clora.learner.base_model import load_base_model, make_tiny_model
    from clora.learner.batches import ChatEncoder

    _, tok = load_base_model(make_tiny_model(tmp_path / "tiny"))
    tools = [{"type": "function", "function": {"name": "calculator", "description": "math",
                                               "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    prompt = [Message(role="system", content="Use tools."), Message(role="user", content="17*3?")]
    call = Message(role="assistant", tool_calls=[{"id": "c1", "function": {"name": "calculator",
                                                                          "arguments": '{"expression": "17*3"}'}}])
    seq = ChatEncoder(tok).encode(prompt, call, tools)
    text = render([m.model_dump(exclude_none=True) for m in prompt + [call]], tools)
    assert tok.decode(seq.prompt_ids + seq.completion_ids) == text.rstrip("\n")
    completion = tok.decode(seq.completion_ids)
    assert completion == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*3"}}\n</tool_call><|im_end|>'
    assert "- calculator(expression?: string): math" in tok.decode(seq.prompt_ids)


def _grads_and_logprobs(tr: Trainer, batch, share: bool):
    from clora.learner.trainer import target_logprobs

    slot = tr.store.activate("acme")
    params = [p for pair in slot.params for p in pair]
    lp = target_logprobs(tr.model, tr._head, batch, share_prefix=share)
    grads = torch.autograd.grad((lp * batch.loss_mask).sum(), params)
    return lp.detach(), grads


def test_a_shared_prompt_runs_once_with_the_same_logprobs_and_gradients(tiny):
    from clora.learner.trainer import shared_prefix_len

    tr = _trainer(tiny)
    tr.store.register("acme", seed=0)
    question = "Which colour is a clear sky?"
    sft_batch = tr.encoder.sft([sft("acme", i, question, ans) for i, ans in enumerate(["blue", "green sky", "no"])])
    rl_batch = tr.encoder.rl([rl("acme", i, question, ans, reward=float(i), group="g")
                              for i, ans in enumerate(["blue", "red", "sky blue"])],
                             torch.tensor([-1.0, 0.0, 1.0]))
    for batch in (sft_batch, rl_batch):
        p = shared_prefix_len(batch)
        first_read = int(batch.loss_mask.bool().any(0).nonzero()[0])
        assert p >= len(question) and p <= first_read       # the question is shared; no target in it
        assert torch.equal(batch.input_ids[:, :p], batch.input_ids[:1, :p].expand(3, -1))
        lp_shared, g_shared = _grads_and_logprobs(tr, batch, share=True)
        lp_rows, g_rows = _grads_and_logprobs(tr, batch, share=False)
        assert torch.allclose(lp_shared, lp_rows, atol=1e-5)
        for a, b in zip(g_shared, g_rows):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_shared_prefix_len_stops_where_rows_differ_or_a_loss_reads():
    from clora.learner.batches import TokenBatch
    from clora.learner.trainer import SHARED_PREFIX_MIN_TOKENS as M
    from clora.learner.trainer import shared_prefix_len

    def batch(rows, first_target):
        ids = torch.tensor(rows)
        loss = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        loss[:, first_target:] = 1
        return TokenBatch(ids, torch.ones_like(ids), loss)

    same = list(range(1, M + 11))
    assert shared_prefix_len(batch([same, same[:M + 3] + [0] * 7], first_target=M + 8)) == M + 3
    assert shared_prefix_len(batch([same, same], first_target=M + 1)) == M + 1
    assert shared_prefix_len(batch([same, same[:M - 1] + [0] * 11], first_target=M + 8)) == 0  # too short
    assert shared_prefix_len(batch([same], first_target=M + 8)) == 0                           # one row


def test_autocast_runs_the_forward_s_matmuls_in_bf16_and_keeps_weights_and_state_fp32(tiny):
    model, tok = tiny
    seen = []
    model.get_decoder().layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    store = AdapterStore(lm)
    runs = {mode: Trainer(lm, ChatEncoder(tok, 64), store, TrainerConfig(autocast=mode)) for mode in ("off", "bfloat16")}
    policy = TrainingPolicy(learning_rate=1e-2, batch_size=4)
    losses = {}
    for mode, tr in runs.items():
        store.register(mode, seed=0)                       # the same start for both
        seen.clear()
        losses[mode] = [tr.train_step(mode, sft_set(mode, "blue"), policy).loss for _ in range(4)]
        assert set(seen) == {torch.bfloat16 if mode == "bfloat16" else torch.float32}
        assert store.peek(mode).buffer.dtype == torch.float32     # master weights, Adam moments, grads
    # bf16 products (8 mantissa bits) move the loss by a few parts in a hundred, not the curve
    assert losses["bfloat16"] == pytest.approx(losses["off"], rel=5e-2)
    assert losses["bfloat16"] != losses["off"] and losses["bfloat16"][-1] < losses["bfloat16"][0] / 2


def test_autocast_is_a_cpu_setting_where_a_bf16_compute_dtype_is_not():
    from pydantic import ValidationError

    from clora.learner.settings import LearnerSettings

    assert LearnerSettings(device="cpu", autocast="bfloat16").autocast == "bfloat16"
    with pytest.raises(ValidationError, match="compute_dtype"):
        LearnerSettings(device="cpu", compute_dtype="bfloat16")
    with pytest.raises(ValidationError, match="autocast"):
        LearnerSettings(autocast="float16")
