"""``kvq::write_paged`` on the Numba CPU kernels (OCTOPUS, OScaR, KIVI): the step's K and V encoded
by the backend's own encoders (:mod:`kvq_numba.octopus`, :mod:`kvq_numba.intcodes`) and their
fields written byte for byte into the page rows at the slots
(:func:`kvq_numba.cpu_paged_write.scatter_rows`, pages of any strides): no field tensors, no
``PageLayout.pack``, no torch indexing. Specs numba does not run and CUDA tensors take the torch
writer (``kvq_torch.paged_write``, the reference, through the table).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvq_core.constants import constants
from kvq_core.dispatch.table import PAGED_FALLBACK, paged_writer
from kvq_core.kernels import KernelContext, resolve
from kvq_core.paged import GROUP, HEADS, PageLayout, step_blocks
from kvq_core.spec import MethodSpec
from kvq_numba import cpu_paged_write
from kvq_numba.arrays import as_float32
from kvq_numba.plugin import KERNELS, supports

_STRIPES = {GROUP: cpu_paged_write.GROUP, HEADS: cpu_paged_write.HEADS}


class PagedWriteNumba:
    """The paged write of one spec on the Numba CPU kernels (module docstring)."""

    def __init__(self, spec: MethodSpec) -> None:
        self.spec, self.spec_json = spec, spec.to_json()
        self.impl = resolve(KERNELS[spec.method])(spec)
        self.fast = supports(spec, "cpu")[0]
        self._layouts: dict[tuple[int, int], tuple[PageLayout, np.ndarray]] = {}

    def _layout(self, block_size: int, kv_heads: int) -> tuple[PageLayout, np.ndarray]:
        """The page layout and its field descriptors (``cpu_paged_write.DESC`` columns, layout order)."""
        key = (block_size, kv_heads)
        if key not in self._layouts:
            layout = PageLayout(self.spec, block_size, kv_heads)
            desc = np.array([(_STRIPES.get(s.stripe, cpu_paged_write.TOKEN), s.start, s.width, s.nbytes)
                             for s in layout.slots], np.int64)
            self._layouts[key] = (layout, desc)
        return self._layouts[key]

    def write_paged(self, layer: int, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                    slot_mapping: torch.Tensor, head_offset: int = 0) -> None:
        if key.device.type != "cpu" or not self.fast:
            paged_writer(PAGED_FALLBACK, self.spec_json).write_paged(layer, key, value, pages, slot_mapping, head_offset)
            return
        n, heads, d = key.shape
        if n == 0:
            return
        layout, desc = self._layout(pages.shape[2], heads)
        k = as_float32(step_blocks(key.detach().to(torch.float32).numpy(), layout.group))
        v = as_float32(step_blocks(value.detach().to(torch.float32).numpy(), layout.group))
        ctx = KernelContext(self.spec, layer, k.shape, constants(self.spec, heads, layer, head_offset=head_offset))
        kf, vf = self.impl.encode_keys(k, ctx), self.impl.encode_values(v, ctx)
        fields = tuple(_source_rows((kf if s.kind == "keys" else vf)[s.name], s.stripe == HEADS)
                       for s in layout.slots)
        cpu_paged_write.scatter_rows(fields, desc, k.shape[2], layout.group,
                                     slot_mapping.numpy().astype(np.int64, copy=False), pages.numpy())


def _source_rows(a: Any, shared: bool) -> np.ndarray:
    """A field as uint8 source rows: ``[B * heads * T|groups, nbytes]`` (``[B * T, nbytes]`` when shared by the heads)."""
    a = np.ascontiguousarray(a)
    lead = a.shape[0] * a.shape[1] if shared else a.shape[0] * a.shape[1] * a.shape[2]
    return a.view(np.uint8).reshape(lead, -1)
