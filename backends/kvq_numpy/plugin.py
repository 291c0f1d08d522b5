"""Registers the NumPy reference backend through kvq's hooks, like any third-party plugin."""
from __future__ import annotations

from collections.abc import Callable

from kvq_core.hookspecs import hookimpl
from kvq_core.registry import BackendInfo
from kvq_numpy.arrays import NumpyArrays
from kvq_numpy.fp16 import Fp16Kernels
from kvq_numpy.kivi import KiviKernels
from kvq_numpy.octopus import OctopusKernels
from kvq_numpy.oscar import OscarKernels
from kvq_numpy.polarquant import PolarQuantKernels
from kvq_numpy.qjl import QJLKernels
from kvq_numpy.quarot import QuaRotKernels
from kvq_numpy.turboquant import TurboQuantKernels, TurboQuantProdKernels

KERNELS = {
    "fp16": Fp16Kernels,
    "kivi": KiviKernels,
    "octopus": OctopusKernels,
    "oscar": OscarKernels,
    "polarquant": PolarQuantKernels,
    "qjl": QJLKernels,
    "quarot": QuaRotKernels,
    "turboquant": TurboQuantKernels,
    "turboquant_prod": TurboQuantProdKernels,
}


@hookimpl
def kvq_register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(BackendInfo("numpy", KERNELS, NumpyArrays(), summary="NumPy reference (the readable truth)"))
