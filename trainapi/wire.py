"""The Tinker wire format: protobuf bodies in, protobuf results out (docs/tinker-protocol.md §7, §8).

Owns the message classes, built from the SDK's own schema (`tinker_public_descriptor`) in a
**private** descriptor pool: the SDK registers `tinker_public.proto` in protobuf's default pool
when it is imported, and a server and an SDK sharing one process (the tests) must not collide.
The SDK itself is not imported at run time: it pulls in torch, transformers and pyqwest.

- `decode_forward_backward(body)` parses a `ForwardBackwardRequest` into a `ForwardBackwardCall`
  of `TinkerDatum`s, or raises `WireError` naming the field that was wrong.
- `forward_backward_output(result)` encodes a `ForwardBackwardResult` as the SDK decodes it.
- `decompress(body, encoding, max_bytes)`: a zstd body (`Content-Encoding: zstd`), bounded.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from clora.trainapi.tinker_public_descriptor import DESCRIPTOR_B64

_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(DESCRIPTOR_B64)))


def message_class(name: str) -> type:
    """The generated class of `tinker_public.<name>` from the private pool."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequest = message_class("ForwardBackwardRequest")
ForwardBackwardOutput = message_class("ForwardBackwardOutput")
ArrayRecord = message_class("ArrayRecord")
BatchedTensor = message_class("BatchedTensor")
Tensor = message_class("Tensor")

DTYPE_FLOAT32, DTYPE_INT64 = 1, 2
_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64}


class WireError(ValueError):
    """A body that does not parse or breaks the protocol's rules; `field` names where."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class TinkerDatum:
    """One training example as the SDK sends it. Position i of `tokens` predicts
    `inputs["target_tokens"][i]`; every input has one value per position.

    Example (an SFT datum of the prompt "a b" and the answer "c"): `tokens` [5, 6, 7],
    `inputs` {"target_tokens": [6, 7, 8] int64, "weights": [0, 1, 1] float32}."""

    tokens: np.ndarray
    """(N,) int64: the model input, its text chunks concatenated."""
    inputs: dict[str, np.ndarray]
    """`loss_fn_inputs` by name, each (N,): int64 `target_tokens`, float32 the rest."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded `forward_backward` request (one chunk of an SDK call)."""

    model_id: str
    seq_id: int
    loss_fn: str
    data: tuple[TinkerDatum, ...]
    forward_only: bool
    loss_fn_config: dict[str, float | str]
    """`loss_fn_config_v2` when the client set it, else the legacy number map."""


@dataclass(frozen=True)
class ForwardBackwardResult:
    """What a forward (and backward) pass returns: each datum's target logprobs (N_i,) in
    request order, and metrics keyed `name:reduction` (the SDK splits them at the colon)."""

    logprobs: tuple[np.ndarray, ...]
    metrics: dict[str, float]


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """`body` decoded per its Content-Encoding (none or zstd), refusing more than `max_bytes`
    of output (`OverflowError`) without inflating past it."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "zstd":
        raise WireError("content-encoding", f"unsupported encoding {encoding!r}: send zstd or none")
    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise WireError("body", f"not a valid zstd frame: {e}") from e
    if len(out) > max_bytes:
        raise OverflowError(f"decompressed body exceeds the limit of {max_bytes} bytes")
    return out


def _tensor(t, where: str) -> np.ndarray:
    """A dense 1-D `Tensor` message as numpy (sparse top-K targets are not supported)."""
    if t.WhichOneof("encoding") != "dense":
        raise WireError(where, "only dense tensors are supported (sparse top-K targets are not)")
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise WireError(where, f"dtype {t.dtype} is not float32 (1) or int64 (2)")
    if len(t.dense) % np.dtype(dtype).itemsize:
        raise WireError(where, f"{len(t.dense)} bytes is not a whole number of {np.dtype(dtype).name} values")
    values = np.frombuffer(t.dense, dtype=dtype).copy()
    shape = list(t.shape)
    if shape and (len(shape) != 1 or shape[0] != values.size):
        raise WireError(where, f"shape {shape} does not match {values.size} values (1-D tensors only)")
    return values


def _datum(d, i: int) -> TinkerDatum:
    parts = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"data.{i}.model_input.{j}", f"{kind or 'empty'} chunks are not supported: text only")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"data.{i}.model_input.{j}.tokens", "not a whole number of int32 values")
        parts.append(np.frombuffer(raw, dtype="<i4").astype(np.int64))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size == 0:
        raise WireError(f"data.{i}.model_input", "is empty")
    inputs = {}
    for name, t in d.loss_fn_inputs.items():
        values = _tensor(t, f"data.{i}.loss_fn_inputs.{name}")
        if values.size != tokens.size:
            raise WireError(f"data.{i}.loss_fn_inputs.{name}",
                            f"has {values.size} values for {tokens.size} input tokens (one per position)")
        if values.dtype == np.float32 and not np.isfinite(values).all():
            raise WireError(f"data.{i}.loss_fn_inputs.{name}", "holds a NaN or an infinity")
        inputs[name] = values
    return TinkerDatum(tokens, inputs)


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A `ForwardBackwardRequest` body, checked for shape only (the loss's inputs are checked
    by `clora.trainapi.losses`)."""
    msg = ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError("body", f"not a ForwardBackwardRequest protobuf: {e}") from e
    if not msg.model_id:
        raise WireError("model_id", "is required")
    if not msg.data:
        raise WireError("data", "holds no datums")
    config: dict[str, float | str] = {}
    if msg.loss_fn_config_v2:
        for k, v in msg.loss_fn_config_v2.items():
            config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    else:
        config = dict(msg.loss_fn_config)
    for k, v in config.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise WireError(f"loss_fn_config.{k}", "is not finite")
    return ForwardBackwardCall(model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=msg.loss_fn,
                               data=tuple(_datum(d, i) for i, d in enumerate(msg.data)),
                               forward_only=msg.forward_only, loss_fn_config=config)


def forward_backward_output(result: ForwardBackwardResult) -> bytes:
    """`result` as a `ForwardBackwardOutput`: one `ArrayRecord` whose `logprobs` field holds every
    datum's values back to back, `offsets` the int64 **byte** offsets (B+1 of them)."""
    data = [np.ascontiguousarray(lp, dtype="<f4") for lp in result.logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in data]).astype("<i8")
    out = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(data))
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in data)
    field.offsets = offsets.tobytes()
    field.dtype = DTYPE_FLOAT32
    for k, v in result.metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def forward_backward_json(result: ForwardBackwardResult) -> dict:
    """`result` as the JSON `ForwardBackwardOutput` SDKs before 0.25 accept."""
    return {"loss_fn_output_type": "ArrayRecord", "metrics": dict(result.metrics),
            "loss_fn_outputs": [{"logprobs": {"data": lp.astype(float).tolist(), "dtype": "float32",
                                              "shape": [int(lp.size)]}} for lp in result.logprobs]}
