"""The bodies of the ``kvq::`` ops: get the backend's kernel object from the registry and call it.

The registry's table is the only kernel table; the kernel object of a (backend, spec) is built
once and cached here (dropped when the registry reloads). Outputs are made contiguous and never
alias an input or each other (custom ops may not alias).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from kvq_core import registry
from kvq_core.torch_ops.torch_kernels import context, field_names, spec_from_json
from kvq_core.errors import BackendUnavailableError

#: the backend whose paged kernels serve a backend that has none for a method (``kvq_torch.paged``)
PAGED_FALLBACK = "torch"


@functools.lru_cache(maxsize=1024)
def kernel(backend: str, spec_json: str) -> Any:
    """The kernel object of ``backend`` for the spec ``spec_json`` names: the registry's kernel
    class built for the spec (cached)."""
    spec = spec_from_json(spec_json)
    return registry.kernel_factory(backend, spec.method)(spec)


def _paged(backend: str, spec_json: str, write: bool) -> Any:
    """``backend``'s paged kernel for the spec, else :data:`PAGED_FALLBACK`'s, built for the spec."""
    spec = spec_from_json(spec_json)
    factory = (registry.paged_factory(backend, spec.method, write)
               or registry.paged_factory(PAGED_FALLBACK, spec.method, write))
    if factory is None:
        op = "write_paged" if write else "attend_paged"
        raise BackendUnavailableError(
            f"kvq::{op}: neither {backend!r} nor {PAGED_FALLBACK!r} has a kernel for {spec.method!r}")
    return factory(spec)


@functools.lru_cache(maxsize=1024)
def paged_kernel(backend: str, spec_json: str) -> Any:
    """The paged-attention kernel of ``backend`` for the spec, else :data:`PAGED_FALLBACK`'s (cached)."""
    return _paged(backend, spec_json, write=False)


@functools.lru_cache(maxsize=1024)
def paged_writer(backend: str, spec_json: str) -> Any:
    """The paged-write kernel of ``backend`` for the spec, else :data:`PAGED_FALLBACK`'s (cached)."""
    return _paged(backend, spec_json, write=True)


registry.on_reload(kernel.cache_clear)
registry.on_reload(paged_kernel.cache_clear)
registry.on_reload(paged_writer.cache_clear)


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


def attend_window(backend: str, spec_json: str, layer: int, q: torch.Tensor, kfields: list[torch.Tensor],
                  vfields: list[torch.Tensor], tokens: list[int], window_k: torch.Tensor, window_v: torch.Tensor,
                  scale: float, head_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``attend_window`` over blocks whose fields come flat, block after block, in layout order."""
    impl = kernel(backend, spec_json)
    spec = spec_from_json(spec_json)
    knames, vnames = field_names(spec, "keys"), field_names(spec, "values")
    blocks = [(dict(zip(knames, kfields[i * len(knames):(i + 1) * len(knames)])),
               dict(zip(vnames, vfields[i * len(vnames):(i + 1) * len(vnames)])), t) for i, t in enumerate(tokens)]
    b, hk, _, d = window_k.shape
    ctx = context(spec_json, layer, (b, hk, sum(tokens), d), q.device, head_offset)
    out, lse = impl.attend_window(q, blocks, window_k, window_v, ctx, scale)
    inputs = [q, *kfields, *vfields, window_k, window_v]
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
