"""``turboquant`` and ``turboquant_prod``: TurboQuant (Zandieh, Daliri, Hadian, Mirrokni; arXiv 2504.19874).

``turboquant`` (Algorithm 1, TurboQuant_mse; specs/baselines.md section 1) stores per head
vector x its norm n = ||x|| (float32, the house choice for every per-vector norm) and, for
v = R x / n, the index of every coordinate in the 2^b-level Lloyd-Max codebook of the exact
law of one coordinate of a uniform point on S^{d-1}. Decoding is n R^T c[idx]; a query is
rotated once and scores n <R q, c[idx]>. With ``high_bits_coords`` = n_hi > 0 the first n_hi
rotated coordinates use b+1 bits (field ``codes_hi``) and the rest b bits (field ``codes``):
the rate-matched split that compares TurboQuant with OCTOPUS at equal bits (octopus.md 2).

``turboquant_prod`` (Algorithm 2) quantizes the unit vector with (b-1)-bit ``turboquant``, then
stores the signs of S r for the rotated residual r = v - c[idx] (S a d x d sketch, 1 bit per
coordinate, field ``qjl``) and gamma = ||r|| (float32). S acts in the rotated domain, so the
query is rotated once and scores n (<R q, c[idx]> + sqrt(pi/2)/d gamma <S R q, h>), which is
unbiased over S for any fixed R (S R has the law of S for Gaussian and orthogonal sketches).

Decisions where the paper is silent:

- Rotation: the house randomized Hadamard R = H diag(s), s = random_signs(seed, layer, kv_head),
  as OCTOPUS; ``rotation="haar"`` draws a Haar orthogonal matrix per (layer, kv head) instead.
- ``norm_correction`` (``turboquant`` only; vLLM ``_nc``, Qdrant "renorm") stores
  n / ||c[idx]|| instead of n, so that ||x_hat|| = ||x||; decoding is unchanged.
- Values use the same codec as keys. ``turboquant_prod`` has ``values="prod"`` by default (the
  paper's Algorithm 2 applied to the whole cache, as the TurboQuant-QJL rows of the OCTOPUS
  paper); ``values="mse"`` stores V with b-bit ``turboquant`` instead, which users recommend:
  attention needs low value MSE, not unbiased value inner products.
- ``turboquant_prod`` requires bits >= 2: at b = 1 there is no MSE stage and the codec is ``qjl``
  with m = d (plus a rotation, which does not change a Gaussian sketch's law).
- ``default_residual = 0``: the paper names no full-precision recent window. With one
  (``residual=32``, as OCTOPUS's comparison runs it) the flush is sliding, OCTOPUS's protocol.

Bits per element: ``turboquant`` b + 32/d (+ n_hi/d, + row padding of each code field);
``turboquant_prod`` (b-1) + 1 + 64/d.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.math.codebooks import MAX_BITS, coordinate_codebook
from kvq_core.math.signs import random_signs
from kvq_core.math.sketch import ROTATION_STREAM, SEED_MAX, SKETCHES, haar_orthogonal, head_rng, sketches
from kvq_core.spec import MethodSpec

ROTATIONS = ("hadamard", "haar")


class CoordGroup(NamedTuple):
    """Rotated coordinates [start, stop) stored as ``bits``-bit codes in code field ``field``."""

    field: str
    start: int
    stop: int
    bits: int


def codebook_key(bits: int) -> str:
    """Constants key of the float32 centroids of the ``bits``-bit coordinate codebook."""
    return f"codebook_b{bits}"


def thresholds_key(bits: int) -> str:
    """Constants key of the float32 thresholds of the ``bits``-bit coordinate codebook."""
    return f"thresholds_b{bits}"


def rotation_constants(rotation: str, seed: int, layer: int, kv_heads: int, d: int) -> dict[str, np.ndarray]:
    """``signs`` (kv_heads, d) of R = H diag(s), or the Haar ``rotation`` matrices (kv_heads, d, d), float32."""
    if rotation == "hadamard":
        return {"signs": random_signs(seed, layer, kv_heads, d)}
    mats = [haar_orthogonal(head_rng(seed, layer, h, ROTATION_STREAM), d) for h in range(kv_heads)]
    return {"rotation": np.stack(mats).astype(np.float32)}


def codebook_constants(d: int, *bits: int) -> dict[str, np.ndarray]:
    """float32 centroids and thresholds of the coordinate codebook at each bit width."""
    consts = {}
    for b in bits:
        book = coordinate_codebook(d, b)
        consts[codebook_key(b)] = book.centroids.astype(np.float32)
        consts[thresholds_key(b)] = book.thresholds.astype(np.float32)
    return consts


@dataclasses.dataclass(frozen=True)
class TurboQuantSpec(MethodSpec):
    """TurboQuant_mse at ``bits`` b per coordinate; the first ``high_bits_coords`` rotated coordinates get b+1."""

    method = "turboquant"
    summary = "TurboQuant (MSE): random rotation, per-coordinate Lloyd-Max codebook, float32 norm"
    default_residual = 0
    default_flush = "sliding"

    bits: int = 2
    rotation: str = "hadamard"
    norm_correction: bool = False
    seed: int = 0
    high_bits_coords: int = 0

    def validate(self) -> None:
        super().validate()
        self._check_int("bits", 1, MAX_BITS)
        self._check_choice("rotation", ROTATIONS)
        self._check_bool("norm_correction")
        self._check_int("seed", 0, SEED_MAX)
        self._check_int("high_bits_coords", 0, self.head_dim)
        if self.rotation == "haar":
            self.check_dense("rotation", self.head_dim, self.head_dim, qr=True)
        if self.high_bits_coords and self.bits == MAX_BITS:
            self._fail("high_bits_coords", f"0 when bits={MAX_BITS} (codebooks have at most {MAX_BITS} bits)")

    def coord_groups(self) -> tuple[CoordGroup, ...]:
        """The non-empty code fields: ``codes`` (b bits) for coordinates n_hi..d, ``codes_hi`` (b+1) for 0..n_hi."""
        n_hi = self.high_bits_coords
        groups = (CoordGroup("codes", n_hi, self.head_dim, self.bits), CoordGroup("codes_hi", 0, n_hi, self.bits + 1))
        return tuple(g for g in groups if g.stop > g.start)

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        lead = (batch, kv_heads, tokens)
        codes = [codes_field(g.field, lead, g.stop - g.start, g.bits) for g in self.coord_groups()]
        return make_layout(*codes, float_field("norm", lead, "float32"))

    value_layout = key_layout

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """The rotation (``signs`` or ``rotation``) and ``codebook_b*``/``thresholds_b*`` per bit width used."""
        bits = {g.bits for g in self.coord_groups()}
        return {
            **rotation_constants(self.rotation, self.seed, layer, kv_heads, self.head_dim),
            **codebook_constants(self.head_dim, *sorted(bits)),
        }


@dataclasses.dataclass(frozen=True)
class TurboQuantProdSpec(MethodSpec):
    """TurboQuant_prod at ``bits`` b: (b-1)-bit TurboQuant_mse plus 1-bit QJL of the residual."""

    method = "turboquant_prod"
    summary = "TurboQuant (prod): (b-1)-bit TurboQuant + 1-bit QJL on the residual, unbiased inner products"
    default_residual = 0
    default_flush = "sliding"

    bits: int = 2
    rotation: str = "hadamard"
    sketch: str = "gaussian"
    seed: int = 0
    values: str = "prod"

    def validate(self) -> None:
        super().validate()
        self._check_int("bits", 2, MAX_BITS)
        self._check_choice("rotation", ROTATIONS)
        self._check_choice("sketch", SKETCHES)
        self._check_int("seed", 0, SEED_MAX)
        self._check_choice("values", ("prod", "mse"))
        if self.rotation == "haar":
            self.check_dense("rotation", self.head_dim, self.head_dim, qr=True)
        self.check_dense("sketch", self.head_dim, self.head_dim, qr=self.sketch == "orthogonal")  # a d x d sketch

    @property
    def mse_stage(self) -> TurboQuantSpec:
        """The (b-1)-bit TurboQuant_mse stage (same rotation and seed)."""
        return TurboQuantSpec(head_dim=self.head_dim, bits=self.bits - 1, rotation=self.rotation, seed=self.seed)

    @property
    def value_codec(self) -> TurboQuantSpec:
        """With ``values="mse"``: the b-bit TurboQuant_mse codec of values."""
        return TurboQuantSpec(head_dim=self.head_dim, bits=self.bits, rotation=self.rotation, seed=self.seed)

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        lead = (batch, kv_heads, tokens)
        return make_layout(
            *self.mse_stage.key_layout(batch, kv_heads, tokens).values(),
            codes_field("qjl", lead, self.head_dim, 1),
            float_field("residual_norm", lead, "float32"),
        )

    def value_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        if self.values == "mse":
            return self.value_codec.key_layout(batch, kv_heads, tokens)
        return self.key_layout(batch, kv_heads, tokens)

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """The stage's rotation and codebook, the b-bit codebook for ``values="mse"``, and the d x d ``sketch``."""
        consts = self.mse_stage.constants(kv_heads, layer)
        if self.values == "mse":
            consts.update(codebook_constants(self.head_dim, self.bits))
        consts["sketch"] = sketches(self.seed, layer, kv_heads, self.head_dim, self.head_dim, self.sketch)
        return consts
