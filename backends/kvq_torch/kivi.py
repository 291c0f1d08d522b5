"""Torch kernels of ``kivi`` (mirrors ``kvq_numpy/kivi.py``): keys per channel over token groups,
values per token over channel groups, with the shared asymmetric quantizer of common.py."""
from __future__ import annotations

import torch

from kvq_torch.common import (
    Fields,
    TorchContext,
    TorchMethod,
    asym_dequantize,
    asym_quantize,
    group_channels,
    group_tokens,
    pack_codes,
    softmax_attend,
    ungroup_tokens,
    unpack_codes,
)


class KiviTorch(TorchMethod):
    def _codes(self, fields: Fields) -> torch.Tensor:
        return unpack_codes(fields["codes"], self.spec.bits, self.spec.head_dim, torch.uint8)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        codes, scale, offset = asym_quantize(group_tokens(k.float(), self.spec.group), self.spec.bits, 3, "min")
        codes = ungroup_tokens(codes, k.shape[2])
        return {"codes": pack_codes(codes, self.spec.bits), "scale": scale, "offset": offset}

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        codes = group_tokens(self._codes(fields), self.spec.group)
        return ungroup_tokens(asym_dequantize(codes, fields["scale"], fields["offset"], dim=3), ctx.shape[2])

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        codes, scale, offset = asym_quantize(group_channels(v.float(), self.spec.group), self.spec.bits, 4, "min")
        return {"codes": pack_codes(codes.reshape(v.shape), self.spec.bits), "scale": scale, "offset": offset}

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        codes = group_channels(self._codes(fields), self.spec.group)
        v = asym_dequantize(codes, fields["scale"], fields["offset"], dim=4)
        return v.reshape(*v.shape[:-2], self.spec.head_dim)

    def attend(self, q, kfields: Fields, vfields: Fields, ctx: TorchContext, scale):
        """KIVI's fused kernel is dequantize-then-matmul, as the reference."""
        return softmax_attend(q, self.decode_keys(kfields, ctx), self.decode_values(vfields, ctx), scale)
