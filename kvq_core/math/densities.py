"""Exact 1-D densities of the scalars that the rotation-based codecs quantise.

Each is the law that a scalar has when the input direction is uniform (Haar-rotated), so a
Lloyd-Max codebook fitted to it is the optimal scalar quantiser for that codec.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvq_core.errors import SpecError

__all__ = [
    "Density",
    "sphere_coordinate_pdf",
    "octahedral_coordinate_pdf",
    "triplet_norm_pdf",
    "polar_angle_pdf",
    "polar_angle_support",
]

MAX_POLAR_LEVEL = 16


@dataclass(frozen=True)
class Density:
    """A normalised pdf on ``[lo, hi]``; ``pdf`` is vectorised and returns 0 outside."""

    pdf: Callable[[np.ndarray], np.ndarray]
    lo: float
    hi: float
    name: str


def int_param(method: str, param: str, value: int, lo: int, hi: int | None = None) -> int:
    """Return ``value`` as an int in ``[lo, hi]`` or raise :class:`SpecError` naming ``param``."""
    expected = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
    if isinstance(value, bool):
        raise SpecError(method, param, value, expected)
    try:
        v = operator.index(value)
    except TypeError:
        raise SpecError(method, param, value, expected) from None
    if v < lo or (hi is not None and v > hi):
        raise SpecError(method, param, value, expected)
    return v


def _on_support(lo: float, hi: float, body: Callable[[np.ndarray], np.ndarray]) -> Callable:
    """Wrap ``body`` (valid on [lo, hi]) into a pdf that is 0 outside the support."""

    def pdf(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        inside = (x >= lo) & (x <= hi)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.where(inside, body(np.clip(x, lo, hi)), 0.0)

    return pdf


def sphere_coordinate_pdf(d: int) -> Density:
    """Law of one coordinate of a uniform point on S^{d-1} (TurboQuant), d >= 2.

    ``f(x) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2)`` on [-1, 1].
    """
    return _sphere_coordinate_pdf(int_param("sphere_coordinate_pdf", "d", d, 2))


@functools.lru_cache(maxsize=64)
def _sphere_coordinate_pdf(d: int) -> Density:
    log_c = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    scale = math.exp(log_c)

    def body(x: np.ndarray) -> np.ndarray:
        return scale * np.power(1 - x * x, (d - 3) / 2)

    return Density(_on_support(-1.0, 1.0, body), -1.0, 1.0, f"sphere-coordinate-d{d}")


def _octahedral_half(a: np.ndarray) -> np.ndarray:
    """Closed form of one piece of the octahedral marginal (see octahedral_coordinate_pdf)."""
    c = a * a + (1 - a) ** 2
    return 2 * a / ((a * a + 2 * (1 - a) ** 2) * np.sqrt(c))


def octahedral_coordinate_pdf() -> Density:
    """Exact marginal of xi (and of eta) for a uniform direction under the octahedral map.

    Integrating ``oct_density`` over eta in closed form (the squared octahedron norm is
    quadratic in eta on each piece, and the lower-hemisphere piece is the upper one with
    xi -> 1 - xi) gives ``f(xi) = (J(1-|xi|) + J(|xi|)) / (2 pi)`` with
    ``J(a) = 2a / ((a^2 + 2(1-a)^2) sqrt(a^2 + (1-a)^2))``.
    f(0) = f(+-1) = 1/pi, f(+-1/3) = f(+-2/3) = 0.5694, f(xi) = f(1 - xi) on [0, 1], variance
    0.3201. (The maximum is 0.6002 at +-1/2, not at +-1/3 and +-2/3 as octopus.md 1.6 says.)
    """
    return _OCTAHEDRAL


def _octahedral_body(x: np.ndarray) -> np.ndarray:
    a = np.abs(x)
    return (_octahedral_half(1 - a) + _octahedral_half(a)) / (2 * np.pi)


_OCTAHEDRAL = Density(_on_support(-1.0, 1.0, _octahedral_body), -1.0, 1.0, "octahedral-coordinate")


def triplet_norm_pdf(d: int) -> Density:
    """Law of the norm rho of 3 coordinates of a uniform point on S^{d-1}, d >= 4.

    rho^2 ~ Beta(3/2, (d-3)/2), so ``f(rho) = 2 rho Beta_pdf(rho^2; 3/2, (d-3)/2)`` on [0, 1].
    """
    return _triplet_norm_pdf(int_param("triplet_norm_pdf", "d", d, 4))


@functools.lru_cache(maxsize=64)
def _triplet_norm_pdf(d: int) -> Density:
    a, b = 1.5, (d - 3) / 2
    log_c = math.log(2.0) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    scale = math.exp(log_c)

    def body(r: np.ndarray) -> np.ndarray:
        return scale * r * r * np.power(1 - r * r, b - 1)

    return Density(_on_support(0.0, 1.0, body), 0.0, 1.0, f"triplet-norm-d{d}")


def polar_angle_support(level: int) -> tuple[float, float]:
    """Support of a PolarQuant angle: [0, 2 pi) at level 1, [0, pi/2] at levels >= 2."""
    level = int_param("polar_angle_pdf", "level", level, 1, MAX_POLAR_LEVEL)
    return (0.0, 2 * np.pi) if level == 1 else (0.0, np.pi / 2)


def polar_angle_pdf(level: int) -> Density:
    """Law of a PolarQuant angle at ``level`` (1..16) for a Gaussian (preconditioned) input.

    Level 1 is uniform on [0, 2 pi). Level >= 2 with k = 2^(level-1):
    ``f(psi) = Gamma(k) / (2^(k-2) Gamma(k/2)^2) sin^(k-1)(2 psi)`` on [0, pi/2].
    """
    return _polar_angle_pdf(int_param("polar_angle_pdf", "level", level, 1, MAX_POLAR_LEVEL))


@functools.lru_cache(maxsize=MAX_POLAR_LEVEL)
def _polar_angle_pdf(level: int) -> Density:
    lo, hi = polar_angle_support(level)
    k = 2 ** (level - 1)
    scale = 1 / (2 * math.pi) if level == 1 else math.exp(
        math.lgamma(k) - (k - 2) * math.log(2.0) - 2 * math.lgamma(k / 2)
    )

    def body(x: np.ndarray) -> np.ndarray:
        if level == 1:
            return np.full_like(x, scale)
        return scale * np.power(np.maximum(np.sin(2 * x), 0.0), k - 1)

    return Density(_on_support(lo, hi, body), lo, hi, f"polar-angle-L{level}")
