"""The ``kvq::`` custom ops: every schema and every fake (meta) kernel, defined once, here.

Three generic ops serve every method; the method is named by the spec's JSON string
(``MethodSpec.to_json()``), so adding a method adds no op::

    kvq::encode(str spec_json, int layer, str kind, Tensor x) -> Tensor[]
    kvq::decode(str spec_json, int layer, str kind, Tensor[] fields, SymInt[] shape) -> Tensor
    kvq::attend(str spec_json, int layer, Tensor q, Tensor[] kfields, Tensor[] vfields,
                SymInt[] shape, float scale) -> (Tensor, Tensor)
    kvq::materialize(Tensor x) -> Tensor       (a layout barrier used inside compiled kernels)

- ``kind`` is ``"keys"`` or ``"values"``; ``x`` is ``[batch, kv_heads, tokens, head_dim]`` in
  any float dtype; ``shape`` is that K/V block shape.
- ``encode`` returns the packed fields in layout order (``spec.key_layout`` /
  ``spec.value_layout``), with the layout's dtypes and shapes; ``decode`` returns float32
  ``shape``; ``attend`` returns ``(out float32 [b, q_heads, q_len, d], lse float32 [b, q_heads, q_len])``.
- The fake kernels derive every output shape from the spec's layout, so they work with symbolic
  token counts (``torch.compile(dynamic=True)``, ``torch.export`` with a ``Dim``).

Constants (rotations, signs, codebooks) are not op arguments: they are a pure function of
(spec, layer, kv_heads), all of which the op receives, and the implementation fetches them from
the core through :func:`kvq_torch.common.consts_for` (cached per device). This keeps traced
graphs free of constant tensors. A device backend (e.g. a later Triton one) registers its own
kernel on these same ops with ``torch.library.register_kernel("kvq::encode", "cuda", fn)`` and
uses the same ``consts_for`` cache; the implementation here (pure torch, any device) is the
default for every device.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from kvq_torch.common import TorchContext, TorchMethod, consts_for, field_names, spec_from_json

NAMESPACE = "kvq"

ENCODE_SCHEMA = "(str spec_json, int layer, str kind, Tensor x) -> Tensor[]"
DECODE_SCHEMA = "(str spec_json, int layer, str kind, Tensor[] fields, SymInt[] shape) -> Tensor"
ATTEND_SCHEMA = (
    "(str spec_json, int layer, Tensor q, Tensor[] kfields, Tensor[] vfields, SymInt[] shape, float scale)"
    " -> (Tensor, Tensor)"
)


@functools.lru_cache(maxsize=512)
def method_impl(spec_json: str) -> TorchMethod:
    """The torch kernel object of the method ``spec_json`` names (``kvq_torch.plugin.KERNELS``)."""
    from kvq_torch.plugin import KERNELS

    spec = spec_from_json(spec_json)
    return KERNELS[spec.method](spec)


def _layout(spec_json: str, kind: str, shape: Sequence[Any]) -> dict:
    torch._check(kind in ("keys", "values"), lambda: f"kvq: kind={kind!r}; expected 'keys' or 'values'")
    spec = spec_from_json(spec_json)
    b, h, t = shape[0], shape[1], shape[2]
    return dict(spec.key_layout(b, h, t) if kind == "keys" else spec.value_layout(b, h, t))


def _context(spec_json: str, layer: int, shape: Sequence[Any], device: torch.device) -> TorchContext:
    spec = spec_from_json(spec_json)
    return TorchContext(spec, layer, tuple(shape), consts_for(spec_json, shape[1], layer, device))


def _fresh(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out`` made contiguous (the fake kernels promise contiguous outputs), copied when it
    shares storage with an input or an earlier output (custom ops may not alias)."""
    out = out.contiguous()
    ptr = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone()
    return out


