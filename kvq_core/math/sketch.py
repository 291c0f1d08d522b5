"""Random sketches and rotations drawn per (seed, layer, KV head): the Gaussian or orthogonal
JL sketch of QJL and of TurboQuant's residual stage, and Haar rotations. Shared by those methods'
specs, so that neither needs the other's module.
"""
from __future__ import annotations

import math

import numpy as np

SEED_MAX = 2**64 - 1
SKETCHES = ("gaussian", "orthogonal")
ROTATION_STREAM, SKETCH_STREAM = 0, 1


def head_rng(seed: int, layer: int, head: int, stream: int) -> np.random.Generator:
    """The Generator of one (seed, layer, kv head, stream): rotations and sketches never share draws."""
    return np.random.default_rng([seed, layer, head, stream])


def haar_orthogonal(rng: np.random.Generator, d: int) -> np.ndarray:
    """A Haar-distributed d x d orthogonal matrix: QR of a Gaussian, columns signed by sign(diag R)."""
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def gaussian_row_norm(d: int) -> float:
    """E||g|| for g ~ N(0, I_d): the row length that makes orthogonal sketches exactly unbiased."""
    return math.sqrt(2.0) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2))


def sketch_matrix(rng: np.random.Generator, m: int, d: int, kind: str) -> np.ndarray:
    """One m x d sketch (float64): i.i.d. N(0, 1), or stacked Haar blocks with rows of length E||g||."""
    if kind == "gaussian":
        return rng.standard_normal((m, d))
    blocks = [haar_orthogonal(rng, d) for _ in range(-(-m // d))]
    return gaussian_row_norm(d) * np.concatenate(blocks)[:m]


def sketches(seed: int, layer: int, kv_heads: int, m: int, d: int, kind: str) -> np.ndarray:
    """float32 (kv_heads, m, d): the sketch of every kv head of one layer."""
    mats = [sketch_matrix(head_rng(seed, layer, h, SKETCH_STREAM), m, d, kind) for h in range(kv_heads)]
    return np.stack(mats).astype(np.float32)
