"""Softmax attention with GQA, shared by every NumPy reference method.

GQA: query head i reads kv head i // g (g = q_heads / kv_heads). Kernels group the queries as
``[b, kv_heads, g * q_len, d]`` (:func:`by_kv_head`) so that each row meets its kv head's keys,
values and rotation, and ungroup the results with :func:`from_kv_head`.
"""
from __future__ import annotations

import numpy as np


def by_kv_head(q: np.ndarray, kv_heads: int) -> np.ndarray:
    """Queries ``[b, q_heads, q_len, ...]`` as ``[b, kv_heads, g * q_len, ...]`` (a reshape)."""
    return q.reshape(q.shape[0], kv_heads, -1, *q.shape[3:])


def from_kv_head(x: np.ndarray, q_shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`by_kv_head`: ``[b, kv_heads, g * q_len, ...]`` as ``[b, q_heads, q_len, ...]``."""
    return x.reshape(*q_shape[:3], *x.shape[3:])


def softmax_over_logits(logits: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over tokens of ``scale * logits`` ``[b, kv_heads, n, t]`` (float64), applied to ``v [b, kv_heads, t, dv]``.

    Returns ``out [b, kv_heads, n, dv]`` and the log-sum-exp ``lse [b, kv_heads, n]``, float32.
    """
    z = logits * scale
    m = z.max(axis=-1, keepdims=True)
    p = np.exp(z - m)
    denom = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqt,bhtd->bhqd", p / denom, v.astype(np.float64))
    lse = (m + np.log(denom))[..., 0]
    return out.astype(np.float32), lse.astype(np.float32)


def softmax_attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, token_scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of ``q [b, hq, lq, d]`` over ``k, v [b, hk, t, d]`` (hq = g * hk), in float64.

    ``token_scale [b, hk, t]`` (or broadcastable) multiplies each token's logit before the
    softmax scale, as OScaR's per-token norm and OCTOPUS's per-vector norm require.
    Returns ``out [b, hq, lq, d]`` (float32) and ``lse [b, hq, lq]`` (float32).
    """
    b, hk, t = k.shape[:3]
    logits = np.einsum("bhqd,bhtd->bhqt", by_kv_head(q.astype(np.float64), hk), k.astype(np.float64))
    if token_scale is not None:
        logits = logits * np.broadcast_to(np.asarray(token_scale, np.float64), (b, hk, t))[:, :, None, :]
    out, lse = softmax_over_logits(logits, v, scale)
    return from_kv_head(out, q.shape), from_kv_head(lse, q.shape)
