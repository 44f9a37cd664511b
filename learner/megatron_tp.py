"""The `megatron` learner backend: the frozen base as a megatron-core `GPTModel` split over T
tensor-parallel ranks, in D data-parallel replicas, with each tenant's LoRA on its parallel
linear layers.

Owns:
- `init_parallel(T, D)`: the process group of T x D ranks (gloo on CPU, NCCL on GPU) and
  megatron's model-parallel state (D tensor-parallel groups of T consecutive ranks), with the CPU
  fixes megatron-core 0.16.1 needs (see `_cpu_fixes`).
- `DataSplit`: how a forward's batch rows are split over the replicas and put back together.
- `build_gpt(hf_dir)`: a Llama-family Hugging Face checkpoint (SmolLM2 by default) as a
  `GPTModel` with the local (non-Transformer-Engine) layer spec, each rank loading only its
  shards from the safetensors files.
- `MegatronLoraModel`: what the learner trains through, with `LoraModel`'s interface (`layout`,
  `bank`, `bind`, `adapter_disabled`, `forward` giving (B, T, V) logits), so the trainer, the
  publish gate, the drift guard, the canary and the Tinker backend run on it unchanged.
- `follow(model)`: what ranks other than 0 run.

**Where the adapter lives.** A tenant's adapter keeps the Hugging Face (PEFT) layout of
`LoraLayout` and stays whole on every rank: the swapped per-tenant state (weights, Adam moments,
RNG) is the same (4, P) buffer as the default backend's, the checkpoints are the same files, and
publishing needs no gather, since rank 0 already holds the whole adapter. What is split is the
arithmetic, consistently with each parallel layer:

    column-parallel (q, k, v in linear_qkv; gate, up in linear_fc1), x replicated:
        delta_r = B[rows of rank r] @ copy_to_tp(A @ x)          A whole, B split by output rows
    row-parallel (o in linear_proj; down in linear_fc2), x split by input columns:
        delta   = B @ reduce_from_tp(A[:, columns of rank r] @ x_r)   A split by input, B whole

so each rank's backward fills the gradient of its own rows of B (column) or columns of A (row)
and the whole gradient of the rest. `reduce_grads` sums the split parts over the ranks after
each backward; every rank then holds the same whole gradient the default backend computes.

**How the ranks stay in step.** Rank 0 runs the learner (Kafka, Redis, scheduling, losses,
optimizer, publishing); the other ranks hold their shards of the base and follow: before each
forward, rank 0 broadcasts what to run (token ids, mask, the bound LoRA weights, whether the
adapter is enabled, training mode and the dropout RNG state), and every rank runs the same
forward. The logits' vocabulary shards are gathered to rank 0, which computes the loss; in
the backward, rank 0 sends each rank the gradient of its logits shard, and every rank runs the
same backward through its shard (collectives inside match because the graphs are the same and
autograd runs them in the same order). One process's graphs never interleave: the learner
calls the model from one thread.

**Data parallel.** With D > 1 every rank still receives the whole batch, but replica d (the
tensor-parallel group of ranks d*T .. d*T+T-1) runs only its rows (`row_slices`: uneven splits
and empty slices are fine), drawing LoRA dropout masks for the whole batch and keeping its rows,
so the masks are the default backend's. Rank 0 gathers every replica's shards into the whole
batch's logits and computes the loss over all of it, as before; each replica runs the backward of
its rows, and `reduce_grads` sums the gradients over every rank (the whole parts once per
replica), so rank 0 holds the whole batch's gradient. The adapter state stays on rank 0.

**Failures.** Anything that goes wrong between a header and the end of its collectives (a
collective that fails, or a rank's own part that raises) leaves the other ranks waiting in a
collective this rank will never join: `_collective` treats it as a broken group, and the learner
process exits at once (`EXIT_GROUP_BROKEN`). Its closed connections fail the others' pending
collectives within moments; they exit too, and torchrun, seeing a rank exit non-zero, stops
whatever is left. Nobody waits out `parallel_timeout_s`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from clora.learner.lora import LoraBank, LoraLayout, LoraSpec, dropout_keep

log = logging.getLogger(__name__)

COLUMN_SITES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_SITES = ("o_proj", "down_proj")
SITES = COLUMN_SITES + ROW_SITES


class MegatronBackendError(RuntimeError):
    """The base model or the settings cannot run on the megatron backend."""


class ParallelGroupError(BaseException):
    """A collective failed: another rank died or stopped answering. Not an `Exception`, so the
    learner's per-tenant error handling cannot take it for one tenant's failed step and train on
    with a group that can never answer again."""


EXIT_GROUP_BROKEN = 75
"""The learner's exit status when its process group broke (torchrun then stops the other ranks,
and whoever runs the learner starts it again, from its checkpoints)."""


# --- process group and megatron's parallel state ----------------------------------------------


def init_parallel(tp: int, dp: int = 1, *, timeout_s: float = 600.0) -> None:
    """Join the process group torchrun set up (or a single-process one) of `tp` x `dp` ranks and
    split it into `dp` tensor-parallel groups of `tp` consecutive ranks (megatron's order: world
    rank = dp_rank * tp + tp_rank). Every rank calls this before building the model."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" not in os.environ:   # one process on its own: a group of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != tp * dp:
        raise MegatronBackendError(
            f"CLORA_LEARNER_TENSOR_PARALLEL ({tp}) x CLORA_LEARNER_DATA_PARALLEL ({dp}) = {tp * dp} processes, "
            f"but this group has {world}: launch tensor_parallel x data_parallel processes")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    # Dropout is 0 in the frozen base, so megatron's RNG tracker only needs to exist: the inference
    # tracker never touches CUDA (the default one reads the CUDA RNG state on creation).
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not torch.cuda.is_available():
        _cpu_fixes()
    rank = dist.get_rank()
    if rank != dp_rank() * tp + tp_rank():
        raise MegatronBackendError(f"megatron placed rank {rank} at data-parallel rank {dp_rank()}, tensor-parallel "
                                   f"rank {tp_rank()}; the backend expects tensor-parallel groups of consecutive ranks")


