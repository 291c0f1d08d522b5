"""What a torch-tensor backend's kernels receive, and the constant cache.

A kernel class of a ``torch_ops`` backend (a ``kvq_torch.common.TorchMethod`` subclass, one per
method and backend, held by the registry) gets a :class:`TorchContext` whose constants are tensors
on the data's device, fetched once per (spec, kv_heads, layer, device) by :func:`consts_for`; the
op's ``spec_json`` names the spec (:func:`spec_from_json`).
"""
from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from kvq_core import registry
from kvq_core.constants import constants
from kvq_core.spec import MethodSpec

Fields = dict[str, torch.Tensor]
Consts = Mapping[str, torch.Tensor]


class TorchContext(NamedTuple):
    """The torch twin of :class:`kvq_core.contract.KernelContext`: the spec, the layer, the K/V
    block shape ``(batch, kv_heads, tokens, head_dim)`` (ints or SymInts) and the spec's
    constants as tensors on the data's device (float32 where the core gives float32), those of
    the kv heads from global head ``head_offset`` on (a tensor-parallel rank's)."""

    spec: MethodSpec
    layer: int
    shape: tuple[Any, Any, Any, Any]
    consts: Consts
    head_offset: int = 0


@functools.lru_cache(maxsize=1024)
def spec_from_json(spec_json: str) -> MethodSpec:
    """The spec a ``kvq::`` op's ``spec_json`` string names (cached per string)."""
    return registry.spec_from_dict(json.loads(spec_json))


registry.on_reload(spec_from_json.cache_clear)

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
