"""What a torch-tensor backend's table kernels receive and subclass, and the constant cache.

A kernel class (one per method and backend, listed in :mod:`kvq_core.dispatch.table`) subclasses
:class:`TorchMethod` and gets a :class:`TorchContext` whose constants are tensors on the data's
device, fetched once per (spec, kv_heads, layer, device) by :func:`consts_for`.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from kvq_core.constants import constants
from kvq_core.dispatch.table import spec_from_json
from kvq_core.spec import MethodSpec

Fields = dict[str, torch.Tensor]
Consts = Mapping[str, torch.Tensor]


class TorchContext(NamedTuple):
    """The torch twin of :class:`kvq_core.kernels.KernelContext`: the spec, the layer, the K/V
    block shape ``(batch, kv_heads, tokens, head_dim)`` (ints or SymInts) and the spec's
    constants as tensors on the data's device (float32 where the core gives float32), those of
    the kv heads from global head ``head_offset`` on (a tensor-parallel rank's)."""

    spec: MethodSpec
    layer: int
    shape: tuple[Any, Any, Any, Any]
    consts: Consts
    head_offset: int = 0


class TorchMethod:
    """Base of a method's kernels on a torch-tensor backend (one subclass per method and backend).

    Subclasses implement the five functions of :class:`kvq_core.kernels.MethodKernels` on torch
    tensors with a :class:`TorchContext` (tensor constants) in place of the NumPy one:

    - ``encode_keys(k, ctx) -> dict`` of fields (any float dtype in; compute in float32),
    - ``decode_keys(fields, ctx) -> float32 [b, h, t, d]``,
    - ``encode_values`` / ``decode_values`` likewise,
    - ``attend(q, kfields, vfields, ctx, scale) -> (out float32 [b, hq, lq, d], lse float32 [b, hq, lq])``;
    - for a codec that clips, ``clips(kind)`` and ``ste_grad`` (``kvq::fake_quant``'s gradient).

    Field dtypes and shapes must be exactly the spec's layout (uint8 code rows, float16/float32
    side fields). Read sizes from the tensors or from ``ctx.shape``.
    """

    def __init__(self, spec: MethodSpec) -> None:
        self.spec = spec

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        raise NotImplementedError

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        raise NotImplementedError

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return self.encode_keys(v, ctx)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self.decode_keys(fields, ctx)

    def attend(
        self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def clips(self, kind: str) -> bool:
        """Whether encoding ``kind`` clips: some inputs lie outside the range the codes can
        represent, beyond rounding. False (the default): ``kvq::fake_quant``'s straight-through
        gradient is the identity; True: it is :meth:`ste_grad`."""
        return False

    def ste_grad(self, x: torch.Tensor, grad: torch.Tensor, ctx: TorchContext, kind: str) -> torch.Tensor:
        """The straight-through gradient at ``x`` of a codec that clips (:meth:`clips`): ``grad``
        with the clipped components zeroed, in the domain where the codec clips. It must be linear
        in ``grad`` and symmetric (its own adjoint), which ``kvq::fake_quant_grad``'s own
        gradient relies on."""
        raise NotImplementedError(f"{type(self).__name__} clips {kind} but has no ste_grad")


_consts_cache: dict[tuple[str, int, int, str, int], dict[str, torch.Tensor]] = {}
_cache_lock = threading.Lock()


def consts_for(spec_json: str, kv_heads: int, layer: int, device: torch.device | str,
               head_offset: int = 0) -> dict[str, torch.Tensor]:
    """The core's constants of (spec, kv_heads, layer, head_offset) as tensors on ``device``, computed once.

    Call this outside traced code (the op bodies and the compiled backend do)."""
    key = (spec_json, int(kv_heads), int(layer), str(torch.device(device)), int(head_offset))
    hit = _consts_cache.get(key)
    if hit is not None:
        return hit
    arrays = constants(spec_from_json(spec_json), int(kv_heads), int(layer), int(head_offset))
    tensors = {name: torch.tensor(arr, device=device) for name, arr in arrays.items()}
    with _cache_lock:
        _consts_cache.setdefault(key, tensors)
    return _consts_cache[key]


def field_names(spec: MethodSpec, kind: str) -> tuple[str, ...]:
    """Field names of ``kind`` ("keys"/"values") in layout order (they do not depend on the shape)."""
    make = spec.key_layout if kind == "keys" else spec.value_layout
    return tuple(make(1, 1, 1))


def context(spec_json: str, layer: int, shape: Any, device: torch.device, head_offset: int = 0) -> TorchContext:
    """The context of one op call: spec, layer, block shape and constants on ``device`` (of the kv
    heads from global head ``head_offset`` on)."""
    return TorchContext(spec_from_json(spec_json), layer, tuple(shape),
                        consts_for(spec_json, shape[1], layer, device, head_offset), head_offset)