def shutdown_parallel() -> None:
    """Tear megatron's parallel state and the process group down on this rank, once its part is
    done (rank 0 after `stop_followers`, the others once `follow` returned). Left to the
    interpreter's exit, gloo's worker threads can still be running when they are destroyed, which
    aborts the process (SIGABRT, "terminate called without an active exception"): a clean stop
    would look like a crash to torchrun and to whoever watches the learner."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_launcher() -> None:
    """Under torchrun, each rank runs in a session of its own, so whoever kills the launcher's
    process group (`clora up` killing a hung learner) would orphan the ranks: ask Linux to kill this
    process when its parent dies, as kill -9 would (the learner restarts from its checkpoints)."""
    if sys.platform != "linux" or "LOCAL_RANK" not in os.environ:
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    try:   # the launcher may have died before the request took hold: then the parent is another
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        parent = b""
    if b"torch.distributed.run" not in parent and b"torchrun" not in parent:
        log.critical("the launcher of this rank is gone; exiting")
        os._exit(EXIT_GROUP_BROKEN)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_fixes() -> None:
    """megatron-core 0.16.1 allocates attention's scratch buffer on the current CUDA device; on a
    CPU machine give it CPU tensors (`baddbmm` with beta 0 never reads their contents)."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tuple(tensor_shape), dtype=dtype)

    parallel_state._GLOBAL_MEMORY_BUFFER = CpuBuffer()


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def row_slices(batch: int, replicas: int) -> list[slice]:
    """The rows of a `batch`-row forward each data-parallel replica runs, as `torch.tensor_split`
    splits them: 5 rows over 2 replicas are [0:3], [3:5]; 1 row over 2 is [0:1], [1:1] (empty)."""
    base, extra = divmod(batch, replicas)
    out, start = [], 0
    for i in range(replicas):
        n = base + (1 if i < extra else 0)
        out.append(slice(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class DataSplit:
    """How one forward's rows are split over the data-parallel replicas, and how their logits
    shards are put back together on rank 0. Every rank derives it alike from the broadcast inputs.

    Example: a (3, T) batch over 2 replicas with `positions` selecting 2, 1 and 2 positions of
    rows 0, 1, 2. `rows` is [0:2], [2:3]; each replica's shard is (1, N_d, V/T) in its own
    sequence-major order, `counts` [3, 2], `axis` 1; `order` (5,) picks, for each position of the
    whole batch in sequence-major order, its place in the replicas' concatenated shards. Without
    `positions`, shards are (rows, T, V/T), `counts` [2, 1], `axis` 0, and `order` is None.
    """

    rows: list[slice]
    counts: list[int]
    axis: int
    order: torch.Tensor | None

    @property
    def padded(self) -> int:
        """Every rank's shard is padded to this length along `axis` for the gather and scatter."""
        return max(self.counts)

    @staticmethod
    def of(batch: int, replicas: int, positions: torch.Tensor | None) -> "DataSplit":
        rows = row_slices(batch, replicas)
        if positions is None:
            return DataSplit(rows, [r.stop - r.start for r in rows], 0, None)
        sel = positions.bool()                                                  # (B, T)
        gid = torch.zeros(sel.T.shape, dtype=torch.long, device=sel.device)
        gid[sel.T] = torch.arange(int(sel.sum()), device=sel.device)            # global sequence-major ids
        gid = gid.T
        local = [gid[r].T[sel[r].T] for r in rows]                             # each replica's order
        order = torch.argsort(torch.cat(local)) if replicas > 1 else None
        return DataSplit(rows, [len(ids) for ids in local], 1, order)


class _Rows:
    """The rows of the whole batch this rank's forward runs (set around each forward), so LoRA
    dropout draws the whole batch's masks, as the default backend does, and keeps its rows."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.start = 0


# --- the base model ----------------------------------------------------------------------------


def hf_config(hf_dir: Path | str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(hf_dir))


def check_supported(cfg, tp: int) -> None:
    """A clear error for a base megatron cannot split over `tp` ranks (before any rank builds)."""
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    if getattr(cfg, "model_type", None) not in ("llama", "mistral", "qwen2"):
        raise MegatronBackendError(f"the megatron backend loads Llama-family models; {arch} is not one")
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = [f"{what} ({n}) is not divisible by the tensor parallel size {tp}"
                for what, n in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                                ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size))
                if n % tp]
    if getattr(cfg, "attention_bias", False) and cfg.model_type != "qwen2":
        problems.append("attention biases are not supported")
    if problems:
        raise MegatronBackendError(f"{arch} cannot run at tensor parallel size {tp}: " + "; ".join(problems))


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def build_gpt(hf_dir: Path | str, dtype: torch.dtype = torch.float32):
    """The frozen base from `hf_dir` as a megatron `GPTModel` sharded over the tensor-parallel group
    (`init_parallel` first). Each rank reads only its shards from the safetensors files."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = hf_config(hf_dir)
    tp = tp_size()
    check_supported(cfg, tp)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tc = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads, kv_channels=head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=False,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, rotary_interleaved=False)
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    block = TransformerBlockSubmodules(layer_specs=[layer] * tc.num_layers, layer_norm=WrappedTorchNorm)
    model = GPTModel(tc, block, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     parallel_output=True, share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings),
                     position_embedding_type="rope", rotary_percent=1.0, rotary_base=_rope_theta(cfg))
    if not torch.cuda.is_available():
        model.rotary_pos_emb.__class__ = _cpu_rope_class(type(model.rotary_pos_emb))
    _load_hf_weights(model, Path(hf_dir), cfg, head_dim)
    model.requires_grad_(False)
    model.eval()
    if torch.cuda.is_available():
        model.cuda()
    return model, cfg


