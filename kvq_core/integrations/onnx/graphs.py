"""The five kvq computations as torch modules ready for ``torch.onnx.export``, with their I/O.

Each module runs the ``"torch"`` backend's kernels for one spec and layer (the ``kvq::`` ops'
decomposition: the kernel class those ops call, traced to aten ops) on tensors whose names,
dtypes and shapes are exactly the packed layout's fields, so a block encoded by Python kvq feeds
an exported graph and back. The spec's constants (rotation signs, codebooks, Hadamard matrices)
are module buffers, so they become ONNX initializers. Batch, tokens and query length are
dynamic; kv_heads, q_heads and head_dim are fixed (the constants are per kv head).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kvq_core.constants import constants
from kvq_core.torch_ops.run import kernel
from kvq_core.torch_ops.torch_kernels import TorchContext, field_names
from kvq_core.layout import Field
from kvq_core.spec import MethodSpec

GRAPHS = ("encode_keys", "encode_values", "decode_keys", "decode_values", "attend")
BACKEND = "torch"
#: Example sizes for tracing (not 0 or 1, which torch.export would specialise).
EXAMPLE_BATCH, EXAMPLE_Q_LEN = 2, 3


@dataclasses.dataclass(frozen=True)
class GraphIO:
    """A module and what ``torch.onnx.export`` needs to trace it with the layout's names."""

    module: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dynamic_shapes: tuple[Any, ...]  # per forward argument; a ``*fields`` argument takes a tuple


class _Constants(torch.nn.Module):
    """The spec's constants as buffers (ONNX initializers), read back as a name -> tensor map."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self.names = tuple(arrays)
        for name, arr in arrays.items():
            self.register_buffer(name, torch.from_numpy(np.array(arr)))

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}


class _KernelGraph(torch.nn.Module):
    """Base: the torch backend's kernel object for ``spec`` plus the constants of (kv_heads, layer)."""

    def __init__(self, spec: MethodSpec, layer: int, kv_heads: int) -> None:
        super().__init__()
        self.spec, self.layer, self.kv_heads = spec, layer, kv_heads
        self.kernel = kernel(BACKEND, spec.to_json())
        self.consts = _Constants(constants(spec, kv_heads, layer))

    def context(self, batch: Any, tokens: Any) -> TorchContext:
        shape = (batch, self.kv_heads, tokens, self.spec.head_dim)
        return TorchContext(self.spec, self.layer, shape, self.consts.as_dict())


class EncodeGraph(_KernelGraph):
    """``x [batch, kv_heads, tokens, head_dim] float32`` -> the packed fields in layout order."""

    def __init__(self, spec: MethodSpec, layer: int, kv_heads: int, kind: str) -> None:
        super().__init__(spec, layer, kv_heads)
        self.kind = kind
        self.names = field_names(spec, kind)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx = self.context(x.shape[0], x.shape[2])
        encode = self.kernel.encode_keys if self.kind == "keys" else self.kernel.encode_values
        fields = encode(x, ctx)
        return tuple(fields[n] for n in self.names)


def _token_field(spec: MethodSpec, kind: str) -> int:
    """Index of the first field shaped ``(batch, kv_heads, tokens, ...)`` (every layout has one)."""
    b, h, t = 2, 3, 5
    for i, f in enumerate(_layout(spec, kind, b, h, t).values()):
        if f.shape[:3] == (b, h, t):
            return i
    raise AssertionError(f"{spec.method} {kind}: no field is (batch, kv_heads, tokens, ...)")


class DecodeGraph(_KernelGraph):
    """The packed fields in layout order -> ``[batch, kv_heads, tokens, head_dim] float32``."""

    def __init__(self, spec: MethodSpec, layer: int, kv_heads: int, kind: str) -> None:
        super().__init__(spec, layer, kv_heads)
        self.kind = kind
        self.names = field_names(spec, kind)
        self.token_field = _token_field(spec, kind)

    def forward(self, *fields: torch.Tensor) -> torch.Tensor:
        ref = fields[self.token_field]
        ctx = self.context(ref.shape[0], ref.shape[2])
        named = dict(zip(self.names, fields))
        decode = self.kernel.decode_keys if self.kind == "keys" else self.kernel.decode_values
        return decode(named, ctx)


