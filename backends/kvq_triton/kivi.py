"""KIVI on Triton (mirrors ``kvq_numpy/kivi.py``): keys per channel over token groups, values per
token over channel groups, the float group minimum as the zero-point. No rotation, so the fused
attention reads the queries as they are."""
from __future__ import annotations

import torch

from kvq_torch.common import Fields, TorchContext, TorchMethod
from kvq_triton import attention, intcodes, tiles
from kvq_triton.tiles import INT_CHANNELS, INT_TOKENS, Stored


class KiviTriton(TorchMethod):
    def _keys(self, fields: Fields) -> Stored:
        return Stored(INT_TOKENS, fields["codes"], self.spec.bits, fields["scale"], fields["offset"], group=self.spec.group)

    def _values(self, fields: Fields) -> Stored:
        return Stored(INT_CHANNELS, fields["codes"], self.spec.bits, fields["scale"], fields["offset"], group=self.spec.group)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return intcodes.quantize(k, self.spec.bits, self.spec.group, along_tokens=True, integer_zero=False)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return tiles.decode(self._keys(fields), ctx.shape)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return intcodes.quantize(v, self.spec.bits, self.spec.group, along_tokens=False, integer_zero=False)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return tiles.decode(self._values(fields), ctx.shape)

    def attend(self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float):
        b, hq, lq, d = q.shape
        q_grouped = q.to(torch.float32).reshape(b, ctx.shape[1], -1, d)
        out, lse = attention.attend(q_grouped, self._keys(kfields), self._values(vfields), scale)
        return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)