def _cpu_rope_class(base: type) -> type:
    """megatron's RotaryEmbedding moves its frequencies to the CUDA device on first use."""

    class CpuRotaryEmbedding(base):
        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)
            return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    return CpuRotaryEmbedding


def _load_hf_weights(model: nn.Module, hf_dir: Path, cfg, head_dim: int) -> None:
    """Copy this rank's shards of the Hugging Face weights into `model`'s parameters. Every
    parameter must be written exactly once: megatron leaves them uninitialised."""
    from safetensors import safe_open

    r, tp = tp_rank(), tp_size()
    files = sorted(hf_dir.glob("*.safetensors"))
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            where.update({k: f for k in h.keys()})
    handles: dict[Path, Any] = {}

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise MegatronBackendError(f"{hf_dir} has no tensor {name}")
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(str(f), "pt")
        return handles[f].get_tensor(name).float()

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, 0)[r]

    ng, hpg = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    h = cfg.hidden_size
    want: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": rows(get("model.embed_tokens.weight")),
                                     "decoder.final_layernorm.weight": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        want["output_layer.weight"] = rows(get("lm_head.weight"))
    for i in range(cfg.num_hidden_layers):
        hf, mg = f"model.layers.{i}", f"decoder.layers.{i}"
        q = get(f"{hf}.self_attn.q_proj.weight").view(ng, hpg * head_dim, h)
        k = get(f"{hf}.self_attn.k_proj.weight").view(ng, head_dim, h)
        v = get(f"{hf}.self_attn.v_proj.weight").view(ng, head_dim, h)
        want[f"{mg}.self_attention.linear_qkv.weight"] = rows(torch.cat([q, k, v], 1)).reshape(-1, h)
        if getattr(cfg, "attention_bias", False):
            qb = get(f"{hf}.self_attn.q_proj.bias").view(ng, hpg * head_dim)
            kb = get(f"{hf}.self_attn.k_proj.bias").view(ng, head_dim)
            vb = get(f"{hf}.self_attn.v_proj.bias").view(ng, head_dim)
            want[f"{mg}.self_attention.linear_qkv.bias"] = rows(torch.cat([qb, kb, vb], 1)).reshape(-1)
        want[f"{mg}.self_attention.linear_proj.weight"] = get(f"{hf}.self_attn.o_proj.weight").chunk(tp, 1)[r]
        want[f"{mg}.input_layernorm.weight"] = get(f"{hf}.input_layernorm.weight")
        want[f"{mg}.pre_mlp_layernorm.weight"] = get(f"{hf}.post_attention_layernorm.weight")
        want[f"{mg}.mlp.linear_fc1.weight"] = torch.cat([rows(get(f"{hf}.mlp.gate_proj.weight")),
                                                         rows(get(f"{hf}.mlp.up_proj.weight"))], 0)
        want[f"{mg}.mlp.linear_fc2.weight"] = get(f"{hf}.mlp.down_proj.weight").chunk(tp, 1)[r]
    params = dict(model.named_parameters())
    if set(params) != set(want):
        raise MegatronBackendError(f"weight mapping mismatch: megatron has {sorted(set(params) - set(want))[:4]} "
                                   f"unloaded, the mapping has {sorted(set(want) - set(params))[:4]} unused")
    with torch.no_grad():
        for name, p in params.items():
            src = want[name]
            if tuple(src.shape) != tuple(p.shape):
                raise MegatronBackendError(f"{name}: checkpoint shard {tuple(src.shape)}, model {tuple(p.shape)}")
            p.copy_(src)


