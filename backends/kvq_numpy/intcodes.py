"""NumPy reference kernels of the integer-code methods (OScaR, KIVI, QuaRot), from the spec's recipe.

One class serves every :class:`~kvq_core.methods.intcodes.IntCodeRecipe` (specs/oscar.md 1.2-1.4
and 1.6, specs/baselines.md: KIVI, QuaRot-KV):

- keys: ``u = H k / n_t`` (H when the recipe rotates; ``n_t`` the L2 norm of token t over all KV
  heads and channels when it has the token norm), then asymmetric min/max codes
  (:mod:`kvq_numpy.intquant`) over the recipe's key groups;
- values: ``H v``, then codes over the recipe's value groups;
- attention scores in the rotated (and normalised) domain, multiplies each logit by ``n_t``,
  and un-rotates the output once: ``(Hq)·(Hk) = q·k`` and ``P (H v) H = P v``.
"""
from __future__ import annotations

import numpy as np

from kvq_core.contract import KernelContext
from kvq_core.methods.intcodes import CHANNELS, TOKENS, IntGroups
from kvq_numpy import intquant
from kvq_numpy.attention import softmax_attend
from kvq_numpy.rotation import hadamard

#: the axis of ``[batch, kv_heads, tokens, head_dim]`` a group runs along
AXES = {TOKENS: 2, CHANNELS: 3}


def token_norms(kr: np.ndarray) -> np.ndarray:
    """OTS norm ``[batch, tokens]`` (float32) over every KV head and channel; 1 where not > 0."""
    n = np.sqrt(np.square(kr).sum(axis=(1, 3), dtype=np.float32))
    return np.where(n > 0, n, np.float32(1))


class IntCodesKernels:
    """An integer-code method on NumPy (any spec with a ``recipe``), float32 throughout
    (attention scores in float64 via softmax_attend)."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.recipe = spec.recipe

    # -- ingredients ------------------------------------------------------------------------
    def _rotate(self, x: np.ndarray) -> np.ndarray:
        """float32 ``x @ H`` per head when the recipe rotates; H is its own inverse, so this also un-rotates."""
        x = np.asarray(x, dtype=np.float32)
        return hadamard(x) if self.recipe.rotates else x

    def _encode(self, x: np.ndarray, groups: IntGroups) -> dict[str, np.ndarray]:
        return intquant.encode_fields(x, groups.bits, groups.size, AXES[groups.axis], groups.zero_point,
                                      self.recipe.clip_ratio)

    def _decode(self, fields: dict[str, np.ndarray], groups: IntGroups) -> np.ndarray:
        """Dequantized entries in the domain they were coded in (rotated, and normalised for keys with OTS)."""
        return intquant.decode_fields(fields, groups.bits, self.spec.head_dim, groups.size, AXES[groups.axis])

    # -- kernels ----------------------------------------------------------------------------
    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        kr = self._rotate(k)
        norm = token_norms(kr) if self.recipe.token_norm else None
        u = kr if norm is None else kr / norm[:, None, :, None]
        fields = self._encode(u, self.recipe.keys)
        if norm is not None:
            fields["norm"] = norm
        return fields

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        k = self._decode(fields, self.recipe.keys)
        if self.recipe.token_norm:
            k = k * fields["norm"][:, None, :, None]
        return self._rotate(k)

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        return self._encode(self._rotate(v), self.recipe.values)

    def decode_values(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return self._rotate(self._decode(fields, self.recipe.values))

    def attend(
        self, q: np.ndarray, kfields: dict[str, np.ndarray], vfields: dict[str, np.ndarray], ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rotate q once, score against the coded keys times ``n_t``, and un-rotate the output once."""
        norm = kfields["norm"][:, None, :] if self.recipe.token_norm else None
        keys = self._decode(kfields, self.recipe.keys)
        values = self._decode(vfields, self.recipe.values)
        out, lse = softmax_attend(self._rotate(q), keys, values, scale, token_scale=norm)
        return self._rotate(out), lse
