"""Packed KV pages: one byte row per (token, kv head) holding a token's K fields then its V fields.

vLLM's block manager allocates ``uint8`` pages, seen as ``[num_blocks, kv_heads, block_size, row_bytes]``;
this module maps a per-token kvq layout onto those rows and back, and gathers a request's rows
from its block table. Pure torch, no vLLM import: the layout is tested on its own.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvq_core.errors import SpecError
from kvq_core.layout import token_separable
from kvq_core.spec import MethodSpec

Fields = dict[str, torch.Tensor]


class Slot(NamedTuple):
    """One field's bytes ``[start, stop)`` in a row; ``tail`` is its per-token shape (after b, h, t)."""

    kind: str
    name: str
    dtype: torch.dtype
    tail: tuple[int, ...]
    start: int
    stop: int


class PageLayout:
    """Where each packed field of ``spec`` lies in a token's row (keys first, then values).

    Only per-token layouts fit a page row: every field must be ``(batch, kv_heads, tokens, ...)``
    with nothing shared across tokens or heads (:func:`kvq_core.layout.token_separable`).
    """

    def __init__(self, spec: MethodSpec) -> None:
        for kind in ("keys", "values"):
            if not token_separable(spec, kind):
                raise SpecError(spec.method, "method", spec.method,
                                f"a codec whose {kind} are coded per token (octopus, turboquant, turboquant_prod, "
                                "quarot, polarquant, qjl, fp16); its statistics span tokens, which a vLLM page "
                                "row cannot hold (see plugins/kvq-vllm/README.md)")
        self.spec = spec
        slots, offset = [], 0
        for kind, make in (("keys", spec.key_layout), ("values", spec.value_layout)):
            for name, f in make(1, 1, 1).items():
                dtype = getattr(torch, f.dtype)
                size = math.prod(f.shape[3:]) * dtype.itemsize
                slots.append(Slot(kind, name, dtype, tuple(f.shape[3:]), offset, offset + size))
                offset += size
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.row_bytes: int = offset
        self.key_bytes: int = sum(s.stop - s.start for s in slots if s.kind == "keys")

    def pack(self, kfields: Fields, vfields: Fields) -> torch.Tensor:
        """``uint8 [b, h, t, row_bytes]`` rows of a block's key and value fields."""
        parts = []
        for s in self.slots:
            f = (kfields if s.kind == "keys" else vfields)[s.name]
            parts.append(f.contiguous().reshape(*f.shape[:3], -1).view(torch.uint8))
        return torch.cat(parts, dim=-1)

    def unpack(self, rows: torch.Tensor) -> tuple[Fields, Fields]:
        """``(key fields, value fields)`` of ``uint8 [b, h, t, row_bytes]`` rows (fresh tensors)."""
        out: dict[str, Fields] = {"keys": {}, "values": {}}
        lead = rows.shape[:3]
        for s in self.slots:
            raw = rows[..., s.start:s.stop].contiguous().view(s.dtype)
            out[s.kind][s.name] = raw.reshape(*lead, *s.tail)
        return out["keys"], out["values"]


def write_slots(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter token rows ``[n, h, row_bytes]`` into ``cache`` at flat slots ``block * block_size + offset``.

    ``cache`` is vLLM's logical page view ``[blocks, h, block_size, row_bytes]`` (any strides: the
    physical order is vLLM's layout); negative slots (padding) are skipped.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    slots = slot_mapping.to(torch.long)
    block_size = cache.shape[2]
    cache[slots // block_size, :, slots % block_size] = rows


def read_tokens(cache: torch.Tensor, block_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The first ``tokens`` rows of a request, ``[1, h, tokens, row_bytes]``, from its blocks
    ``block_ids`` (a block-table row) of ``cache [blocks, h, block_size, row_bytes]``."""
    block_size = cache.shape[2]
    needed = -(-tokens // block_size)
    pages = cache.index_select(0, block_ids[:needed].to(torch.long))  # [n, h, bs, row]
    rows = pages.permute(1, 0, 2, 3).reshape(cache.shape[1], needed * block_size, cache.shape[3])
    return rows[:, :tokens].unsqueeze(0)
