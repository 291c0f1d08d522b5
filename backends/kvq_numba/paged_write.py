"""``kvq::write_paged`` on the Numba CPU kernels (OCTOPUS, OScaR, KIVI): the step's K and V encoded
by the backend's own kernels and written byte for byte into the page rows at the slots (pages of
any strides): no field tensors, no ``PageLayout.pack``, no torch indexing. Specs numba does not run
and CUDA tensors take the torch writer (``kvq_torch.paged_write``, the reference, through the table).

- OCTOPUS: one kernel per call, :func:`kvq_numba.cpu.page_writes.write_octopus`, encodes each
  token's K and V rows straight into its page row. It runs once per layer and decode step (30
  layers, a few tokens each), so the Python around it is the minimum: its constants and columns
  are built once per (layer, head offset, page shape), a small write runs the single-threaded
  kernel (no thread-count switch), a large one the parallel kernel.
- OScaR, KIVI: the encoders (:mod:`kvq_numba.intcodes`, whole key groups) then
  :func:`kvq_numba.cpu.page_writes.scatter_rows` (a group's statistics striped over its rows).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvq_core.constants import constants
from kvq_core.torch_ops.run import PAGED_FALLBACK, paged_writer
from kvq_core.contract import KernelContext
from kvq_core.paged import GROUP, HEADS, PageLayout, step_blocks
from kvq_core.registry import kernel_factory
from kvq_core.spec import MethodSpec
from kvq_numba import threads
from kvq_numba.cpu import page_writes
from kvq_numba.arrays import as_float32
from kvq_numba.plugin import NAME, supports

_STRIPES = {GROUP: page_writes.GROUP, HEADS: page_writes.HEADS}
#: float16 values of an OCTOPUS spec whose values are coded (none)
_NO_HALVES = np.zeros((0, 1, 1), np.uint16)


class PagedWriteNumba:
    """The paged write of one spec on the Numba CPU kernels (module docstring)."""

    def __init__(self, spec: MethodSpec) -> None:
        self.spec, self.spec_json = spec, spec.to_json()
        self.impl = kernel_factory(NAME, spec.method)(spec)
        self.fast = supports(spec, "cpu")[0]
        self._layouts: dict[tuple[int, int], tuple[PageLayout, np.ndarray]] = {}
        self._octopus: dict[tuple[int, int, int, int], tuple[Any, ...]] = {}

    def _layout(self, block_size: int, kv_heads: int) -> tuple[PageLayout, np.ndarray]:
        """The page layout and its field descriptors (``page_writes.DESC`` columns, layout order)."""
        key = (block_size, kv_heads)
        if key not in self._layouts:
            layout = PageLayout(self.spec, block_size, kv_heads)
            desc = np.array([(_STRIPES.get(s.stripe, page_writes.TOKEN), s.start, s.width, s.nbytes)
                             for s in layout.slots], np.int64)
            self._layouts[key] = (layout, desc)
        return self._layouts[key]

    def _octopus_args(self, layer: int, head_offset: int, block_size: int, kv_heads: int) -> tuple[Any, ...]:
        """:func:`page_writes.write_octopus`'s arguments after ``(key, value, vhalf, slots)`` up to
        ``pages``: the layer's constants and the row's columns, built once per (layer, head offset, page shape)."""
        key = (layer, head_offset, block_size, kv_heads)
        args = self._octopus.get(key)
        if args is None:
            s, layout = self.spec, self._layout(block_size, kv_heads)[0]
            c = constants(s, kv_heads, layer, head_offset)
            value_first = "data" if self.impl.values_fp16 else "codes"
            starts = np.array([layout.slot("keys", "codes").start, layout.slot("keys", "norm").start,
                               layout.slot("values", value_first).start,
                               0 if self.impl.values_fp16 else layout.slot("values", "norm").start], np.int64)
            args = (np.ascontiguousarray(c["signs"], np.float32), self.impl.inv_sqrt_d, c["xi_thresholds"],
                    c["eta_thresholds"], c["rho_thresholds"], np.ascontiguousarray(c["directions"]),
                    c["xi_codebook"].size, c["eta_codebook"].size, s.eta_bits, s.rho_bits, s.triplet_bits,
                    s.rounding == "joint", starts)
            self._octopus[key] = args
        return args

    def write_paged(self, layer: int, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                    slot_mapping: torch.Tensor, head_offset: int = 0) -> None:
        if key.device.type != "cpu" or not self.fast:
            paged_writer(PAGED_FALLBACK, self.spec_json).write_paged(layer, key, value, pages, slot_mapping, head_offset)
            return
        n, heads, d = key.shape
        if n == 0:
            return
        if self.spec.method == "octopus":
            self._write_octopus(layer, key, value, pages, slot_mapping, head_offset)
            return
        layout, desc = self._layout(pages.shape[2], heads)
        k = as_float32(step_blocks(_host(key), layout.group))
        v = as_float32(step_blocks(_host(value), layout.group))
        ctx = KernelContext(self.spec, layer, k.shape, constants(self.spec, heads, layer, head_offset=head_offset))
        kf, vf = self.impl.encode_keys(k, ctx), self.impl.encode_values(v, ctx)
        fields = tuple(_source_rows((kf if s.kind == "keys" else vf)[s.name], s.stripe == HEADS)
                       for s in layout.slots)
        page_writes.scatter_rows(fields, desc, k.shape[2], layout.group,
                                     slot_mapping.numpy().astype(np.int64, copy=False), pages.numpy())

    def _write_octopus(self, layer: int, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                       slot_mapping: torch.Tensor, head_offset: int) -> None:
        """OCTOPUS: one kernel call (module docstring); K and V as float32 NumPy views of any strides."""
        n, heads, d = key.shape
        args = self._octopus_args(layer, head_offset, pages.shape[2], heads)
        k, v = _host(key), _host(value)
        vhalf = v.astype(np.float16).view(np.uint16) if self.impl.values_fp16 else _NO_HALVES
        work = 2 * n * heads * d * threads.OCTOPUS_ENCODE_WEIGHT
        if work < threads.PARALLEL_MIN_WORK:
            page_writes.write_octopus(k, v, vhalf, slot_mapping.numpy(), *args, pages.numpy())
        else:
            threads.run(work, page_writes.write_octopus_parallel, k, v, vhalf, slot_mapping.numpy(), *args,
                        pages.numpy())


def _host(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a float32 NumPy array (a view when it is float32 already)."""
    return x.detach().to(torch.float32).numpy()


def _source_rows(a: Any, shared: bool) -> np.ndarray:
    """A field as uint8 source rows: ``[B * heads * T|groups, nbytes]`` (``[B * T, nbytes]`` when shared by the heads)."""
    a = np.ascontiguousarray(a)
    lead = a.shape[0] * a.shape[1] if shared else a.shape[0] * a.shape[1] * a.shape[2]
    return a.view(np.uint8).reshape(lead, -1)
