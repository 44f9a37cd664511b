"""Base model preparation: tiny test model, local dirs, and the SmolLM2 GGUF conversion (slow)."""

from __future__ import annotations

import pytest

from clora.learner.base_model import (BaseModelError, load_base_model, make_tiny_model,
                                      prepare_base_model)


def test_tiny_model_is_small_llama_with_chat_template(tiny_model_dir):
    model, tok = load_base_model(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 50_000 < model.num_parameters() < 1_000_000
    assert not any(p.requires_grad for p in model.parameters())
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_make_tiny_model_is_idempotent(tiny_model_dir):
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tiny_model_dir) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_local_model_dir_is_used_as_is(tiny_model_dir, tmp_path):
    assert prepare_base_model(tiny_model_dir, tmp_path) == tiny_model_dir
    with pytest.raises(BaseModelError, match="not a HF model directory"):
        prepare_base_model(tmp_path / "nothing", tmp_path)


@pytest.mark.slow
def test_smollm2_converts_once_from_gguf(tmp_path):
    path = prepare_base_model("smollm2", tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert prepare_base_model("smollm2", tmp_path) == path  # idempotent: no second conversion
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    model, tok = load_base_model(path)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert "<|im_start|>" in tok.chat_template
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_a_prepared_model_with_an_older_chat_template_gets_the_current_one(tmp_path):
    import shutil

    from clora.learner.chat_template import TOOL_CHAT_TEMPLATE
    from tests.chat_template import render
    from clora.learner.base_model import refresh_chat_template

    model_dir = make_tiny_model(tmp_path / "tiny")
    assert not refresh_chat_template(model_dir)              # current already: nothing written
    (model_dir / "chat_template.jinja").write_text("{{ 'old' }}")
    assert refresh_chat_template(model_dir)
    _, tok = load_base_model(model_dir)
    tools = [{"type": "function", "function": {"name": "ping"}}]
    messages = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(messages, tools=tools, tokenize=False) == render(messages, tools)
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".")]

    prepared = tmp_path / "cache" / "smollm2-135m-instruct-tools"   # the SmolLM2 cache path, without converting
    shutil.copytree(model_dir, prepared)
    (prepared / "chat_template.jinja").write_text("{{ 'old' }}")
    assert prepare_base_model("smollm2", tmp_path / "cache") == prepared
    assert (prepared / "chat_template.jinja").read_text() == TOOL_CHAT_TEMPLATE
