"""Synthetic K/V data regimes shared by tests, the demo and the fidelity benchmark.

All regimes are seeded and return float32 ``[batch, kv_heads, tokens, head_dim]`` arrays:

- ``gaussian``: i.i.d. N(0, 1) keys and values;
- ``outliers``: keys with a few large, biased outlier channels per head (x10 scale, as in the
  massive channels of real LLM keys); values Gaussian;
- ``sinks``: token-norm imbalance, OScaR's target (specs/oscar.md 6.5): sink tokens (0 and 4)
  scaled x0.15 and every 16th token from 8 on scaled x3, across all heads;
- ``llm``: outliers and sinks together, the demo's default.
"""
from __future__ import annotations

import numpy as np

from kvq_core.errors import InputError

REGIMES = ("gaussian", "outliers", "sinks", "llm")
SINK_TOKENS = (0, 4)
SINK_SCALE = 0.15
LOUD_SCALE = 3.0
OUTLIER_CHANNELS = 4
OUTLIER_SCALE = 10.0


def token_scales(tokens: int) -> np.ndarray:
    """The per-token multiplier of the ``sinks`` regime (1 for ordinary tokens)."""
    s = np.ones(tokens, np.float32)
    s[8::16] = LOUD_SCALE
    for t in SINK_TOKENS:
        if t < tokens:
            s[t] = SINK_SCALE
    return s


def make_kv(
    regime: str = "gaussian", batch: int = 1, kv_heads: int = 8, tokens: int = 256, head_dim: int = 128, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values of one regime (see the module docstring)."""
    if regime not in REGIMES:
        raise InputError(f"regime={regime!r}; expected one of {', '.join(REGIMES)}")
    rng = np.random.default_rng(seed)
    shape = (batch, kv_heads, tokens, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    if regime in ("outliers", "llm"):
        for h in range(kv_heads):
            ch = rng.choice(head_dim, OUTLIER_CHANNELS, replace=False)
            bias = rng.uniform(-1.0, 1.0, OUTLIER_CHANNELS).astype(np.float32)
            head = k[:, h]  # a view [batch, tokens, head_dim]
            head[..., ch] = OUTLIER_SCALE * (0.5 * head[..., ch] + bias)
    if regime in ("sinks", "llm"):
        k *= token_scales(tokens)[None, None, :, None]
    return k, v


def make_queries(batch: int = 1, q_heads: int = 8, q_len: int = 1, head_dim: int = 128, seed: int = 1) -> np.ndarray:
    """Gaussian queries ``[batch, q_heads, q_len, head_dim]``."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, q_heads, q_len, head_dim), dtype=np.float32)
