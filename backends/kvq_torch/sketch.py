"""Torch 1-bit sign sketch (mirrors ``kvq_numpy/sketch.py``): QJL's key code and TurboQuant_prod's
residual code.
"""
from __future__ import annotations

import math

import torch

from kvq_torch.common import pack_codes, unpack_codes


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
