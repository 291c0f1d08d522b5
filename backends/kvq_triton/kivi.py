"""KIVI on Triton (mirrors ``kvq_numpy/kivi.py``): keys per channel over token groups, values per
token over channel groups, float minimum as the zero-point; no rotation, so attention reads the
queries as they are."""
from __future__ import annotations

import torch

from kvq_torch.common import Fields, TorchContext, TorchMethod
from kvq_triton import attention, intcodes


class KiviTriton(TorchMethod):
    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return intcodes.quantize(k, self.spec.bits, self.spec.group, along_tokens=True, integer_zero=False)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return intcodes.dequantize(fields, self.spec.bits, self.spec.group, True, ctx.shape)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return intcodes.quantize(v, self.spec.bits, self.spec.group, along_tokens=False, integer_zero=False)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return intcodes.dequantize(fields, self.spec.bits, self.spec.group, False, ctx.shape)

    def attend(self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float):
        b, hq, lq, d = q.shape
        keys = attention.Stored(attention.INT_TOKENS, kfields["codes"], self.spec.bits, kfields["scale"],
                                kfields["offset"], group=self.spec.group)
        values = attention.Stored(attention.INT_CHANNELS, vfields["codes"], self.spec.bits, vfields["scale"],
                                  vfields["offset"], group=self.spec.group)
        out, lse = attention.attend(q.to(torch.float32).reshape(b, ctx.shape[1], -1, d), keys, values, scale)
        return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)