def hf_layout(cfg, spec: LoraSpec) -> LoraLayout:
    """The adapter's layout exactly as the default backend lays it out on the Hugging Face model
    (built on the meta device: shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    unknown = set(spec.target_modules) - set(SITES)
    if unknown:
        raise MegatronBackendError(f"the megatron backend adapts {SITES}; not {sorted(unknown)}")
    return LoraLayout.for_model(skeleton, spec)


# --- LoRA on the parallel layers -----------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """One HF site inside a megatron layer: its index in the layout and, for the fused column
    layers, how its output sits in the layer's output."""

    index: int
    leaf: str


class _LoraParallel(nn.Module):
    """A frozen megatron parallel linear plus the LoRA updates of its HF sites (q, k, v for
    linear_qkv; gate, up for linear_fc1; one site for the row layers)."""

    def __init__(self, base: nn.Module, bank: LoraBank, pieces: list[_Piece], kind: str, groups: tuple[int, int, int],
                 rows: _Rows):
        super().__init__()
        self.rows = rows
        self.base = base
        self.bank = bank
        self.pieces = pieces
        self.kind = kind           # "qkv", "fc1", "row"
        self.groups = groups       # (local query groups, heads per group, head dim) for qkv

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def _x(self, x: torch.Tensor, columns: slice | None) -> torch.Tensor:
        """x with LoRA dropout drawn as the HF model draws it: one (b, s, in) mask per site from
        the tenant's generator on every rank, sliced to this rank's columns for a row layer."""
        spec = self.bank.spec
        if not (spec.dropout > 0 and self.training):
            return x
        s, b, width = x.shape
        full = width * (tp_size() if columns is not None else 1)
        total, start = (self.rows.total, self.rows.start) if self.rows.total is not None else (b, 0)
        keep = dropout_keep(torch.Size((total, s, full)), spec.dropout, self.bank.dropout_generator, x.device)
        keep = keep[start:start + b].transpose(0, 1)
        if columns is not None:
            keep = keep[..., columns]
        return x * keep / (1 - spec.dropout)

    def forward(self, x: torch.Tensor, *args, **kwargs):  # x: (s, b, in) or (s, b, in/T) for a row layer
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        out, bias = self.base(x, *args, **kwargs)
        bank = self.bank
        if not bank.enabled or bank.params is None or not self.pieces:
            return out, bias
        r, tp, scale = tp_rank(), tp_size(), bank.spec.scaling
        if self.kind == "row":
            (piece,) = self.pieces
            a, b_ = bank.params[piece.index]                      # (rank, in), (out, rank)
            cols = a.shape[1] // tp
            part = slice(r * cols, (r + 1) * cols)
            h = F.linear(self._x(x, part).to(a.dtype), a[:, part]).contiguous()   # (s, b, rank): this rank's share
            h = reduce_from_tensor_model_parallel_region(h)
            return out + (F.linear(h, b_) * scale).to(out.dtype), bias
        deltas: dict[str, torch.Tensor] = {}
        for piece in self.pieces:
            a, b_ = bank.params[piece.index]
            h = copy_to_tensor_model_parallel_region(F.linear(self._x(x, None).to(a.dtype), a))  # (s, b, rank)
            deltas[piece.leaf] = F.linear(h, b_.chunk(tp, 0)[r]) * scale                   # this rank's output rows
        s, b = out.shape[0], out.shape[1]
        if self.kind == "fc1":
            half = out.shape[-1] // 2
            zero = out.new_zeros(s, b, half)
            delta = torch.cat([deltas.get("gate_proj", zero), deltas.get("up_proj", zero)], -1)
        else:
            ngl, hpg, d = self.groups
            parts = [deltas.get(leaf, out.new_zeros(s, b, ngl * width)).reshape(s, b, ngl, width)
                     for leaf, width in (("q_proj", hpg * d), ("k_proj", d), ("v_proj", d))]
            delta = torch.cat(parts, -1).reshape(s, b, -1)
        return out + delta.to(out.dtype), bias