class AttendGraph(_KernelGraph):
    """``q [batch, q_heads, q_len, head_dim]``, key fields, value fields -> ``(out, lse)`` (float32):
    softmax attention over the packed cache at a fixed ``scale``, scored from the codes."""

    def __init__(self, spec: MethodSpec, layer: int, kv_heads: int, scale: float) -> None:
        super().__init__(spec, layer, kv_heads)
        self.scale = float(scale)
        self.key_names, self.value_names = field_names(spec, "keys"), field_names(spec, "values")
        self.token_field = _token_field(spec, "keys")

    def forward(self, q: torch.Tensor, *fields: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nk = len(self.key_names)
        kf, vf = dict(zip(self.key_names, fields[:nk])), dict(zip(self.value_names, fields[nk:]))
        ref = fields[self.token_field]
        return self.kernel.attend(q, kf, vf, self.context(ref.shape[0], ref.shape[2]), self.scale)


# ------------------------------------------------------------------------------------------------
# example inputs and dynamic axes, read off the layout
# ------------------------------------------------------------------------------------------------
def _layout(spec: MethodSpec, kind: str, batch: int, kv_heads: int, tokens: int) -> Mapping[str, Field]:
    return spec.key_layout(batch, kv_heads, tokens) if kind == "keys" else spec.value_layout(batch, kv_heads, tokens)


def example_tokens(spec: MethodSpec) -> int:
    """A token count above two of the spec's largest group and a multiple of none of its sizes."""
    groups = [v for f in dataclasses.fields(spec) if "group" in f.name and isinstance(v := getattr(spec, f.name), int)]
    return 2 * max([64, *groups]) + 3


def _field_dims(spec: MethodSpec, kind: str, kv_heads: int, dims: Mapping[str, Any]) -> list[dict[int, Any]]:
    """Per field, its dynamic axes: batch, tokens, or ``Dim.AUTO`` for a size derived from tokens
    (e.g. OScaR's per-token-group stats); torch.export records how it follows from tokens."""
    t0 = example_tokens(spec)
    base = _layout(spec, kind, EXAMPLE_BATCH, kv_heads, t0)
    more_batch = _layout(spec, kind, EXAMPLE_BATCH + 1, kv_heads, t0)
    more_tokens = _layout(spec, kind, EXAMPLE_BATCH, kv_heads, 8 * t0)
    out = []
    for name, f in base.items():
        axes: dict[int, Any] = {}
        for axis, size in enumerate(f.shape):
            if more_batch[name].shape[axis] != size:
                axes[axis] = dims["batch"]
            elif more_tokens[name].shape[axis] != size:
                axes[axis] = dims["tokens"] if size == t0 else torch.export.Dim.AUTO
        out.append(axes)
    return out


def build(spec: MethodSpec, graph: str, *, layer: int, kv_heads: int, q_heads: int, scale: float,
          seed: int = 0) -> GraphIO:
    """The module of ``graph`` (one of :data:`GRAPHS`) with example inputs, names and dynamic axes."""
    dims = {"batch": torch.export.Dim("batch", min=1), "tokens": torch.export.Dim("tokens", min=1),
            "q_len": torch.export.Dim("q_len", min=1)}
    gen = torch.Generator().manual_seed(seed)
    d, t = spec.head_dim, example_tokens(spec)
    x = torch.randn(EXAMPLE_BATCH, kv_heads, t, d, generator=gen)
    kv_dims = {0: dims["batch"], 2: dims["tokens"]}
    if graph.startswith("encode_"):
        kind = graph.removeprefix("encode_")
        return GraphIO(EncodeGraph(spec, layer, kv_heads, kind), (x,), ("x",), field_names(spec, kind), (kv_dims,))
    if graph.startswith("decode_"):
        kind = graph.removeprefix("decode_")
        with torch.no_grad():
            fields = EncodeGraph(spec, layer, kv_heads, kind)(x)
        return GraphIO(DecodeGraph(spec, layer, kv_heads, kind), fields, field_names(spec, kind), ("x",),
                       (tuple(_field_dims(spec, kind, kv_heads, dims)),))
    if graph == "attend":
        with torch.no_grad():
            kf = EncodeGraph(spec, layer, kv_heads, "keys")(x)
            vf = EncodeGraph(spec, layer, kv_heads, "values")(torch.randn(x.shape, generator=gen))
        q = torch.randn(EXAMPLE_BATCH, q_heads, EXAMPLE_Q_LEN, d, generator=gen)
        names = ("q", *(f"keys_{n}" for n in field_names(spec, "keys")), *(f"values_{n}" for n in field_names(spec, "values")))
        shapes = ({0: dims["batch"], 2: dims["q_len"]},
                  (*_field_dims(spec, "keys", kv_heads, dims), *_field_dims(spec, "values", kv_heads, dims)))
        return GraphIO(AttendGraph(spec, layer, kv_heads, scale), (q, *kf, *vf), names, ("out", "lse"), shapes)
    raise ValueError(f"graph={graph!r}; expected one of {GRAPHS}")
