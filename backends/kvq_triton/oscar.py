"""OScaR on Triton (mirrors ``kvq_numpy/oscar.py``; specs/oscar.md 1.2-1.4 and 2).

Host glue in torch: the Hadamard rotation as one matmul and the omni-token norm (the torch
backend's helpers, so the float32 input to the quantizer is the same). Triton: the group
quantizer and packing (:mod:`kvq_triton.intcodes`), the dequantizer, and the fused split-KV
attention (:mod:`kvq_triton.attention`), which multiplies each logit by the token norm.
"""
from __future__ import annotations

import torch

from kvq_torch.common import Fields, TorchContext, TorchMethod, hadamard_rotate
from kvq_torch.oscar import token_norms
from kvq_triton import attention, intcodes


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

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        k = intcodes.dequantize(fields, self.spec.bits, self.spec.key_group, True, ctx.shape)
        if self.spec.token_scaling:
            k = k * fields["norm"][:, None, :, None]
        return self._rotate(k, ctx)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return intcodes.quantize(self._rotate(v, ctx), self.spec.bits, self.spec.value_group,
                                 along_tokens=False, integer_zero=True)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._rotate(intcodes.dequantize(fields, self.spec.bits, self.spec.value_group, False, ctx.shape), ctx)

    def attend(self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float):
        """Rotate q once, score the unit keys times the token norm, un-rotate the output once."""
        b, hq, lq, d = q.shape
        hk = ctx.shape[1]
        q_rot = self._rotate(q, ctx).reshape(b, hk, -1, d)
        keys = attention.Stored(
            attention.INT_TOKENS, kfields["codes"], self.spec.bits, kfields["scale"], kfields["offset"],
            group=self.spec.key_group, token_scale=kfields.get("norm"),
            scale_mode=attention.BATCH_SCALE if self.spec.token_scaling else attention.NO_SCALE)
        values = attention.Stored(attention.INT_CHANNELS, vfields["codes"], self.spec.bits, vfields["scale"],
                                  vfields["offset"], group=self.spec.value_group)
        out, lse = attention.attend(q_rot, keys, values, scale)
        return self._rotate(out, ctx).reshape(b, hq, lq, d), lse.reshape(b, hq, lq)
