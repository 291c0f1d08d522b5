"""Torch kernels of QJL (mirrors ``kvq_numpy/qjl.py``; the codec is described in :mod:`kvq_core.methods.qjl`).

The sign sketch itself is :mod:`kvq_torch.sketch` (shared with TurboQuant_prod). Arrays are
[batch, kv_heads, rows, ...]; each kv head has its own sketch S (kv_heads, m, d).
Values are KIVI's per-token codec, reusing :class:`kvq_torch.intcodes.IntCodesTorch`. The key norm is
bit-identical to the reference; S k is a float32 matmul in the BLAS's order, so a sign bit can
differ from it only where a sketch entry is within rounding of 0.
"""
from __future__ import annotations

import torch

from kvq_core.methods.qjl import QJLSpec
from kvq_torch.common import Fields, TorchContext, TorchMethod, softmax_combine
from kvq_torch.intcodes import IntCodesTorch
from kvq_torch.rotation import by_kv_head, norm
from kvq_torch.sketch import encode_signs, qjl_reconstruct, qjl_scores, sketch


class QJLTorch(TorchMethod):
    """Keys: signs of S k and ||k||, scored by the QJL estimator; values: KIVI's per-token INT codec."""

    spec: QJLSpec

    def __init__(self, spec: QJLSpec) -> None:
        super().__init__(spec)
        self.values = IntCodesTorch(spec.value_codec)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        k = k.to(torch.float32)
        return {"qjl": encode_signs(k, ctx.consts["sketch"]), "norm": norm(k)}

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        """The unbiased-in-expectation reconstruction sqrt(pi/2)/m ||k|| S^T h: <q, k_hat> is the score."""
        return qjl_reconstruct(fields["qjl"], fields["norm"], ctx.consts["sketch"])

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return self.values.encode_values(v, ctx)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self.values.decode_values(fields, ctx)

    def attend(
        self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sketch the query once, score every key by the estimator, softmax over decoded values."""
        q_sketch = sketch(by_kv_head(q, kfields["norm"].shape[1]), ctx.consts["sketch"])
        logits = qjl_scores(q_sketch, kfields["qjl"], kfields["norm"])
        return softmax_combine(logits * scale, self.decode_values(vfields, ctx), tuple(q.shape))
