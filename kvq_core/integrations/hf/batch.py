"""Batch and beam operations on a :class:`~kvq_core.integrations.hf.layer.KVQLayer` (beam search reorders,
batch selection, repeats): rows of the batch axis are selected in every packed field, the window
and the decoded history; codes are moved, never re-quantized."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvq_core.errors import KVQError
from kvq_core.packed import PackedKV
from kvq_core.tokens import inherit_validation

if TYPE_CHECKING:
    from kvq_core.integrations.hf.layer import KVQLayer


def take_batch(x: Any, index: torch.Tensor) -> Any:
    """Rows ``index`` of the leading (batch) axis of a backend array, in the same array type."""
    if isinstance(x, torch.Tensor):
        return x.index_select(0, index.to(x.device))
    return np.take(np.asarray(x), index.cpu().numpy(), axis=0)


def packed_take_batch(p: PackedKV, index: torch.Tensor) -> PackedKV:
    """A packed block with its batch rows selected (codes untouched: no re-quantization)."""
    layout = p.layout
    for name, field in layout.items():
        if not field.shape or field.shape[0] != p.shape[0]:
            raise KVQError(
                f"{p.spec.method} {p.kind} field {name!r} has shape {list(field.shape)} without a leading batch "
                f"axis of {p.shape[0]}; batch reordering needs one"
            )
    out = p.map_fields(lambda a: take_batch(a, index))
    out = dataclasses.replace(out, shape=(int(index.numel()), *p.shape[1:]))
    if index.numel():
        inherit_validation(out, [p])  # rows of a validated block: not scanned again
    return out


def select_batch(layer: KVQLayer, index: torch.Tensor) -> None:
    """Keep batch rows ``index`` (in that order, repeats allowed) of everything ``layer`` stores."""
    index = index.to(torch.long)
    layer.blocks = [(packed_take_batch(pk, index), packed_take_batch(pv, index)) for pk, pv in layer.blocks]
    if layer.window_length or (layer.keys is not None and layer.keys.dim() == 4):
        layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
        layer.values = layer.values.index_select(0, index.to(layer.values.device))
    layer.select_decoded(index)
    layer.packed_bytes = sum(pk.nbytes() + pv.nbytes() for pk, pv in layer.blocks)


def batch_size(layer: KVQLayer) -> int:
    """The batch ``layer`` holds (0 before its first tokens)."""
    if layer.blocks:
        return layer.blocks[0][0].shape[0]
    return layer.keys.shape[0] if layer.keys is not None and layer.keys.dim() == 4 else 0
