"""``octopus``: triplet polar codec of keys (and values) after a seeded Hadamard rotation.

OCTOPUS (arXiv 2605.21226; ``shared/specs/octopus.md``) stores, per head vector k:

- gamma = ||k|| as float32 (spec 1.1), and u = k / gamma;
- v = R u with R = H_d diag(s), s the +-1 signs of (seed, layer, kv_head) (1.2);
- v cut into triplets t (1.3), each split into its norm rho = ||t|| and direction
  n = t / rho (n = (0,0,1) when rho = 0) (1.4). When 3 does not divide d, ``tail`` says what
  happens to the last d mod 3 coordinates: ``"pad"`` zero-pads them into one more triplet (the
  paper's choice, the default at power-of-two head_dim so published numbers stay reproducible);
  ``"scalar"`` codes each with the b-bit Lloyd-Max codebook of one coordinate of a uniform unit
  vector in d dimensions (the spec's alternative, same MSE; the default at other head_dims such
  as 80 or 112, where it saves the padded triplet's bits);
- n as the octahedral point (xi, eta) (1.5); xi and eta are quantised with the Lloyd-Max
  codebook of the exact octahedral marginal, rho with that of the triplet-norm law (1.6).

Bits: (b+1, b+1, b-1) for (xi, eta, rho) by default, i.e. 3b+1 bits per triplet (1.7).

Packing: one code per triplet, ``(i_xi << (eta_bits + rho_bits)) | (i_eta << rho_bits) | i_rho``,
``n_triplets`` codes per vector in the shared little-endian bitstream of
:func:`kvq_core.layout.pack_codes`, each vector's row padded to whole bytes. A scalar tail's
``d mod 3`` codes of ``bits`` bits follow the triplet codes in the same row (the field is then
declared as a stream of 1-bit codes, ``n_triplets * triplet_bits + n_tail * bits`` long), so
the row is padded to whole bytes once.

Decisions where the paper is silent or open:

- ``rounding="joint"`` is the default: it is the paper's encoder (App. E, spec 1.8), costs
  nothing at decode time and lowers MSE by 6-7%; ``"plain"`` reproduces the synthetic table.
- Cache protocol (spec 1.11): ``default_residual = 32`` exact tokens with a sliding flush
  (``default_flush = "sliding"``): every decode query sees exactly its 32 most recent tokens
  exact, as HyperQuant's reproduction of the paper's evaluation does per query.
- ``values="octopus"`` is the default: the paper's kernels describe keys only (spec 1.10),
  but V needs low MSE and OCTOPUS is the lowest-MSE data-oblivious codec here, so values use
  the same codec (as katgpt and HyperQuant's reproduction do). ``values="fp16"`` stores V as
  float16, to measure key error alone.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kvq_core.layout import Layout, codes_field, float_field, make_layout
from kvq_core.math.codebooks import coordinate_codebook, octahedral_codebook, triplet_norm_codebook
from kvq_core.math.hadamard import is_power_of_two
from kvq_core.math.octahedral import oct_decode
from kvq_core.math.signs import random_signs
from kvq_core.spec import MethodSpec

_PART_BITS = (1, 8)
TAILS = ("pad", "scalar")


@dataclasses.dataclass(frozen=True)
class OctopusSpec(MethodSpec):
    """OCTOPUS at ``bits`` b in {2, 3, 4}: (xi, eta, rho) bits default to (b+1, b+1, b-1)."""

    method = "octopus"
    summary = "OCTOPUS: Hadamard rotation, triplets in octahedral polar form, Lloyd-Max codebooks"
    default_residual = 32
    default_flush = "sliding"

    bits: int = 2
    xi_bits: int | None = None
    eta_bits: int | None = None
    rho_bits: int | None = None
    rounding: str = "joint"
    seed: int = 0
    values: str = "octopus"
    tail: str | None = None

    def validate(self) -> None:
        super().validate()
        self._check_int("bits", 2, 4)
        defaults = {"xi_bits": self.bits + 1, "eta_bits": self.bits + 1, "rho_bits": self.bits - 1}
        for param, default in defaults.items():
            if getattr(self, param) is None:
                self._set(param, default)
            else:
                self._check_int(param, *_PART_BITS)
        self._check_choice("rounding", ("plain", "joint"))
        self._check_int("seed", 0, 2**64 - 1)
        self._check_choice("values", ("octopus", "fp16"))
        if self.tail is None:
            self._set("tail", "pad" if is_power_of_two(self.head_dim) else "scalar")
        self._check_choice("tail", TAILS)

    def power_of_two_gap(self) -> str | None:
        """Also the padded triplet tail: a scalar-coded tail is a layout part of its own."""
        gap = super().power_of_two_gap()
        return gap or (f"tail={self.tail!r} (only the padded triplet tail)" if self.tail != "pad" else None)

    @property
    def n_triplets(self) -> int:
        """Triplet codes per vector: ceil(d/3) with a padded tail, floor(d/3) with a scalar one."""
        return -(-self.head_dim // 3) if self.tail == "pad" else self.head_dim // 3

    @property
    def n_tail(self) -> int:
        """Scalar-coded coordinates per vector (d mod 3 with ``tail="scalar"``, else 0)."""
        return self.head_dim - 3 * self.n_triplets if self.tail == "scalar" else 0

    @property
    def triplet_bits(self) -> int:
        return self.xi_bits + self.eta_bits + self.rho_bits

    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        lead = (batch, kv_heads, tokens)
        if self.n_tail:
            codes = codes_field("codes", lead, self.n_triplets * self.triplet_bits + self.n_tail * self.bits, 1)
        else:
            codes = codes_field("codes", lead, self.n_triplets, self.triplet_bits)
        return make_layout(codes, float_field("norm", lead, "float32"))

    def value_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        if self.values == "fp16":
            return make_layout(float_field("data", (batch, kv_heads, tokens, self.head_dim), "float16"))
        return self.key_layout(batch, kv_heads, tokens)

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """Signs (kv_heads, head_dim), float32 centroids/thresholds for xi, eta, rho (and the
        scalar tail), and
        ``directions``: the decoded unit direction of every (xi, eta) centroid pair, row
        ``i_xi * len(eta_codebook) + i_eta`` (float32, as the decoder computes it), so kernels
        look a direction up instead of evaluating the octahedral map per candidate."""
        books = {
            "xi": octahedral_codebook(self.xi_bits),
            "eta": octahedral_codebook(self.eta_bits),
            "rho": triplet_norm_codebook(self.head_dim, self.rho_bits),
        }
        if self.n_tail:
            books["tail"] = coordinate_codebook(self.head_dim, self.bits)
        consts = {"signs": random_signs(self.seed, layer, kv_heads, self.head_dim)}
        for part, book in books.items():
            consts[f"{part}_codebook"] = book.centroids.astype(np.float32)
            consts[f"{part}_thresholds"] = book.thresholds.astype(np.float32)
        xi, eta = np.meshgrid(consts["xi_codebook"], consts["eta_codebook"], indexing="ij")
        consts["directions"] = oct_decode(np.stack((xi, eta), axis=-1)).reshape(-1, 3)
        return consts
