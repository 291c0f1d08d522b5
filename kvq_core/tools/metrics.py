"""Fidelity metrics shared by the demo and the fidelity benchmark (NumPy, float64)."""
from __future__ import annotations

import dataclasses

import numpy as np

from kvq_core.api import Quantizer


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Full-precision softmax attention with GQA: ``q [b,hq,l,d]`` over ``k, v [b,hk,t,d]``."""
    b, hq, lq, d = q.shape
    hk = k.shape[1]
    logits = np.einsum("bhgld,bhtd->bhglt", q.reshape(b, hk, hq // hk, lq, d).astype(np.float64), k.astype(np.float64)) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhglt,bhtd->bhgld", p, v.astype(np.float64)).reshape(b, hq, lq, d)


def logits(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``q·k`` per (batch, query head, query, token) with GQA: shape ``[b, hq, l, t]``."""
    b, hq, lq, d = q.shape
    hk = k.shape[1]
    out = np.einsum("bhgld,bhtd->bhglt", q.reshape(b, hk, hq // hk, lq, d).astype(np.float64), k.astype(np.float64))
    return out.reshape(b, hq, lq, -1)


def topk_overlap(exact: np.ndarray, approx: np.ndarray, k: int = 8) -> float:
    """Mean fraction of the exact top-k tokens (last axis) that the approximation also ranks top-k."""
    k = min(k, exact.shape[-1])
    te = np.argpartition(-exact, k - 1, axis=-1)[..., :k]
    ta = np.argpartition(-approx, k - 1, axis=-1)[..., :k]
    hits = (te[..., :, None] == ta[..., None, :]).any(-1).sum(-1)
    return float(hits.mean() / k)


def token_rel_err(k: np.ndarray, kh: np.ndarray) -> np.ndarray:
    """``||k_t - k̂_t|| / ||k_t||`` across all heads per (batch, token) (specs/oscar.md 6.5)."""
    err = np.sqrt(((k.astype(np.float64) - kh) ** 2).sum(axis=(1, 3)))
    ref = np.sqrt((k.astype(np.float64) ** 2).sum(axis=(1, 3)))
    return err / np.maximum(ref, 1e-30)


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """How well one quantizer preserves keys, values, scores and attention on one data set."""

    key_bits: float
    value_bits: float
    kv_bits: float
    key_rel_mse: float
    key_token_rel_err: float
    key_token_rel_err_max: float
    value_rel_mse: float
    ip_abs_err: float
    attn_rel_err: float
    top8_overlap: float


def measure(quantizer: Quantizer, k: np.ndarray, v: np.ndarray, q: np.ndarray) -> Fidelity:
    """Encode K/V with ``quantizer`` and compare against full precision.

    Relative MSEs are ``||x - x̂||² / ||x||²``; the per-token key errors are
    the mean and worst of :func:`token_rel_err` (a sink token weighs like any other); the inner-product error is the mean absolute
    difference of ``q·k`` (scores from the decoded keys); the attention error is the relative
    L2 error of ``attend`` (scored from the codes) against exact attention.
    """
    pk, pv = quantizer.encode_keys(k), quantizer.encode_values(v)
    kh = np.asarray(quantizer.arrays.to_numpy(quantizer.decode_keys(pk)), np.float64)
    vh = np.asarray(quantizer.arrays.to_numpy(quantizer.decode_values(pv)), np.float64)
    scale = 1.0 / np.sqrt(k.shape[-1])
    exact = attention(q, k, v, scale)
    approx = np.asarray(quantizer.arrays.to_numpy(quantizer.attend(q, pk, pv)), np.float64)
    l_exact, l_approx = logits(q, k), logits(q, kh)
    token_errs = token_rel_err(k, kh)
    return Fidelity(
        key_bits=pk.bits_per_element(),
        value_bits=pv.bits_per_element(),
        kv_bits=quantizer.bits_per_element([pk, pv]),
        key_rel_mse=float(((k - kh) ** 2).sum() / (k.astype(np.float64) ** 2).sum()),
        key_token_rel_err=float(token_errs.mean()),
        key_token_rel_err_max=float(token_errs.max()),
        value_rel_mse=float(((v - vh) ** 2).sum() / (v.astype(np.float64) ** 2).sum()),
        ip_abs_err=float(np.abs(l_exact - l_approx).mean()),
        attn_rel_err=float(np.linalg.norm(approx - exact) / np.linalg.norm(exact)),
        top8_overlap=topk_overlap(l_exact, l_approx, 8),
    )
