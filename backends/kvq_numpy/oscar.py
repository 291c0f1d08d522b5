"""NumPy reference kernels of OScaR (specs/oscar.md sections 1.2-1.4 and 1.6).

Keys: ``u = H k / n_t`` with ``n_t`` the L2 norm of token t over all KV heads and channels,
then asymmetric min/max codes per (head, channel) over groups of ``key_group`` tokens.
Values: ``H v``, then codes per (token, head) over groups of ``value_group`` channels.
Attention scores from the rotated, normalised domain and multiplies each logit by ``n_t``.
"""
from __future__ import annotations

import numpy as np

from kvq_core.kernels import KernelContext
from kvq_core.methods.oscar import OscarSpec
from kvq_numpy import intquant
from kvq_numpy.attention import softmax_attend
from kvq_numpy.rotation import hadamard

TOKEN_AXIS, CHANNEL_AXIS = 2, 3  # of [batch, kv_heads, tokens, head_dim]


def token_norms(kr: np.ndarray) -> np.ndarray:
    """OTS norm ``[batch, tokens]`` (float32) over every KV head and channel; 1 where not > 0."""
    n = np.sqrt(np.square(kr).sum(axis=(1, 3), dtype=np.float32))
    return np.where(n > 0, n, np.float32(1))


class OscarKernels:
    """OScaR on NumPy, float32 throughout (attention scores in float64 via softmax_attend)."""

    def __init__(self, spec: OscarSpec) -> None:
        self.spec = spec

    # -- rotation ---------------------------------------------------------------------------
    def _rotate(self, x: np.ndarray) -> np.ndarray:
        """``x @ H`` per head when the spec rotates; H is its own inverse, so this also un-rotates."""
        x = np.asarray(x, dtype=np.float32)
        return hadamard(x) if self.spec.rotation else x

    # -- codes <-> rotated domain -----------------------------------------------------------
    def _unit_keys(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """Dequantized keys in the rotated (and, with OTS, normalised) domain attention scores against."""
        return intquant.decode_fields(fields, self.spec.bits, self.spec.head_dim, self.spec.key_group, TOKEN_AXIS)

    def _rotated_values(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """Dequantized values in the rotated domain."""
        return intquant.decode_fields(fields, self.spec.bits, self.spec.head_dim, self.spec.value_group, CHANNEL_AXIS)

    # -- kernels ----------------------------------------------------------------------------
    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        kr = self._rotate(k)
        norm = token_norms(kr) if self.spec.token_scaling else None
        u = kr if norm is None else kr / norm[:, None, :, None]
        fields = intquant.encode_fields(u, self.spec.bits, self.spec.key_group, TOKEN_AXIS)
        if norm is not None:
            fields["norm"] = norm
        return fields

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        k = self._unit_keys(fields)
        if self.spec.token_scaling:
            k = k * fields["norm"][:, None, :, None]
        return self._rotate(k)

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        return intquant.encode_fields(self._rotate(v), self.spec.bits, self.spec.value_group, CHANNEL_AXIS)

    def decode_values(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return self._rotate(self._rotated_values(fields))

    def attend(
        self, q: np.ndarray, kfields: dict[str, np.ndarray], vfields: dict[str, np.ndarray], ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rotate q once, score against unit keys times ``n_t``, and un-rotate the output once.

        ``(Hq)·(Hk) = q·k`` and ``P (H v) H = P v``, so this equals attention over decoded K/V.
        """
        norm = kfields["norm"][:, None, :] if self.spec.token_scaling else None
        keys = self._unit_keys(kfields)
        out, lse = softmax_attend(self._rotate(q), keys, self._rotated_values(vfields), scale, token_scale=norm)
        return self._rotate(out), lse
