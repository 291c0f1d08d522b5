"""Torch kernels of the ``fp16`` identity codec (mirrors ``kvq_numpy/fp16.py``)."""
from __future__ import annotations

import torch

from kvq_torch.common import Fields, TorchContext, TorchMethod, softmax_attend


class Fp16Torch(TorchMethod):
    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return {"data": k.to(getattr(torch, self.spec.storage), copy=True)}

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return fields["data"].to(torch.float32, copy=True)

    def attend(self, q, kfields: Fields, vfields: Fields, ctx: TorchContext, scale):
        return softmax_attend(q, kfields["data"], vfields["data"], scale)
