"""Softmax attention with GQA over decoded K/V, shared by every NumPy reference method."""
from __future__ import annotations

import numpy as np


def softmax_attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, token_scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of ``q [b, hq, lq, d]`` over ``k, v [b, hk, t, d]`` (hq = g * hk), in float64.

    ``token_scale [b, hk, t]`` (or broadcastable) multiplies each token's logit before the
    softmax scale, as OScaR's per-token norm and OCTOPUS's per-vector norm require.
    Returns ``out [b, hq, lq, d]`` (float32) and ``lse [b, hq, lq]`` (float32).
    """
    b, hq, lq, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    g = hq // hk
    qg = q.astype(np.float64).reshape(b, hk, g * lq, d)
    logits = np.einsum("bhqd,bhtd->bhqt", qg, k.astype(np.float64))
    if token_scale is not None:
        logits = logits * np.broadcast_to(np.asarray(token_scale, np.float64), (b, hk, t))[:, :, None, :]
    logits *= scale
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - m)
    denom = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqt,bhtd->bhqd", p / denom, v.astype(np.float64))
    lse = (m + np.log(denom))[..., 0]
    return out.reshape(b, hq, lq, d).astype(np.float32), lse.reshape(b, hq, lq).astype(np.float32)
