"""``quarot``: QuaRot's KV cache (Ashkboos et al., arXiv 2404.00456), Hadamard + per-token INT-b.

Keys (after RoPE) and values are multiplied per head by the orthonormal Sylvester Hadamard
matrix (natural order, no random signs, as QuaRot and OScaR), then each (token, head) vector
is quantized asymmetrically with one (scale, offset) pair (group = head_dim). QuaRot folds the
value rotation into W_v / W_o; a cache on its own cannot, so values are rotated inline and the
attention output is rotated back once (V ~ H QDQ(H V), as OScaR's fake-quant path does).

``clip_ratio`` rho scales each token's range before quantization (QuaRot's clipping): values
outside ``[rho * min(x_min, 0), rho * max(x_max, 0)]`` saturate.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.math.hadamard import dense_hadamard_block, sylvester_hadamard
from kvq_core.methods.intcodes import CHANNELS, HADAMARD, NO_ROTATION, ZERO_INTEGER, IntCodeRecipe, IntGroups
from kvq_core.spec import MethodSpec


@dataclasses.dataclass(frozen=True)
class QuaRotSpec(MethodSpec):
    """QuaRot-KV at ``bits`` bits per code; bits per element: bits + 32/head_dim (4.25 at INT4, d=128)."""

    method = "quarot"
    summary = "QuaRot-KV: per-head Hadamard rotation, per-token asymmetric INT-b (group = head_dim)"
    default_residual = 0

    bits: int = 4
    rotation: bool = True
    clip_ratio: float = 1.0

    def validate(self) -> None:
        super().validate()
        self._check_int("bits", 1, 8)
        self._check_bool("rotation")
        rho = self.clip_ratio
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not (math.isfinite(rho) and 0 < rho <= 1):
            self._fail("clip_ratio", "a number in (0, 1]")

    @property
    def recipe(self) -> IntCodeRecipe:
        """The Hadamard (``rotation``), then keys and values alike per token over all head_dim
        channels with an integer zero-point, the range clipped by ``clip_ratio``."""
        per_token = IntGroups(self.bits, CHANNELS, self.head_dim, ZERO_INTEGER)
        return IntCodeRecipe(HADAMARD if self.rotation else NO_ROTATION, False, per_token, per_token, self.clip_ratio)

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """Codes packed along head_dim; one (scale, offset) per (token, head)."""
        lead = (batch, kv_heads, tokens)
        return make_layout(
            codes_field("codes", lead, self.head_dim, self.bits),
            float_field("scale", (*lead, 1), "float16"),
            float_field("offset", (*lead, 1), "float16"),
        )

    value_layout = key_layout

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """``hadamard``: the dense factor ``H_m`` of the rotation (``m = dense_hadamard_block(head_dim)``,
        at most 128), for backends that rotate by a matmul plus butterfly stages; never d x d."""
        if not self.rotation:
            return {}
        return {"hadamard": sylvester_hadamard(dense_hadamard_block(self.head_dim)).astype(np.float32)}
