"""NumPy reference kernels of OScaR (specs/oscar.md sections 1.2-1.4 and 1.6).

Keys: ``u = H k / n_t`` with ``n_t`` the L2 norm of token t over all KV heads and channels,
then asymmetric min/max codes per (head, channel) over groups of ``key_group`` tokens.
Values: ``H v``, then codes per (token, head) over groups of ``value_group`` channels.
Attention scores from the rotated, normalised domain and multiplies each logit by ``n_t``.
"""
from __future__ import annotations

import numpy as np

from kvq_core.kernels import KernelContext
from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.math.hadamard import fwht
from kvq_core.methods.oscar import OscarSpec
from kvq_numpy.attention import softmax_attend

TOKEN_AXIS = 2  # of [batch, kv_heads, tokens, head_dim]


def quantize(x: np.ndarray, bits: int, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max quantization with one (scale, offset) per slice along ``axis`` (spec 1.4).

    Returns ``codes`` (uint8, shaped like ``x``) and float16 ``scale`` and ``offset`` with
    ``axis`` removed. An all-zero group uses the range [-1, 1]; any other constant group gets
    scale 0 and offset = its value, so it reconstructs exactly when float16 can hold it.
    """
    levels = np.float32(2**bits - 1)
    mn = x.min(axis=axis, keepdims=True)
    mx = x.max(axis=axis, keepdims=True)
    all_zero = (mn == 0) & (mx == 0)
    mn = np.where(all_zero, np.float32(-1), mn)
    mx = np.where(all_zero, np.float32(1), mx)
    spread = mx > mn
    step = np.where(spread, (mx - mn) / levels, np.float32(1))  # 1 only avoids 0/0 below
    zq = np.rint(-mn / step)
    codes = np.where(spread, np.clip(np.rint(x / step + zq), 0, levels), 0)
    scale = np.where(spread, step, np.float32(0))
    offset = np.where(spread, -zq * step, mn)
    scale, offset = (np.squeeze(a, axis=axis).astype(np.float16) for a in (scale, offset))
    return codes.astype(np.uint8), scale, offset


def dequantize(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, axis: int) -> np.ndarray:
    """Inverse of :func:`quantize`: ``codes * scale + offset`` in float32, stats broadcast along ``axis``."""
    s = np.expand_dims(scale.astype(np.float32), axis)
    o = np.expand_dims(offset.astype(np.float32), axis)
    return codes.astype(np.float32) * s + o


def token_norms(kr: np.ndarray) -> np.ndarray:
    """OTS norm ``[batch, tokens]`` (float32) over every KV head and channel; 1 where not > 0."""
    n = np.sqrt(np.square(kr).sum(axis=(1, 3), dtype=np.float32))
    return np.where(n > 0, n, np.float32(1))


def group_tokens(x: np.ndarray, group: int) -> np.ndarray:
    """``[b, h, t, d]`` -> ``[b, h, ceil(t/group), group, d]``, padding by repeating the last token.

    Repeating a real token leaves a partial group's min and max those of its real tokens.
    """
    pad = -x.shape[TOKEN_AXIS] % group
    x = np.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)), mode="edge")
    b, h, t, d = x.shape
    return x.reshape(b, h, t // group, group, d)


def ungroup_tokens(x: np.ndarray, tokens: int) -> np.ndarray:
    """Inverse of :func:`group_tokens`: drop the padding tokens."""
    b, h, g, size, d = x.shape
    return x.reshape(b, h, g * size, d)[:, :, :tokens]


def group_channels(x: np.ndarray, group: int) -> np.ndarray:
    """``[b, h, t, d]`` -> ``[b, h, t, d/group, group]`` (group divides d)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


class OscarKernels:
    """OScaR on NumPy, float32 throughout (attention scores in float64 via softmax_attend)."""

    def __init__(self, spec: OscarSpec) -> None:
        self.spec = spec

    # -- rotation ---------------------------------------------------------------------------
    def _rotate(self, x: np.ndarray) -> np.ndarray:
        """``x @ H`` per head when the spec rotates; H is its own inverse, so this also un-rotates."""
        x = np.asarray(x, dtype=np.float32)
        return fwht(x) if self.spec.rotation else x

    # -- codes <-> rotated domain -----------------------------------------------------------
    def _pack(self, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> dict[str, np.ndarray]:
        return {"codes": pack_codes(codes, self.spec.bits), "scale": scale, "offset": offset}

    def _unpack(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        return unpack_codes(fields["codes"], self.spec.bits, self.spec.head_dim)

    def _unit_keys(self, fields: dict[str, np.ndarray], tokens: int) -> np.ndarray:
        """Dequantized keys in the rotated, normalised domain (what attention scores against)."""
        codes = group_tokens(self._unpack(fields), self.spec.key_group)
        return ungroup_tokens(dequantize(codes, fields["scale"], fields["offset"], axis=3), tokens)

    def _rotated_values(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """Dequantized values in the rotated domain."""
        codes = group_channels(self._unpack(fields), self.spec.value_group)
        v = dequantize(codes, fields["scale"], fields["offset"], axis=4)
        return v.reshape(*v.shape[:-2], self.spec.head_dim)

    # -- kernels ----------------------------------------------------------------------------
    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        kr = self._rotate(k)
        norm = token_norms(kr) if self.spec.token_scaling else None
        u = kr if norm is None else kr / norm[:, None, :, None]
        codes, scale, offset = quantize(group_tokens(u, self.spec.key_group), self.spec.bits, axis=3)
        fields = self._pack(ungroup_tokens(codes, ctx.shape[TOKEN_AXIS]), scale, offset)
        if norm is not None:
            fields["norm"] = norm
        return fields

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        k = self._unit_keys(fields, ctx.shape[TOKEN_AXIS])
        if self.spec.token_scaling:
            k = k * fields["norm"][:, None, :, None]
        return self._rotate(k)

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        codes, scale, offset = quantize(group_channels(self._rotate(v), self.spec.value_group), self.spec.bits, axis=4)
        return self._pack(codes.reshape(ctx.shape), scale, offset)

    def decode_values(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return self._rotate(self._rotated_values(fields))

    def attend(
        self, q: np.ndarray, kfields: dict[str, np.ndarray], vfields: dict[str, np.ndarray], ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rotate q once, score against unit keys times ``n_t``, and un-rotate the output once.

        ``(Hq)·(Hk) = q·k`` and ``P (H v) H = P v``, so this equals attention over decoded K/V.
        """
        norm = kfields["norm"][:, None, :] if self.spec.token_scaling else None
        keys = self._unit_keys(kfields, ctx.shape[TOKEN_AXIS])
        out, lse = softmax_attend(self._rotate(q), keys, self._rotated_values(vfields), scale, token_scale=norm)
        return self._rotate(out), lse
