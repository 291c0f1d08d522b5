"""kvq's entry point for this package (``[project.entry-points."kvq.plugins"] fp8``).

Registers the ``fp8`` method and adds its kernels to kvq's built-in backends: the NumPy
reference, and the torch backends where torch is installed (kernels for a backend that is not
registered are skipped and noted by ``kvq list``). Every kernel is a lazy ``"module:Attr"``
reference, so importing this module imports no kernel module and not torch.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvq_core.hookspecs import hookimpl
from kvq_core.contract import MethodInfo
from kvq_fp8.spec import Fp8Spec

TORCH = "kvq_fp8.torch_kernels:Fp8Torch"
KERNELS = {"numpy": "kvq_fp8.numpy_kernels:Fp8Kernels", "torch": TORCH, "torch-compiled": TORCH}


@hookimpl
def kvq_register_methods(register: Callable[[MethodInfo], None]) -> None:
    register(MethodInfo(Fp8Spec.method, Fp8Spec, Fp8Spec.summary))


@hookimpl
def kvq_register_kernels(register: Callable[[str, str, Any], None]) -> None:
    for backend, ref in KERNELS.items():
        register(backend, "fp8", ref)
