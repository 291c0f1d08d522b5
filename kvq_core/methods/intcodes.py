"""The ingredients of the integer-code methods (OScaR, KIVI, QuaRot), stated once as data.

Each of these methods is one recipe: an optional Hadamard rotation per head, an optional
omni-token key norm (OScaR's OTS), then asymmetric min/max integer codes over groups of
consecutive entries along tokens or channels, with an integer or float zero-point, and an
optional clipping of each group's range (QuaRot). A spec states its recipe
(``spec.recipe``, an :class:`IntCodeRecipe`); each backend implements the recipe once, in one
int-codes kernel class, instead of one class per method.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

#: Rotations: none, or the orthonormal Sylvester Hadamard per head (natural order, no random
#: signs; its dense factor is the spec's ``hadamard`` constant).
NO_ROTATION, HADAMARD = "none", "hadamard"
#: Group axes of a ``[batch, kv_heads, tokens, head_dim]`` block: a group is ``size`` consecutive
#: tokens of one channel, or ``size`` consecutive channels of one token.
TOKENS, CHANNELS = "tokens", "channels"
#: Zero-points (specs/oscar.md 1.4, specs/baselines.md 4): ``"integer"`` rounds the zero-point to
#: a code (0 exactly representable; an all-zero group uses the range [-1, 1]); ``"min"`` stores
#: the group minimum as a float (KIVI's official code).
ZERO_INTEGER, ZERO_MIN = "integer", "min"

Rotation = Literal["none", "hadamard"]
Axis = Literal["tokens", "channels"]
ZeroPoint = Literal["integer", "min"]


@dataclasses.dataclass(frozen=True)
class IntGroups:
    """How keys or values are coded: ``bits`` per code, one (scale, offset) per group of ``size``
    consecutive entries along ``axis``, with a ``zero_point`` of the kind named."""

    bits: int
    axis: Axis
    size: int
    zero_point: ZeroPoint

    def __post_init__(self) -> None:
        if self.axis not in (TOKENS, CHANNELS):
            raise ValueError(f"IntGroups.axis={self.axis!r}; expected {TOKENS!r} or {CHANNELS!r}")
        if self.zero_point not in (ZERO_INTEGER, ZERO_MIN):
            raise ValueError(f"IntGroups.zero_point={self.zero_point!r}; expected {ZERO_INTEGER!r} or {ZERO_MIN!r}")


@dataclasses.dataclass(frozen=True)
class IntCodeRecipe:
    """An integer-code method's ingredients, in the order encoding applies them.

    ``rotation`` of keys and values (attention rotates the query once and the output back once);
    ``token_norm``: keys divided by each token's L2 norm over every KV head and channel, stored
    as the ``norm`` field and multiplied back into each logit; ``keys``/``values``: the grouping;
    ``clip_ratio`` rho < 1: each group's range becomes ``[rho min(x_min, 0), rho max(x_max, 0)]``.
    """

    rotation: Rotation
    token_norm: bool
    keys: IntGroups
    values: IntGroups
    clip_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.rotation not in (NO_ROTATION, HADAMARD):
            raise ValueError(f"IntCodeRecipe.rotation={self.rotation!r}; expected {NO_ROTATION!r} or {HADAMARD!r}")

    @property
    def rotates(self) -> bool:
        """Whether keys, values (and so queries and outputs) go through the Hadamard rotation."""
        return self.rotation == HADAMARD

    def groups(self, kind: str) -> IntGroups:
        """The grouping of ``kind`` ("keys" or "values")."""
        return self.keys if kind == "keys" else self.values