# --------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::encode", mutates_args=(), schema=ENCODE_SCHEMA)
def encode(spec_json: str, layer: int, kind: str, x: torch.Tensor) -> list[torch.Tensor]:
    impl = method_impl(spec_json)
    ctx = _context(spec_json, layer, x.shape, x.device)
    fields = impl.encode_keys(x, ctx) if kind == "keys" else impl.encode_values(x, ctx)
    spec = spec_from_json(spec_json)
    outs: list[torch.Tensor] = []
    for name in field_names(spec, kind):
        t = _fresh(fields[name], [x, *outs])
        outs.append(t)
    return outs


@encode.register_fake
def _(spec_json: str, layer: int, kind: str, x: torch.Tensor) -> list[torch.Tensor]:
    torch._check(x.dim() == 4, lambda: f"kvq::encode: x must be [batch, kv_heads, tokens, head_dim], got {x.dim()}-D")
    return [x.new_empty(f.shape, dtype=getattr(torch, f.dtype)) for f in _layout(spec_json, kind, x.shape).values()]


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::decode", mutates_args=(), schema=DECODE_SCHEMA)
def decode(spec_json: str, layer: int, kind: str, fields: list[torch.Tensor], shape: list[int]) -> torch.Tensor:
    impl = method_impl(spec_json)
    spec = spec_from_json(spec_json)
    named = dict(zip(field_names(spec, kind), fields))
    ctx = _context(spec_json, layer, shape, fields[0].device)
    out = impl.decode_keys(named, ctx) if kind == "keys" else impl.decode_values(named, ctx)
    return _fresh(out, fields)


@decode.register_fake
def _(spec_json: str, layer: int, kind: str, fields: list[torch.Tensor], shape: list[int]) -> torch.Tensor:
    layout = _layout(spec_json, kind, shape)
    torch._check(len(fields) == len(layout), lambda: f"kvq::decode: {len(fields)} fields; the layout has {len(layout)}")
    return fields[0].new_empty(tuple(shape), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# attend
# --------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::attend", mutates_args=(), schema=ATTEND_SCHEMA)
def attend(
    spec_json: str,
    layer: int,
    q: torch.Tensor,
    kfields: list[torch.Tensor],
    vfields: list[torch.Tensor],
    shape: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = method_impl(spec_json)
    spec = spec_from_json(spec_json)
    kf = dict(zip(field_names(spec, "keys"), kfields))
    vf = dict(zip(field_names(spec, "values"), vfields))
    out, lse = impl.attend(q, kf, vf, _context(spec_json, layer, shape, q.device), scale)
    inputs = [q, *kfields, *vfields]
    out = _fresh(out, inputs)
    return out, _fresh(lse, [*inputs, out])


@attend.register_fake
def _(
    spec_json: str,
    layer: int,
    q: torch.Tensor,
    kfields: list[torch.Tensor],
    vfields: list[torch.Tensor],
    shape: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(q.dim() == 4, lambda: f"kvq::attend: q must be [batch, q_heads, q_len, head_dim], got {q.dim()}-D")
    b, hq, lq, d = q.shape
    return q.new_empty((b, hq, lq, d), dtype=torch.float32), q.new_empty((b, hq, lq), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# materialize: a layout barrier for inductor
# --------------------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::materialize", mutates_args=(), schema="(Tensor x) -> Tensor")
def materialize(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x``. Inside a compiled kernel this is opaque to inductor, so ``x``
    is computed and stored in exactly this (logical, row-major) layout before its consumers
    run; kernels use it for small operands whose memory order must match a vectorised loop
    (inductor would otherwise inline the producer and pick the loop order from its layout)."""
    return x.clone(memory_format=torch.contiguous_format)


@materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


OPS = {"encode": encode, "decode": decode, "attend": attend, "materialize": materialize}

__all__ = ["ATTEND_SCHEMA", "DECODE_SCHEMA", "ENCODE_SCHEMA", "NAMESPACE", "OPS", "attend", "decode", "encode",
           "materialize", "method_impl"]
