"""``fp8``: K and V stored as FP8 codes times a float32 scale, as vLLM's ``fp8`` kv-cache dtypes.

vLLM stores ``fp8(x / scale)`` and reads ``fp8 * scale`` (its "convention of the scale"), with
a scale per tensor or per attention head, either calibrated offline or computed on the fly as
``amax(|x|) / divisor``; the CUDA conversion saturates to the largest finite value. This method
computes the scale from each block, so it needs no calibration:

- ``scale="token"`` (default): one scale per (batch, kv head, token), ``amax over head_dim /
  fp8 max``. Per token, so the cache packs token by token (sliding flush); 8 + 32/head_dim bits
  per element (8.25 at head_dim 128).
- ``scale="head"``: one scale per (batch, kv head) over the block's tokens, vLLM's per-head
  granularity; the block flush packs whole windows. 8 bits per element plus one float32 per head.

With the divisor equal to the format's largest finite value (448 for e4m3, 57344 for e5m2),
the largest magnitude of a row or head lands on the top of the format's range. An all-zero
row or head stores scale 0 and zero codes. ``x / scale`` is computed in float32 and rounded to
the format exactly (:mod:`kvq_fp8.formats`: nearest, ties to even, saturating).
"""
from __future__ import annotations

import dataclasses

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.spec import MethodSpec


@dataclasses.dataclass(frozen=True)
class Fp8Spec(MethodSpec):
    """FP8 codes (``format`` "e4m3" or "e5m2") with a float32 scale per token or per head."""

    method = "fp8"
    summary = "FP8 KV cache as vLLM's fp8 dtypes: e4m3/e5m2 codes times a float32 scale per token or per head"
    default_residual = 0  # vLLM keeps no full-precision window
    default_flush = "sliding"  # per-token scales; a per-head layout falls back to the block flush

    format: str = "e4m3"
    scale: str = "token"

    def validate(self) -> None:
        super().validate()
        self._check_choice("format", ("e4m3", "e5m2"))
        self._check_choice("scale", ("token", "head"))

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        scale_shape = (batch, kv_heads, tokens) if self.scale == "token" else (batch, kv_heads)
        return make_layout(codes_field("codes", (batch, kv_heads, tokens), self.head_dim, 8),
                           float_field("scale", scale_shape, "float32"))

    value_layout = key_layout
