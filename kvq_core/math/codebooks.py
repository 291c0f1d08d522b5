"""Cached codebooks of the rotation-based codecs (TurboQuant, OCTOPUS, PolarQuant).

Each getter validates its arguments, then builds the Lloyd-Max codebook of the exact density
once per process (a few tens of milliseconds for the first codebook of a density).
"""
from __future__ import annotations

import functools

from kvq_core.math.densities import (
    MAX_POLAR_LEVEL,
    int_param,
    octahedral_coordinate_pdf,
    polar_angle_pdf,
    polar_angle_support,
    sphere_coordinate_pdf,
    triplet_norm_pdf,
)
from kvq_core.math.lloyd_max import Codebook, lloyd_max, uniform_codebook

__all__ = [
    "MAX_BITS",
    "coordinate_codebook",
    "octahedral_codebook",
    "triplet_norm_codebook",
    "polar_angle_codebook",
]

MAX_BITS = 8


def coordinate_codebook(d: int, bits: int) -> Codebook:
    """TurboQuant: 2^bits-level Lloyd-Max codebook of one coordinate of a uniform point on S^{d-1}."""
    return _coordinate_codebook(
        int_param("coordinate_codebook", "d", d, 2),
        int_param("coordinate_codebook", "bits", bits, 1, MAX_BITS),
    )


@functools.lru_cache(maxsize=None)
def _coordinate_codebook(d: int, bits: int) -> Codebook:
    return lloyd_max(sphere_coordinate_pdf(d), 2**bits)


def octahedral_codebook(bits: int) -> Codebook:
    """OCTOPUS: the shared xi/eta codebook for the octahedral direction coordinates."""
    return _octahedral_codebook(int_param("octahedral_codebook", "bits", bits, 1, MAX_BITS))


@functools.lru_cache(maxsize=None)
def _octahedral_codebook(bits: int) -> Codebook:
    return lloyd_max(octahedral_coordinate_pdf(), 2**bits)


def triplet_norm_codebook(d: int, bits: int) -> Codebook:
    """OCTOPUS: codebook of a triplet's norm rho when the unit head vector has dimension d."""
    return _triplet_norm_codebook(
        int_param("triplet_norm_codebook", "d", d, 4),
        int_param("triplet_norm_codebook", "bits", bits, 1, MAX_BITS),
    )


@functools.lru_cache(maxsize=None)
def _triplet_norm_codebook(d: int, bits: int) -> Codebook:
    return lloyd_max(triplet_norm_pdf(d), 2**bits)


def polar_angle_codebook(level: int, bits: int) -> Codebook:
    """PolarQuant: uniform grid on [0, 2 pi) at level 1, Lloyd-Max on the angle law at levels >= 2."""
    return _polar_angle_codebook(
        int_param("polar_angle_codebook", "level", level, 1, MAX_POLAR_LEVEL),
        int_param("polar_angle_codebook", "bits", bits, 1, MAX_BITS),
    )


@functools.lru_cache(maxsize=None)
def _polar_angle_codebook(level: int, bits: int) -> Codebook:
    if level == 1:
        lo, hi = polar_angle_support(1)
        return uniform_codebook(lo, hi, 2**bits, f"polar-angle-L1-K{2**bits}")
    return lloyd_max(polar_angle_pdf(level), 2**bits)
