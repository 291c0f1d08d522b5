"""OScaR on Triton (mirrors ``kvq_numpy/oscar.py``; specs/oscar.md 1.2-1.4 and 2).

Host glue in torch: the Hadamard rotation as one matmul and the omni-token norm (the torch
backend's helpers, so the float32 input to the quantizer is the same). Triton: the group
quantizer and packing (:mod:`kvq_triton.intcodes`), the tile decoder (:mod:`kvq_triton.tiles`),
and the fused split-KV attention (:mod:`kvq_triton.attention`), which multiplies each logit by the token norm.
"""
from __future__ import annotations

import torch

from kvq_torch.common import Fields, TorchContext, TorchMethod, hadamard_rotate
from kvq_torch.oscar import token_norms
from kvq_triton import attention, intcodes, tiles
from kvq_triton.tiles import BATCH_SCALE, INT_CHANNELS, INT_TOKENS, NO_SCALE, Stored


class OscarTriton(TorchMethod):
    """OScaR: keys per channel over token groups, values per token over channel groups."""

    def _rotate(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """``x @ H`` (H is its own inverse), or float32 x when the spec does not rotate."""
        return hadamard_rotate(x, ctx.consts["hadamard"]) if self.spec.rotation else x.to(torch.float32)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        kr = self._rotate(k, ctx)
        norm = token_norms(kr) if self.spec.token_scaling else None
        u = kr if norm is None else kr / norm[:, None, :, None]
        fields = intcodes.quantize(u, self.spec.bits, self.spec.key_group, along_tokens=True, integer_zero=True)
        if norm is not None:
            fields["norm"] = norm
        return fields

    def _keys(self, fields: Fields) -> Stored:
        """Unit keys, each token's logit (or row) scaled by its norm when the spec has OTS."""
        return Stored(INT_TOKENS, fields["codes"], self.spec.bits, fields["scale"], fields["offset"],
                      group=self.spec.key_group, token_scale=fields.get("norm"),
                      scale_mode=BATCH_SCALE if self.spec.token_scaling else NO_SCALE)

    def _values(self, fields: Fields) -> Stored:
        return Stored(INT_CHANNELS, fields["codes"], self.spec.bits, fields["scale"], fields["offset"],
                      group=self.spec.value_group)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._rotate(tiles.decode(self._keys(fields), ctx.shape), ctx)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return intcodes.quantize(self._rotate(v, ctx), self.spec.bits, self.spec.value_group,
                                 along_tokens=False, integer_zero=True)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._rotate(tiles.decode(self._values(fields), ctx.shape), ctx)

    def attend(self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float):
        """Rotate q once, score the unit keys times the token norm, un-rotate the output once."""
        b, hq, lq, d = q.shape
        hk = ctx.shape[1]
        q_rot = self._rotate(q, ctx).reshape(b, hk, -1, d)
        out, lse = attention.attend(q_rot, self._keys(kfields), self._values(vfields), scale)
        return self._rotate(out, ctx).reshape(b, hq, lq, d), lse.reshape(b, hq, lq)
