"""``kivi``: KIVI (Liu, Yuan et al., arXiv 2402.02750), tuning-free asymmetric 2/4-bit KV cache.

Keys are quantized per channel over groups of ``group`` consecutive tokens (key outliers sit in
fixed channels, so a channel's range is tight); values per token over groups of ``group``
channels. Both use asymmetric min/max round-to-nearest (specs/baselines.md section 4).

Zero-point: as KIVI's official code, the group minimum is the float zero-point
(``v = q s + min``, zero-point ``"min"`` in its :class:`~kvq_core.methods.intcodes.IntCodeRecipe`), stored float16 beside the
float16 scale; a constant or all-zero group (zero range) reconstructs exactly with scale 0.
"""
from __future__ import annotations

import dataclasses
import math

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.methods.intcodes import CHANNELS, NO_ROTATION, TOKENS, ZERO_MIN, IntCodeRecipe, IntGroups
from kvq_core.spec import MethodSpec, channel_group


@dataclasses.dataclass(frozen=True)
class KiviSpec(MethodSpec):
    """KIVI at ``bits`` bits (the paper uses 2 and 4) with groups of ``group`` (paper: 32).

    ``group`` is the number of tokens sharing a key channel's (scale, offset) and the number of
    channels sharing a value token's; it must divide head_dim. It defaults to 32 (16 where 32 does
    not divide head_dim, e.g. 80: :func:`kvq_core.spec.channel_group`). Bits per element: bits + 32/group.
    """

    method = "kivi"
    summary = "KIVI: asymmetric INT-b, keys per channel over token groups, values per token over channel groups"
    default_residual = 128

    bits: int = 2
    group: int | None = None

    def validate(self) -> None:
        super().validate()
        self._check_int("bits", 1, 8)
        if self.group is None:
            self._set("group", channel_group(32, self.head_dim))
        self._check_int("group", 1, self.head_dim)
        if self.head_dim % self.group:
            self._fail("group", f"a divisor of head_dim={self.head_dim}")

    @property
    def recipe(self) -> IntCodeRecipe:
        """No rotation, no token norm; keys per channel over ``group`` tokens, values per token over
        ``group`` channels, the group minimum as the zero-point."""
        return IntCodeRecipe(NO_ROTATION, False, IntGroups(self.bits, TOKENS, self.group, ZERO_MIN),
                             IntGroups(self.bits, CHANNELS, self.group, ZERO_MIN))

    def _layout(self, lead: tuple[int, int, int], stats: tuple[int, int, int, int]) -> Layout:
        return make_layout(
            codes_field("codes", lead, self.head_dim, self.bits),
            float_field("scale", stats, "float16"),
            float_field("offset", stats, "float16"),
        )

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """Codes packed along head_dim; per-channel (scale, offset) per group of tokens."""
        stats = (batch, kv_heads, math.ceil(tokens / self.group), self.head_dim)
        return self._layout((batch, kv_heads, tokens), stats)

    def value_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """Codes packed along head_dim; per-token (scale, offset) per group of channels."""
        stats = (batch, kv_heads, tokens, self.head_dim // self.group)
        return self._layout((batch, kv_heads, tokens), stats)
