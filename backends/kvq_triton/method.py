"""The base of every method's kernels on Triton: attention from the codes, one block or a layer.

A method says how its blocks are stored (:class:`kvq_triton.tiles.Stored`) and which rotation takes
queries and keys to the codes' domain and brings the output back from the values' domain; this
class runs the fused kernels: :mod:`kvq_triton.attention` for ``attend`` (one block) and
:mod:`kvq_triton.window` for ``attend_window`` (a layer's packed blocks then its exact window, one
online softmax: the ``kvq::attend_window`` op body on this backend).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvq_torch.common import Fields, TorchContext, TorchMethod
from kvq_torch.rotation import by_kv_head, from_kv_head
from kvq_triton import attention, window
from kvq_triton.tiles import Stored


class TritonMethod(TorchMethod):
    """A method's Triton kernels: subclasses add the encoders, decoders and the five hooks below."""

    def stored_keys(self, fields: Fields, ctx: TorchContext) -> Stored:
        """A block's keys as the tile decoder reads them."""
        raise NotImplementedError

    def stored_values(self, fields: Fields, ctx: TorchContext) -> Stored:
        """A block's values as the tile decoder reads them."""
        raise NotImplementedError

    def to_codes(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """Queries or keys ``[b, kv_heads, n, d]`` in the domain the keys are coded in (float32)."""
        raise NotImplementedError

    def to_values(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """Values ``[b, kv_heads, n, d]`` in the domain the values are coded in (float32)."""
        return self.to_codes(x, ctx)

    def from_values(self, out: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """An attention output ``[b, kv_heads, n, d]`` back from the values' domain (float32)."""
        raise NotImplementedError

    def attend(self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float):
        """Transform q once, score the coded keys, transform the output back once."""
        q_rot = self.to_codes(by_kv_head(q, ctx.shape[1]), ctx)
        out, lse = attention.attend(q_rot, self.stored_keys(kfields, ctx), self.stored_values(vfields, ctx), scale)
        return from_kv_head(self.from_values(out, ctx), tuple(q.shape)), from_kv_head(lse, tuple(q.shape))

    def attend_window(self, q: torch.Tensor, blocks: Sequence[tuple[Fields, Fields, int]], window_k: torch.Tensor,
                      window_v: torch.Tensor, ctx: TorchContext, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed ``blocks`` then the exact window in one fused kernel (:mod:`kvq_triton.window`);
        without blocks, the reference over the window alone."""
        if not blocks:
            return super().attend_window(q, blocks, window_k, window_v, ctx, scale)
        b, hk, _, d = ctx.shape
        stored = []
        for kfields, vfields, tokens in blocks:
            part = ctx._replace(shape=(b, hk, tokens, d))
            stored.append((self.stored_keys(kfields, part), self.stored_values(vfields, part)))
        q_rot = self.to_codes(by_kv_head(q, hk), ctx)
        out, lse = window.attend(q_rot, int(q.shape[2]), stored, self.to_codes(window_k, ctx),
                                 self.to_values(window_v, ctx), scale)
        return from_kv_head(self.from_values(out, ctx), tuple(q.shape)), from_kv_head(lse, tuple(q.shape))
