"""``oscar``: OScaR (arXiv 2605.19660), Canalized Rotation + Omni-Token Scaling (specs/oscar.md).

Keys are rotated per head by the Sylvester Hadamard matrix, divided by one norm per token shared
by all KV heads, then quantized asymmetrically per (head, channel) over groups of consecutive
tokens. Values are rotated and quantized per (token, head) over groups of channels.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.math.hadamard import dense_hadamard_block, sylvester_hadamard
from kvq_core.methods.intcodes import CHANNELS, HADAMARD, NO_ROTATION, TOKENS, ZERO_INTEGER, IntCodeRecipe, IntGroups
from kvq_core.spec import MethodSpec, channel_group

MIN_BITS, MAX_BITS = 2, 8
MAX_KEY_GROUP = 1 << 20


def default_group(bits: int) -> int:
    """The paper's group size: 32 at 2-3 bits (INT2 protocol), 128 above (INT4 protocol)."""
    return 32 if bits <= 3 else 128


@dataclasses.dataclass(frozen=True)
class OscarSpec(MethodSpec):
    """OScaR at ``bits`` bits per code.

    ``key_group`` tokens share one (scale, offset) per key channel; ``value_group`` channels
    share one per value token. Both default from ``bits`` (:func:`default_group`) and are stored
    resolved, so the JSON form is explicit. ``token_scaling`` (OTS) and ``rotation`` (CR, keys
    and values) switch the method's two ingredients off for ablations.
    """

    method = "oscar"
    summary = "OScaR: per-head Hadamard rotation + omni-token key norm, asymmetric INT-b groups (K over tokens, V over channels)"
    default_residual = 128

    bits: int = 2
    key_group: int | None = None
    value_group: int | None = None
    token_scaling: bool = True
    rotation: bool = True

    def validate(self) -> None:
        super().validate()
        self._check_int("bits", MIN_BITS, MAX_BITS)
        if self.key_group is None:
            self._set("key_group", default_group(self.bits))
        if self.value_group is None:
            self._set("value_group", channel_group(default_group(self.bits), self.head_dim))
        self._check_int("key_group", 1, MAX_KEY_GROUP)
        self._check_int("value_group", 1, self.head_dim)
        if self.head_dim % self.value_group:
            self._fail("value_group", f"a divisor of head_dim={self.head_dim}")
        self._check_bool("token_scaling")
        self._check_bool("rotation")

    @property
    def recipe(self) -> IntCodeRecipe:
        """CR (``rotation``), OTS (``token_scaling``), keys per channel over ``key_group`` tokens and
        values per token over ``value_group`` channels, integer zero-points."""
        return IntCodeRecipe(HADAMARD if self.rotation else NO_ROTATION, self.token_scaling,
                             IntGroups(self.bits, TOKENS, self.key_group, ZERO_INTEGER),
                             IntGroups(self.bits, CHANNELS, self.value_group, ZERO_INTEGER))

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """Codes packed along head_dim; per-channel stats per token group; the fp32 token norm."""
        stats = (batch, kv_heads, math.ceil(tokens / self.key_group), self.head_dim)
        fields = [
            codes_field("codes", (batch, kv_heads, tokens), self.head_dim, self.bits),
            float_field("scale", stats, "float16"),
            float_field("offset", stats, "float16"),
        ]
        if self.token_scaling:
            fields.append(float_field("norm", (batch, tokens), "float32"))
        return make_layout(*fields)

    def value_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """Codes packed along head_dim; stats per (token, channel group)."""
        stats = (batch, kv_heads, tokens, self.head_dim // self.value_group)
        return make_layout(
            codes_field("codes", (batch, kv_heads, tokens), self.head_dim, self.bits),
            float_field("scale", stats, "float16"),
            float_field("offset", stats, "float16"),
        )

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """``hadamard``: the dense factor ``H_m`` of the rotation (``m = dense_hadamard_block(head_dim)``,
        at most 128), for backends that rotate by a matmul plus butterfly stages; never d x d."""
        if not self.rotation:
            return {}
        return {"hadamard": sylvester_hadamard(dense_hadamard_block(self.head_dim)).astype(np.float32)}
