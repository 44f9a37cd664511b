"""Tiny offline model + PEFT adapters for serving tests.

The model is a 2-layer LlamaForCausalLM with head_dim 64 (a size vLLM's CPU attention
supports) and a byte-level tokenizer with a ChatML template, built in about a second.
Weights are drawn with a large init range so greedy argmax margins are wide: batching and
kernel order cannot flip a token, which the mixed-batch invariant relies on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tokenizer():
    from clora.learner.base_model import byte_level_tokenizer

    return byte_level_tokenizer(CHATML)


def make_model(path: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    tok = _tokenizer()
    cfg = LlamaConfig(
        vocab_size=8 * ((len(tok) + 7) // 8), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    path.mkdir(parents=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def make_adapter(base: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA adapter with random non-zero A and B, so its outputs differ from base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            lora_dropout=0.0, init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft.save_pretrained(out)
    (out / "clora_test.json").write_text(json.dumps({"seed": seed}))
    return out