def add_lora(gpt: nn.Module, layout: LoraLayout, bank: LoraBank, cfg, rows: _Rows) -> list[tuple[int, int]]:
    """Wrap `gpt`'s parallel linears for the layout's sites. Returns the flat (start, end) ranges
    whose gradient each rank computes only its share of (column B's rows, row A's columns)."""
    index = {s.name: i for i, s in enumerate(layout.sites)}
    tp = tp_size()
    ngl = cfg.num_key_value_heads // tp
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    groups = (ngl, cfg.num_attention_heads // cfg.num_key_value_heads, head_dim)
    split: list[tuple[int, int]] = []
    for i, layer in enumerate(gpt.decoder.layers):
        hf = f"model.layers.{i}"
        for owner, attr, kind, leaves, module in (
                (layer.self_attention, "linear_qkv", "qkv", ("q_proj", "k_proj", "v_proj"), "self_attn"),
                (layer.self_attention, "linear_proj", "row", ("o_proj",), "self_attn"),
                (layer.mlp, "linear_fc1", "fc1", ("gate_proj", "up_proj"), "mlp"),
                (layer.mlp, "linear_fc2", "row", ("down_proj",), "mlp")):
            pieces = [_Piece(index[f"{hf}.{module}.{leaf}"], leaf) for leaf in leaves
                      if f"{hf}.{module}.{leaf}" in index]
            if not pieces:
                continue
            setattr(owner, attr, _LoraParallel(getattr(owner, attr), bank, pieces, kind, groups, rows))
            for p in pieces:
                site, rank = layout.sites[p.index], layout.spec.rank
                if kind == "row":
                    split.append((site.a_offset, site.a_offset + rank * site.in_features))
                else:
                    split.append((site.b_offset, site.b_offset + site.out_features * rank))
    return split


# --- the model the learner trains through --------------------------------------------------------

_FORWARD, _BACKWARD, _REDUCE, _PING, _STOP = "forward", "backward", "reduce", "ping", "stop"


@dataclass(frozen=True)
class _Pending:
    """A follower's forward that awaits its backward: its logits shard (None where its replica
    ran no rows), the padded shape the scatter sends, and the shard's length along `axis`."""

    shard: torch.Tensor | None
    padded: tuple[int, ...]
    axis: int
    count: int


def _pad(t: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """`t` zero-padded to length `n` along `axis` (collectives need equal shapes on every rank)."""
    short = n - t.shape[axis]
    if short == 0:
        return t.contiguous()
    shape = list(t.shape)
    shape[axis] = short
    return torch.cat([t, t.new_zeros(shape)], axis)


class _GatherVocab(torch.autograd.Function):
    """Rank 0 gets the whole (B, T, V) logits from each rank's (B_d, T, V/T) shard (its replica's
    rows, its vocabulary columns); in the backward it sends every rank the gradient of its shard,
    under the forward's id, and runs its own shard's backward there too (a nested backward, as
    reentrant checkpointing does), so that an error in it is a broken group (`_collective`), not
    one tenant's error while the other ranks wait in that backward's all-reduces. The shard comes
    in a list, out of the outer graph's sight; `anchor` (a 0-d leaf that requires grad exactly
    when the shard does) is what connects the output to autograd."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, model: "MegatronLoraModel", fid: int, split: DataSplit,
                holder: list[torch.Tensor]) -> torch.Tensor:
        ctx.model, ctx.fid, ctx.split, ctx.holder = model, fid, split, holder
        return model._gather(holder[0].detach(), split)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with ctx.model._collective("backward"):
            mine = ctx.model._scatter_grad(ctx.fid, grad, ctx.split)
            torch.autograd.backward(ctx.holder.pop(), mine)
        return None, None, None, None, None


class MegatronLoraModel(nn.Module):
    """The frozen megatron base with LoRA on its parallel layers; `LoraModel`'s interface. On rank
    0 a call runs on every rank (see the module's docstring); other ranks run `follow`."""

    def __init__(self, hf_dir: Path | str, spec: LoraSpec, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gpt, cfg = build_gpt(hf_dir, dtype)
        self.cfg = cfg
        self.layout = hf_layout(cfg, spec)
        self.bank = LoraBank(spec)
        self.rows = _Rows()
        self.split = add_lora(self.gpt, self.layout, self.bank, cfg, self.rows)
        self.split_index = torch.cat([torch.arange(a, b) for a, b in self.split]) if self.split else torch.zeros(0, dtype=torch.long)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tp, self.tp_rank, self.dp, self.dp_rank = tp_size(), tp_rank(), dp_size(), dp_rank()
        self.dtype = dtype
        self.broken = False
        """A collective failed or a rank's part of one raised: the group is out of step for good."""
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self._next_id = 0
        self._graphs: dict[int, _Pending] = {}
        """Followers: each forward that still awaits its backward, by forward id."""
        self._own: tuple[torch.Tensor, list[tuple[nn.Parameter, nn.Parameter]]] | None = None
        """Followers: their copy of the bound weights (P,) and its LoRA parameters (grads in `_grad`)."""
        self._grad: torch.Tensor | None = None
        self._select: torch.Tensor | None = None
        """(s, b) bool during a forward that needs the logits of those positions only."""
        head, full = self.gpt.output_layer, self.gpt.output_layer.forward

        def selected(hidden: torch.Tensor, *args, **kwargs):   # the LM head on the positions a loss reads
            if self._select is not None:
                hidden = hidden[self._select].unsqueeze(1)          # (N, 1, h), in (s, b) order
            return full(hidden, *args, **kwargs)

        head.forward = selected
        self.exit_on_failure = False
        """Exit the process (`EXIT_GROUP_BROKEN`) when a collective fails, instead of raising
        `ParallelGroupError`: what the learner process does (set by `clora learner`)."""
        self.eval()   # no LoRA dropout outside a training step (which switches to train mode)

    # --- LoraModel's interface ---

    @property
    def model(self) -> nn.Module:
        return self.gpt

    @property
    def spec(self) -> LoraSpec:
        return self.layout.spec

    @property
    def vocab_size(self) -> int:
        return int(self.cfg.vocab_size)

    def bind(self, params: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        self.bank.params = params

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        prev, self.bank.enabled = self.bank.enabled, False
        try:
            yield
        finally:
            self.bank.enabled = prev

    def target_logprobs(self, batch) -> torch.Tensor:
        """(B, T-1) log p of each next token where `batch.loss_mask` is 1, 0 elsewhere (the trainer's
        `target_logprobs`): the LM head runs on those positions only, as the default backend's does."""
        where = batch.loss_mask.bool().to(self.device)                         # (B, T-1)
        ids = batch.input_ids.to(self.device)
        positions = torch.zeros(ids.shape, dtype=torch.bool, device=self.device)
        positions[:, :-1] = where
        logits = self(ids, batch.attention_mask, positions)[0]                 # (N, V), (s, b) order
        targets = ids[:, 1:].T[where.T]                                        # (N,), the same order
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        out = torch.zeros(where.T.shape, dtype=lp.dtype, device=lp.device).masked_scatter(where.T, lp)
        return out.T

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for input_ids (batch, seq), on rank 0. With `positions`
        ((batch, seq) bool), only theirs: (1, N, vocab) in sequence-major order."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 calls the megatron model; the others run follow()")
        fid, self._next_id = self._next_id, self._next_id + 1
        bank = self.bank
        bound = bank.params is not None and bank.enabled
        weights = (torch.cat([t.detach().reshape(-1) for pair in bank.params for t in pair])   # (P,), compute dtype
                   if bound and self.world > 1 else None)
        gen = bank.dropout_generator
        header = {"op": _FORWARD, "id": fid, "shape": tuple(input_ids.shape), "mask": attention_mask is not None,
                  "positions": positions is not None,
                  "bound": bound, "dtype": str(weights.dtype).removeprefix("torch.") if weights is not None else None, "training": self.training, "grad": torch.is_grad_enabled(),
                  "rng": gen.get_state() if (gen is not None and self.training and self.spec.dropout > 0) else None}
        with self._collective("forward"):
            self._send(header)
            if self.world > 1:
                self._bcast(input_ids.to(self.device))
                if attention_mask is not None:
                    self._bcast(attention_mask.to(self.device, torch.long))
                if positions is not None:
                    self._bcast(positions.to(self.device, torch.uint8))
                if weights is not None:
                    self._bcast(weights.to(self.device))
            if self.world == 1:
                return self._shard_logits(input_ids, attention_mask, positions)
            split = DataSplit.of(input_ids.shape[0], self.dp,
                                 positions.to(self.device) if positions is not None else None)
            shard = self._run_rows(split, input_ids, attention_mask, positions)
            anchor = torch.zeros((), device=self.device, requires_grad=shard.requires_grad)
            return _GatherVocab.apply(anchor, self, fid, split, [shard])

    def reduce_grads(self, grad: torch.Tensor) -> None:
        """After a backward (rank 0, `DeviceSlot.fold_grads`): add the other ranks' shares of the
        split ranges into `grad` (P,), so it is the whole gradient."""
        if self.world == 1 or self.rank != 0:
            return
        with self._collective("gradient reduction"):
            self._send({"op": _REDUCE})
            self._reduce_into(grad)

    def keepalive(self) -> None:
        """Rank 0, idle: tell the followers it is alive (their wait has the group's timeout)."""
        if self.world > 1 and self.rank == 0:
            with self._collective("keepalive"):
                self._send({"op": _PING})

    def stop_followers(self) -> None:
        """Rank 0, at the end: let the other ranks return from `follow`. Quietly nothing where
        they are gone already."""
        if self.world > 1 and self.rank == 0 and not self.broken:
            try:
                self._send({"op": _STOP})
            except Exception as e:  # noqa: BLE001 - the group is already broken: nobody left to stop
                log.warning("could not stop the other ranks: %s", e)

    # --- the SPMD plumbing ---

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Any failure between a header and the end of its collectives (a collective that failed,
        or this rank's own part that raised) leaves the group out of step: the other ranks wait in
        a collective this one will never join. So it is never one tenant's error: the group is
        broken (`ParallelGroupError`), and the learner process exits at once (`exit_on_failure`),
        which closes its connections, so every other rank's collective fails within moments and
        it exits too, instead of waiting out the group's timeout."""
        try:
            yield
        except ParallelGroupError:
            self.broken = True
            raise
        except Exception as e:
            if self.world == 1:   # no other rank waits: an ordinary error
                raise
            self.broken = True
            log.critical("the parallel group broke during the %s on rank %d: %r", what, self.rank, e, exc_info=True)
            if self.exit_on_failure:
                logging.shutdown()
                os._exit(EXIT_GROUP_BROKEN)
            raise ParallelGroupError(f"the parallel group broke during the {what} on rank {self.rank}: {e}") from e

    def _send(self, header: dict) -> None:
        if self.world > 1:
            dist.broadcast_object_list([header], src=0)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0)
        return t

    def _shard_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's (B, T, V/T) logits, or (1, N, V/T) of `positions`. The attention mask is
        causal plus padding (True = hidden)."""
        ids = input_ids.to(self.device)
        t = ids.shape[1]
        hidden = torch.triu(torch.ones(t, t, dtype=torch.bool, device=self.device), 1)[None, None]   # (1,1,T,T)
        if attention_mask is not None:
            hidden = hidden | ~attention_mask.to(self.device).bool()[:, None, None, :]
        self._select = positions.to(self.device).bool().T if positions is not None else None
        try:
            return self.gpt(ids, None, hidden)
        finally:
            self._select = None

    def _run_rows(self, split: DataSplit, ids: torch.Tensor, mask: torch.Tensor | None,
                  positions: torch.Tensor | None) -> torch.Tensor:
        """This rank's logits shard of its replica's rows of the batch: (B_d, T, V/T), or
        (1, N_d, V/T) of `positions`; an empty one where the replica has no rows."""
        rows = split.rows[self.dp_rank]
        if rows.stop == rows.start:
            width = self.vocab_size // self.tp
            shape = (0, ids.shape[1], width) if split.axis == 0 else (1, 0, width)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.rows.total, self.rows.start = ids.shape[0], rows.start
        try:
            return self._shard_logits(ids[rows], mask[rows] if mask is not None else None,
                                      positions[rows] if positions is not None else None)
        finally:
            self.rows.total = None

    def _gather(self, shard: torch.Tensor, split: DataSplit) -> torch.Tensor:
        """Every rank's shard to rank 0, padded to equal lengths: there, per replica, the vocabulary
        shards side by side, then the replicas' rows (or positions, back in sequence-major order)."""
        shard = _pad(shard, split.axis, split.padded)
        if self.rank != 0:
            dist.gather(shard, None, dst=0)
            return shard
        parts = [torch.empty_like(shard) for _ in range(self.world)]
        dist.gather(shard, parts, dst=0)
        replicas = [torch.cat(parts[d * self.tp:(d + 1) * self.tp], -1).narrow(split.axis, 0, split.counts[d])
                    for d in range(self.dp)]
        out = torch.cat(replicas, split.axis) if self.dp > 1 else replicas[0]
        return out.index_select(1, split.order) if split.order is not None else out

    def _scatter_grad(self, fid: int, grad: torch.Tensor, split: DataSplit) -> torch.Tensor:
        """Rank 0: each rank the gradient of its shard (the inverse of `_gather`); its own back."""
        self._send({"op": _BACKWARD, "id": fid})
        if split.order is not None:
            grad = grad.index_select(1, torch.argsort(split.order))
        parts = [_pad(p, split.axis, split.padded) for replica in grad.split(split.counts, split.axis)
                 for p in replica.chunk(self.tp, -1)]
        mine = torch.empty_like(parts[0])
        dist.scatter(mine, parts, src=0)
        return mine.narrow(split.axis, 0, split.counts[0])

    def _reduce_into(self, grad: torch.Tensor) -> None:
        """Sum the gradient (P,) to rank 0. One replica: only the split ranges, which each rank of
        the tensor-parallel group holds its share of (the rest every rank holds whole). Several:
        all of it, with the whole parts counted once per replica (from its tensor-parallel rank 0)."""
        idx = self.split_index.to(grad.device)
        if self.dp == 1:
            part = grad.index_select(0, idx).float()
            dist.reduce(part, dst=0)
            if self.rank == 0:
                grad.index_copy_(0, idx, part)
            return
        if self.tp_rank == 0:
            part = grad.float().clone()
        else:
            part = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
            part.index_copy_(0, idx, grad.index_select(0, idx).float())
        dist.reduce(part, dst=0)
        if self.rank == 0:
            grad.copy_(part)

    # --- followers ---

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 runs until it says stop. A failure (rank 0 gone, so its
        connections closed) breaks the group: `_collective`."""
        if self.rank == 0:
            raise RuntimeError("rank 0 drives; it does not follow")
        with self._collective("following"):
            self._follow()

    def _follow(self) -> None:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            header = box[0]
            op = header["op"]
            if op == _STOP:
                return
            if op == _PING:
                continue
            if op == _FORWARD:
                self._follow_forward(header)
            elif op == _BACKWARD:
                pending = self._graphs.pop(header["id"])
                mine = torch.empty(pending.padded, dtype=self.dtype, device=self.device)
                dist.scatter(mine, None, src=0)
                if pending.shard is not None:
                    pending.shard.backward(mine.narrow(pending.axis, 0, pending.count))
            elif op == _REDUCE:
                self._graphs.clear()   # forwards no loss used: their graphs are done with
                if self._grad is None:
                    self._grads()
                self._reduce_into(self._grad)
                self._grad.zero_()

    def _grads(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self._grad is None or self._grad.dtype != dtype:
            self._grad = torch.zeros(self.layout.numel, dtype=dtype, device=self.device)
            self._own = None
        return self._grad

    def _follow_forward(self, header: dict) -> None:
        ids = self._bcast(torch.empty(header["shape"], dtype=torch.long, device=self.device))
        mask = self._bcast(torch.empty(header["shape"], dtype=torch.long, device=self.device)) if header["mask"] else None
        positions = (self._bcast(torch.empty(header["shape"], dtype=torch.uint8, device=self.device))
                     if header["positions"] else None)
        if header["bound"]:
            dtype = getattr(torch, header["dtype"])   # rank 0's compute dtype: every rank computes alike
            grads = self._grads(dtype)
            if self._own is None:
                weights = torch.zeros(self.layout.numel, dtype=dtype, device=self.device)
                params = []
                for (a, b), (ga, gb) in zip(self.layout.views(weights), self.layout.views(grads)):
                    pa, pb = nn.Parameter(a), nn.Parameter(b)
                    pa.grad, pb.grad = ga, gb
                    params.append((pa, pb))
                self._own = (weights, params)
            weights, params = self._own
            with torch.no_grad():
                self._bcast(weights)
            self.bank.params, self.bank.enabled = params, True
        else:
            self.bank.params, self.bank.enabled = None, False
        gen = None
        if header["rng"] is not None:
            gen = torch.Generator()
            gen.set_state(header["rng"])
        self.bank.dropout_generator = gen
        self.train(header["training"])
        split = DataSplit.of(header["shape"][0], self.dp, positions)
        with torch.set_grad_enabled(header["grad"]):
            shard = self._run_rows(split, ids, mask, positions)
            padded = self._gather(shard, split)
        if header["grad"] and header["bound"]:
            self._graphs[header["id"]] = _Pending(shard if shard.requires_grad else None, tuple(padded.shape),
                                                  split.axis, split.counts[self.dp_rank])
