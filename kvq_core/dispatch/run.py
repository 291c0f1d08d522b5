"""The bodies of the ``kvq::`` ops: find the backend's kernel in the table and call it.

Outputs are made contiguous and never alias an input or each other (custom ops may not alias).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvq_core.dispatch.table import kernel, paged_kernel, paged_writer, spec_from_json
from kvq_core.dispatch.torch_kernels import context, field_names


def fresh(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out`` made contiguous, copied when it shares storage with one of ``inputs``."""
    out = out.contiguous()
    ptr = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone()
    return out


def encode(backend: str, spec_json: str, layer: int, kind: str, x: torch.Tensor,
           head_offset: int = 0) -> list[torch.Tensor]:
    impl = kernel(backend, spec_json)
    ctx = context(spec_json, layer, x.shape, x.device, head_offset)
    fields = impl.encode_keys(x, ctx) if kind == "keys" else impl.encode_values(x, ctx)
    outs: list[torch.Tensor] = []
    for name in field_names(spec_from_json(spec_json), kind):
        outs.append(fresh(fields[name], [x, *outs]))
    return outs


def decode(backend: str, spec_json: str, layer: int, kind: str, fields: list[torch.Tensor],
           shape: list[int], head_offset: int = 0) -> torch.Tensor:
    impl = kernel(backend, spec_json)
    named = dict(zip(field_names(spec_from_json(spec_json), kind), fields))
    ctx = context(spec_json, layer, shape, fields[0].device, head_offset)
    out = impl.decode_keys(named, ctx) if kind == "keys" else impl.decode_values(named, ctx)
    return fresh(out, fields)


def attend(backend: str, spec_json: str, layer: int, q: torch.Tensor, kfields: list[torch.Tensor],
           vfields: list[torch.Tensor], shape: list[int], scale: float,
           head_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    impl = kernel(backend, spec_json)
    spec = spec_from_json(spec_json)
    kf = dict(zip(field_names(spec, "keys"), kfields))
    vf = dict(zip(field_names(spec, "values"), vfields))
    out, lse = impl.attend(q, kf, vf, context(spec_json, layer, shape, q.device, head_offset), scale)
    inputs = [q, *kfields, *vfields]
    out = fresh(out, inputs)
    return out, fresh(lse, [*inputs, out])


def fake_quant(backend: str, spec_json: str, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
    """``decode(encode(x))`` with the backend's own kernels, in x's dtype."""
    impl = kernel(backend, spec_json)
    ctx = context(spec_json, layer, x.shape, x.device)
    if kind == "keys":
        out = impl.decode_keys({n: f.contiguous() for n, f in impl.encode_keys(x, ctx).items()}, ctx)
    else:
        out = impl.decode_values({n: f.contiguous() for n, f in impl.encode_values(x, ctx).items()}, ctx)
    return fresh(out.to(x.dtype), [x])


def clips(backend: str, spec_json: str, kind: str) -> bool:
    """Whether the codec clips ``kind`` (its straight-through gradient is then not the identity)."""
    return bool(kernel(backend, spec_json).clips(kind))


def fake_quant_grad(backend: str, spec_json: str, layer: int, kind: str, x: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
    """The straight-through gradient of ``fake_quant`` at ``x`` for a codec that clips."""
    impl = kernel(backend, spec_json)
    out = impl.ste_grad(x, grad, context(spec_json, layer, x.shape, x.device), kind)
    return fresh(out.to(grad.dtype), [x, grad])


def attend_paged(backend: str, spec_json: str, layer: int, q: torch.Tensor, pages: torch.Tensor,
                 block_table: torch.Tensor, code_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                 tail_k: torch.Tensor | None, tail_v: torch.Tensor | None, tail_slot: torch.Tensor | None,
                 tail_lens: torch.Tensor | None, head_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    impl = paged_kernel(backend, spec_json)
    out, lse = impl.attend_paged(layer, q, pages, block_table, code_lens, query_start_loc, scale,
                                 tail_k, tail_v, tail_slot, tail_lens, head_offset)
    inputs = [t for t in (q, pages, block_table, code_lens, query_start_loc, tail_k, tail_v, tail_slot, tail_lens)
              if t is not None]
    out = fresh(out, inputs)
    return out, fresh(lse, [*inputs, out])


def write_paged(backend: str, spec_json: str, layer: int, key: torch.Tensor, value: torch.Tensor,
                pages: torch.Tensor, slot_mapping: torch.Tensor, head_offset: int = 0) -> None:
    paged_writer(backend, spec_json).write_paged(layer, key, value, pages, slot_mapping, head_offset)
