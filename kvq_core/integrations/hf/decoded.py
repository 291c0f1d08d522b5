"""A layer's decoded history: a float copy of its packed tokens, for ``attention="dequant"``.

In dequant mode every step hands the model full K/V (decoded blocks + exact window). Decoding is
deterministic, so decoding each block once and keeping the result is exact and saves decoding
the whole history every step; the copy costs memory (``KVQCache.memory_report()``'s
``decoded_bytes``) and is dropped, to be rebuilt on demand, whenever the blocks are rewritten
(a restored step, a crop across it).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvq_core.integrations.hf.flush import blocks_before

Pair = tuple[torch.Tensor, torch.Tensor]


class DecodedHistory:
    """Packed tokens ``[evicted, upto)`` of one layer decoded, extended as blocks arrive."""

    __slots__ = ("kv", "upto")

    def __init__(self) -> None:
        self.kv: Pair | None = None
        self.upto = 0  # absolute position: the stored tokens before it are in ``kv``

    def clear(self) -> None:
        """Free the copy (rebuilt on demand)."""
        self.kv, self.upto = None, 0

    def extend(self, block_tokens: Sequence[int], evicted: int, packed_length: int,
               decode: Callable[[int], Pair]) -> Pair | None:
        """The copy brought up to ``packed_length``, decoding (with ``decode(block index)``) only
        the blocks, or block tails, it lacks; blocks hold ``block_tokens`` tokens from ``evicted``."""
        if self.upto < packed_length:
            first, skip = blocks_before(block_tokens, evicted, max(self.upto, evicted))
            parts = [] if self.kv is None else [self.kv]
            for i in range(first, len(block_tokens)):
                k, v = decode(i)
                parts.append((k[:, :, skip:], v[:, :, skip:]))
                skip = 0
            self.kv = (torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-2))
            self.upto = packed_length
        return self.kv

    def drop_front(self, gone: int, evicted: int) -> None:
        """The layer dropped its first ``gone`` stored tokens, up to position ``evicted``."""
        if self.kv is not None and self.upto > evicted:
            self.kv = (self.kv[0][:, :, gone:], self.kv[1][:, :, gone:])
        else:
            self.clear()

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` stored tokens (a crop of a layer that evicted none)."""
        if self.kv is not None:
            self.kv = (self.kv[0][:, :, :tokens], self.kv[1][:, :, :tokens])
            self.upto = min(self.upto, tokens)

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (in that order)."""
        if self.kv is not None:
            self.kv = (self.kv[0].index_select(0, index.to(self.kv[0].device)),
                       self.kv[1].index_select(0, index.to(self.kv[1].device)))

    def nbytes(self) -> int:
        """Bytes the copy holds."""
        if self.kv is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.kv)
