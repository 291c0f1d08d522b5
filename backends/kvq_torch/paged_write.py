"""``kvq::write_paged`` in plain torch, for every method: the reference and the fallback of any
backend without its own paged writer.

The step's tokens are encoded as blocks (:func:`kvq_core.paged.step_blocks`) by ``kvq::encode`` on
the torch backend, packed into rows (:meth:`kvq_core.paged.PageLayout.pack`) and scattered to their
slots. No host read of a device tensor: padding slots (``< 0``) are first written to slot 0, which
is then restored (or given the row of the token whose slot is 0).
"""
from __future__ import annotations

import torch

import kvq_core.torch_ops.ops  # noqa: F401  (defines the kvq:: ops)
from kvq_core.torch_ops.torch_kernels import field_names
from kvq_core.paged import PageLayout, step_blocks
from kvq_core.spec import MethodSpec


class PagedWriteTorch:
    """The reference paged write of one spec (encode with ``backend``'s ``kvq::encode``, pack, scatter)."""

    def __init__(self, spec: MethodSpec, backend: str = "torch") -> None:
        self.spec, self.spec_json, self.backend = spec, spec.to_json(), backend
        self.names = {kind: field_names(spec, kind) for kind in ("keys", "values")}
        self._layouts: dict[tuple[int, int], PageLayout] = {}

    def layout(self, block_size: int, kv_heads: int) -> PageLayout:
        """The page layout of this spec for pages of ``block_size`` tokens and ``kv_heads`` heads (cached)."""
        key = (block_size, kv_heads)
        if key not in self._layouts:
            self._layouts[key] = PageLayout(self.spec, block_size, kv_heads)
        return self._layouts[key]

    def rows(self, layer: int, key: torch.Tensor, value: torch.Tensor, layout: PageLayout,
             head_offset: int = 0) -> torch.Tensor:
        """``uint8 [n, kv_heads, row_bytes]``: the packed row of every token of ``key``/``value [n, kv_heads, d]``."""
        fields = []
        for kind, x in (("keys", key), ("values", value)):
            # contiguous: the rotation's matmul rounds by memory layout on some CPUs (AVX-512), and the
            # blocks must code exactly as the same blocks handed to kvq::encode by a Quantizer
            blocks = step_blocks(x, layout.group).contiguous()
            out = torch.ops.kvq.encode(self.backend, self.spec_json, layer, kind, blocks, head_offset)
            fields.append(dict(zip(self.names[kind], out)))
        rows = layout.pack(*fields)  # [B, h, T, row]
        return rows.permute(0, 2, 1, 3).reshape(key.shape[0], key.shape[1], layout.row_bytes)

    def write_paged(self, layer: int, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                    slot_mapping: torch.Tensor, head_offset: int = 0) -> None:
        n = key.shape[0]
        if n == 0:
            return
        layout = self.layout(pages.shape[2], pages.shape[1])
        rows = self.rows(layer, key, value, layout, head_offset)
        slots = slot_mapping.to(torch.long)
        at = slots.clamp(min=0)
        keep = pages[0, :, 0].clone()
        pages[at // layout.block_size, :, at % layout.block_size] = rows
        hit = slots == 0  # a token's own slot 0 wins over the padding written there
        last = (hit.long() * torch.arange(1, n + 1, device=slots.device)).argmax()
        pages[0, :, 0] = torch.where(hit.any(), rows[last], keep)
