"""Torch kernels of QJL (mirrors ``kvq_numpy/qjl.py``; the codec is described in :mod:`kvq_core.methods.qjl`).

The sign-sketch helpers here are shared with TurboQuant_prod, whose residual is a QJL code.
Arrays are [batch, kv_heads, rows, ...]; each kv head has its own sketch S (kv_heads, m, d).
Values are KIVI's per-token codec, reusing :class:`kvq_torch.kivi.KiviTorch`. The key norm is
bit-identical to the reference; S k is a float32 matmul in the BLAS's order, so a sign bit can
differ from it only where a sketch entry is within rounding of 0.
"""
from __future__ import annotations

import math

import torch

from kvq_core.methods.qjl import QJLSpec
from kvq_torch.common import Fields, TorchContext, TorchMethod, pack_codes, softmax_combine, unpack_codes
from kvq_torch.kivi import KiviTorch
from kvq_torch.rotation import by_kv_head, norm


def sketch(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """S x for x [b, h, n, d] and per-head S [h, m, d]: [b, h, n, m] (float32)."""
    return torch.matmul(x.to(torch.float32), s.transpose(-1, -2))


def encode_signs(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The packed 1-bit codes of sign(S x), bit 1 meaning +1 (sign(0) = +1)."""
    return pack_codes(sketch(x, s) >= 0, 1)


def decode_signs(packed: torch.Tensor, m: int) -> torch.Tensor:
    """The +-1 signs (float32, [..., m]) of packed 1-bit codes."""
    return 2 * unpack_codes(packed, 1, m, torch.float32) - 1


def estimator_scale(m: int) -> float:
    """sqrt(pi/2) / m: E[sqrt(pi/2) <g, q> sign<g, k>] = <q, k/||k||> for g ~ N(0, I)."""
    return math.sqrt(math.pi / 2) / m


def qjl_scores(q_sketch: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """sqrt(pi/2)/m * norm_t * <S q, h_t>, the unbiased estimate of <q, k_t>: [b, h, n, t] float32."""
    m = q_sketch.shape[-1]
    dots = torch.matmul(q_sketch, decode_signs(packed, m).transpose(-1, -2))
    return estimator_scale(m) * dots * norms.unsqueeze(2)


def qjl_reconstruct(packed: torch.Tensor, norms: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """sqrt(pi/2)/m * norm * S^T h, the vector whose inner products are the estimator: [b, h, t, d]."""
    m = s.shape[1]
    back = torch.matmul(decode_signs(packed, m), s)
    return estimator_scale(m) * norms.unsqueeze(-1) * back


class QJLTorch(TorchMethod):
    """Keys: signs of S k and ||k||, scored by the QJL estimator; values: KIVI's per-token INT codec."""

    spec: QJLSpec

    def __init__(self, spec: QJLSpec) -> None:
        super().__init__(spec)
        self.values = KiviTorch(spec.value_codec)

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
