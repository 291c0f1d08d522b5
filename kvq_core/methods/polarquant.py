"""``polarquant``: PolarQuant (Han, Kacham, Karbasi, Mirrokni, Zandieh; arXiv 2502.02617).

Not the key-only 2-D PolarQuant of Wu et al. (2502.00527); see specs/baselines.md sections 0, 2.

Each head vector is rotated, y = R x, cut into blocks of 2^L coordinates and put in recursive
polar form: level 1 pairs coordinates (y_2j, y_2j+1) into a radius and an angle in [0, 2 pi);
each level l >= 2 pairs the radii of level l-1 into a radius and an angle in [0, pi/2]. Stored
per vector: the codebook index of every angle (``level_bits[l-1]`` bits at level l) and the
last radius of every block (float16, the paper's choice, or float32). The paper's (4, 2, 2, 2)
costs (8*4 + 4*2 + 2*2 + 2 + 16) / 16 = 3.875 bits per element.

Decisions where the paper is silent or differs:

- Preconditioner: the paper multiplies by a random (Gaussian/orthogonal) matrix. We use the
  house rotation R = H diag(s), H the orthonormal Sylvester Hadamard matrix and s the +-1 signs
  of (seed, layer, kv_head): it is orthogonal (R^-1 = R^T, so decoding is exact and inner
  products are kept), costs O(d log d) by the FWHT instead of O(d^2), and is regenerated from
  the seed, so nothing is stored. ``rotation="none"`` skips it (ablation only).
- Codebooks are the "offline" ones: a uniform grid at level 1 and Lloyd-Max on the exact
  sin^(k-1)(2 psi) angle law at level >= 2 (no per-prompt k-means).
- Values use the same codec as keys (the paper quantizes both; it names no separate value codec).
- No full-precision recent window by default (``default_residual = 0``): the paper keeps none.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.math.codebooks import MAX_BITS, polar_angle_codebook
from kvq_core.math.signs import random_signs
from kvq_core.spec import MethodSpec


@dataclasses.dataclass(frozen=True)
class PolarQuantSpec(MethodSpec):
    """PolarQuant with ``len(level_bits)`` levels; ``level_bits[l-1]`` bits per angle at level l.

    The block of 2^L coordinates must divide head_dim (i.e. L <= log2(head_dim)).
    """

    method = "polarquant"
    summary = "PolarQuant: randomized Hadamard rotation, recursive polar transform, per-level angle codebooks"
    default_residual = 0
    default_flush = "sliding"

    level_bits: tuple[int, ...] = (4, 2, 2, 2)
    radius_dtype: str = "float16"
    seed: int = 0
    rotation: str = "hadamard"

    def validate(self) -> None:
        super().validate()
        bits = self.level_bits
        if not isinstance(bits, (tuple, list)) or not bits or any(
            isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b <= MAX_BITS for b in bits
        ):
            self._fail("level_bits", f"a non-empty sequence of integers in [1, {MAX_BITS}], one per level")
        self._set("level_bits", tuple(int(b) for b in bits))  # hashable and plain-JSON
        if self.head_dim % self.block:
            self._fail("level_bits", f"at most log2(head_dim)={self.head_dim.bit_length() - 1} levels "
                       f"(the block of 2^levels={self.block} coordinates must divide head_dim={self.head_dim})")
        self._check_choice("radius_dtype", ("float16", "float32"))
        self._check_int("seed", 0, 2**64 - 1)
        self._check_choice("rotation", ("hadamard", "none"))

    @property
    def levels(self) -> int:
        return len(self.level_bits)

    @property
    def block(self) -> int:
        """Coordinates per block: 2^levels, each block ending in one stored radius."""
        return 2**self.levels

    def angles_at(self, level: int) -> int:
        """Number of angles per vector at ``level`` (1-based): head_dim / 2^level."""
        return self.head_dim >> level

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """One code field per level (``level1`` ... ``levelL``) and the block radii."""
        lead = (batch, kv_heads, tokens)
        codes = [
            codes_field(f"level{l}", lead, self.angles_at(l), b) for l, b in enumerate(self.level_bits, start=1)
        ]
        radius = float_field("radius", (*lead, self.head_dim // self.block), self.radius_dtype)
        return make_layout(*codes, radius)

    value_layout = key_layout

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """float32 centroids/thresholds per level (``level{l}_centroids``, ...), plus the rotation signs."""
        consts: dict[str, np.ndarray] = {}
        if self.rotation == "hadamard":
            consts["signs"] = random_signs(self.seed, layer, kv_heads, self.head_dim)
        for l, b in enumerate(self.level_bits, start=1):
            book = polar_angle_codebook(l, b)
            consts[f"level{l}_centroids"] = book.centroids.astype(np.float32)
            consts[f"level{l}_thresholds"] = book.thresholds.astype(np.float32)
        return consts
