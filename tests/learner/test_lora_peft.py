"""PEFT parity: the learner's LoRA forward equals PEFT's, and exported adapters load in PEFT."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from clora.learner.base_model import load_base_model
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.peft_io import AdapterFormatError, read_adapter, write_adapter


def _random_adapter(lm: LoraModel, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(lm.layout.numel, generator=g) * 0.2  # B non-zero: the adapter changes outputs
    return flat


def test_layout_covers_attention_and_mlp(tiny):
    model, _ = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    leaves = {s.name.rsplit(".", 1)[-1] for s in lm.layout.sites}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(lm.layout.sites) == 7 * model.config.num_hidden_layers
    assert not any(p.requires_grad for p in lm.parameters())


def test_saved_adapter_loads_in_peft_with_same_outputs(tiny, tiny_model_dir, tmp_path):
    model, tok = tiny
    spec = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    lm = LoraModel(model, spec)
    flat = _random_adapter(lm)
    lm.bind(lm.layout.views(flat))
    ids = torch.tensor([tok("<|im_start|>user\nhello there<|im_end|>\n")["input_ids"]])
    with torch.no_grad():
        ours = lm(ids)
        with lm.adapter_disabled():
            base = lm(ids)
    write_adapter(tmp_path, lm.layout, flat, str(tiny_model_dir))

    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["peft_type"] == "LORA"
    keys = load_file(tmp_path / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)

    fresh, _ = load_base_model(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(fresh, tmp_path)
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    # Guard against the silent-no-op bug: the adapter must actually change the output ...
    assert (ours - base).abs().max() > 1e-2
    # ... and PEFT must compute the same thing with the weights we exported.
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # Round trip through our reader is exact.
    assert torch.equal(read_adapter(tmp_path, lm.layout), flat)


def test_forward_matches_peft_model_built_in_memory(tiny, tiny_model_dir):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    model, tok = tiny
    spec = LoraSpec(rank=8, alpha=16)
    lm = LoraModel(model, spec)
    flat = _random_adapter(lm, seed=7)
    lm.bind(lm.layout.views(flat))
    fresh, _ = load_base_model(tiny_model_dir)
    peft_model = get_peft_model(fresh, LoraConfig(r=8, lora_alpha=16, target_modules=list(spec.target_modules)))
    result = set_peft_model_state_dict(peft_model, lm.layout.peft_state_dict(flat))
    assert not [k for k in result.unexpected_keys if "lora" in k]
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, lm(ids), rtol=1e-5, atol=1e-5)


def test_prefix_mismatch_fails_loudly(tiny, tmp_path):
    model, _ = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    flat = _random_adapter(lm)
    write_adapter(tmp_path, lm.layout, flat, "tiny")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    # The reference system's bug: keys remapped to a prefix that matches no module.
    save_file({k.replace("base_model.model.model.", "base_model.model."): v for k, v in tensors.items()},
              tmp_path / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="does not match"):
        read_adapter(tmp_path, lm.layout)


def test_rank_mismatch_is_rejected(tiny, tiny_model_dir, tmp_path):
    model, _ = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    write_adapter(tmp_path, lm.layout, _random_adapter(lm), "tiny")
    other = LoraModel(load_base_model(tiny_model_dir)[0], LoraSpec(rank=8, alpha=8))
    with pytest.raises(AdapterFormatError, match="r=4"):
        read_adapter(tmp_path, other.layout)


def test_corrupt_weights_file_is_a_format_error(tiny, tmp_path):
    # a truncated or foreign file must be the learner's AdapterFormatError (which rejects that
    # one tenant), never safetensors' own error (which would stop the learner for everyone)
    model, _ = tiny
    lm = LoraModel(model, LoraSpec(rank=4, alpha=8))
    write_adapter(tmp_path, lm.layout, _random_adapter(lm), "tiny")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x01\x00")
    with pytest.raises(AdapterFormatError, match="reading adapter"):
        read_adapter(tmp_path, lm.layout)
