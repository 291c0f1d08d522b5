"""kvq math: Hadamard rotations, random signs, octahedral map, exact densities, Lloyd-Max codebooks."""
from kvq_core.math.codebooks import (
    MAX_BITS,
    coordinate_codebook,
    octahedral_codebook,
    polar_angle_codebook,
    triplet_norm_codebook,
)
from kvq_core.math.densities import (
    Density,
    octahedral_coordinate_pdf,
    polar_angle_pdf,
    polar_angle_support,
    sphere_coordinate_pdf,
    triplet_norm_pdf,
)
from kvq_core.math.hadamard import dense_hadamard_block, fwht, hadamard_block, is_power_of_two, sylvester_hadamard
from kvq_core.math.lloyd_max import Codebook, lloyd_max, uniform_codebook
from kvq_core.math.octahedral import oct_decode, oct_density, oct_encode, oct_point_norm
from kvq_core.math.signs import random_signs, splitmix64

__all__ = [
    "MAX_BITS",
    "Codebook",
    "Density",
    "coordinate_codebook",
    "dense_hadamard_block",
    "fwht",
    "hadamard_block",
    "is_power_of_two",
    "lloyd_max",
    "oct_decode",
    "oct_density",
    "oct_encode",
    "oct_point_norm",
    "octahedral_codebook",
    "octahedral_coordinate_pdf",
    "polar_angle_codebook",
    "polar_angle_pdf",
    "polar_angle_support",
    "random_signs",
    "sphere_coordinate_pdf",
    "splitmix64",
    "sylvester_hadamard",
    "triplet_norm_codebook",
    "triplet_norm_pdf",
    "uniform_codebook",
]
