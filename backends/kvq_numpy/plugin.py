"""Registers the NumPy reference backend through kvq's hooks, like any third-party plugin.

Kernel classes are lazy ``"module:Attr"`` references: one that fails to import makes only that
method unavailable on this backend.
"""
from __future__ import annotations

from collections.abc import Callable

from kvq_core.hookspecs import hookimpl
from kvq_core.contract import BackendInfo
from kvq_numpy.arrays import NumpyArrays

KERNELS = {
    "fp16": "kvq_numpy.fp16:Fp16Kernels",
    "kivi": "kvq_numpy.intcodes:IntCodesKernels",
    "octopus": "kvq_numpy.octopus:OctopusKernels",
    "oscar": "kvq_numpy.intcodes:IntCodesKernels",
    "polarquant": "kvq_numpy.polarquant:PolarQuantKernels",
    "qjl": "kvq_numpy.qjl:QJLKernels",
    "quarot": "kvq_numpy.intcodes:IntCodesKernels",
    "turboquant": "kvq_numpy.turboquant:TurboQuantKernels",
    "turboquant_prod": "kvq_numpy.turboquant:TurboQuantProdKernels",
}


@hookimpl
def kvq_register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(BackendInfo("numpy", KERNELS, NumpyArrays(), summary="NumPy reference (the readable truth)"))
