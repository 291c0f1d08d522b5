"""``qjl``: QJL (Zandieh, Daliri, Han; arXiv 2406.03482), 1-bit Johnson-Lindenstrauss keys.

Keys (specs/baselines.md section 3): with S an m x d random sketch per (layer, kv head), store
the signs h = sign(S k) (sign(0) = +1; m codes of 1 bit) and ||k|| (float32, the house choice
for every per-vector norm). A query stays unquantized and scores
``sqrt(pi/2) / m * ||k|| * <S q, h>``, an unbiased estimate of <q, k> with variance at most
``pi / (2m) * ||q||^2 ||k||^2``. Values use KIVI's per-token asymmetric INT-``value_bits``
quantizer over groups of ``value_group`` channels, as the official code does.

Decisions where the paper is silent or differs:

- ``sketch="gaussian"`` (the paper's S_ij ~ N(0, 1)) is the default. ``"orthogonal"`` is the
  official code's variant: blocks of d rows, each a Haar orthogonal matrix, so rows within a
  block are orthogonal (lower variance). Rows are scaled to E||g||, the mean length of a d-dim
  Gaussian row, sqrt(2) Gamma((d+1)/2) / Gamma(d/2) (about sqrt(d) (1 - 1/(4d))), which keeps
  the estimator exactly unbiased; scaling by sqrt(d) would bias it by about +1/(4d).
- Sketches (and Haar rotations) come from a NumPy Generator seeded by (seed, layer, kv head,
  stream), so each head's matrix is independent of kv_heads and of the order of calls.
- The official code's outlier split is not implemented: it picks, per group of 32 tokens, the
  8 channels with the largest norm and sketches them separately, a data-dependent selection
  with its own index storage and a second estimator. It is left as future work; this codec is
  the data-oblivious QJL of the paper's analysis.
- ``default_residual = 128``: the paper's full-precision buffer of recent tokens.

Bits per element at d = 128, m = 256: keys m/d + 32/d = 2.25; values value_bits + 32/value_group.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.math.sketch import SEED_MAX, SKETCHES, sketches
from kvq_core.methods.kivi import KiviSpec
from kvq_core.spec import MethodSpec, channel_group

MAX_SKETCH_DIM = 1 << 14


@dataclasses.dataclass(frozen=True)
class QJLSpec(MethodSpec):
    """QJL with an m = ``sketch_dim`` row sketch for keys and KIVI-style INT values.

    ``value_group`` defaults to 32 channels (fewer where 32 does not divide head_dim,
    :func:`kvq_core.spec.channel_group`) and must divide head_dim.
    """

    method = "qjl"
    summary = "QJL: 1-bit signs of a random sketch of each key plus its norm; per-token INT values"
    default_residual = 128

    sketch_dim: int = 256
    sketch: str = "gaussian"
    seed: int = 0
    value_bits: int = 2
    value_group: int | None = None

    def validate(self) -> None:
        super().validate()
        self._check_int("sketch_dim", 1, MAX_SKETCH_DIM)
        self._check_choice("sketch", SKETCHES)
        orthogonal = self.sketch == "orthogonal"  # whole d x d Haar blocks, cut to sketch_dim rows
        rows = -(-self.sketch_dim // self.head_dim) * self.head_dim if orthogonal else self.sketch_dim
        self.check_dense("sketch_dim", rows, self.head_dim, qr=orthogonal)
        self._check_int("seed", 0, SEED_MAX)
        self._check_int("value_bits", 1, 8)
        if self.value_group is None:
            self._set("value_group", channel_group(32, self.head_dim))
        self._check_int("value_group", 1, self.head_dim)
        if self.head_dim % self.value_group:
            self._fail("value_group", f"a divisor of head_dim={self.head_dim}")

    @property
    def value_codec(self) -> KiviSpec:
        """The value quantizer: KIVI's per-token, per-channel-group INT codec."""
        return KiviSpec(head_dim=self.head_dim, bits=self.value_bits, group=self.value_group)

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        lead = (batch, kv_heads, tokens)
        return make_layout(codes_field("qjl", lead, self.sketch_dim, 1), float_field("norm", lead, "float32"))

    def value_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        return self.value_codec.value_layout(batch, kv_heads, tokens)

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """The sketch S, float32 (kv_heads, sketch_dim, head_dim)."""
        return {"sketch": sketches(self.seed, layer, kv_heads, self.sketch_dim, self.head_dim, self.sketch)}
