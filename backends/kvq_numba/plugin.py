"""Registers the ``numba`` backend: ``@njit`` CPU kernels, and ``numba.cuda`` kernels for CUDA input.

Kernel classes are lazy ``"module:Class"`` references (a failing import makes only that method
unavailable), called directly by the Quantizer on NumPy or torch input like NumPy's
(``torch_ops=False``); its paged classes serve the ``kvq::attend_paged`` / ``kvq::write_paged`` ops.
:func:`supports` says per (spec, device) whether the backend runs it and, if not, why;
:func:`kvq_select_backend` makes ``backend="auto"`` pick numba on the CPU where it supports the method.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from kvq_core.hookspecs import hookimpl
from kvq_core.contract import BackendInfo
from kvq_core.registry import make_spec
from kvq_core.spec import MethodSpec
from kvq_numba.arrays import NumbaArrays

NAME = "numba"

#: method -> "module:Class" of its kernels (CPU and CUDA in one class)
KERNELS: dict[str, str] = {
    "oscar": "kvq_numba.intcodes:IntCodesNumba",
    "kivi": "kvq_numba.intcodes:IntCodesNumba",
    "octopus": "kvq_numba.octopus:OctopusNumba",
    "turboquant": "kvq_numba.turboquant:TurboQuantNumba",
}
#: methods whose ``kvq::attend_paged`` the numba kernels serve (kvq_numba.paged); the others take torch's
PAGED_METHODS = ("oscar", "kivi", "octopus")
#: methods with CUDA kernels, and the largest head_dim their shared rows hold (gpu.common.MAX_D)
CUDA_METHODS = ("oscar", "octopus")
CUDA_MAX_HEAD_DIM = 256
#: widest OCTOPUS triplet code the kernels read (three bytes from any bit offset)
MAX_TRIPLET_BITS = 17


def _device_kind(device: str | None) -> str:
    return "cpu" if device is None else str(device).split(":")[0]


@functools.lru_cache(maxsize=1)
def _cuda_status() -> tuple[bool, str | None]:
    try:
        from numba import cuda

        if cuda.is_available():
            return True, None
        return False, "numba.cuda finds no CUDA driver/GPU (set NUMBA_ENABLE_CUDASIM=1 for the simulator)"
    except Exception as exc:  # pragma: no cover - broken numba-cuda install
        return False, f"numba.cuda failed: {type(exc).__name__}: {exc}"


def supports(spec: MethodSpec, device: str | None) -> tuple[bool, str | None]:
    """(ok, reason): whether the numba backend runs ``spec`` on ``device`` ("cpu"/None, "cuda[:i]")."""
    kind = _device_kind(device)
    if spec.method not in KERNELS:
        return False, f"numba has no kernels for method {spec.method!r}; it implements {', '.join(sorted(KERNELS))}"
    gap = spec.power_of_two_gap()
    if gap:
        return False, f"numba's kernels take the power-of-two layout only: {gap}"
    if spec.method == "octopus" and spec.triplet_bits > MAX_TRIPLET_BITS:
        return False, (f"numba reads a triplet code from 3 bytes: triplet bits (xi+eta+rho) up to {MAX_TRIPLET_BITS}, "
                       f"not {spec.triplet_bits}")
    if spec.method == "turboquant":
        if spec.rotation != "hadamard" or spec.high_bits_coords:
            return False, (f"numba's TurboQuant kernels take the Hadamard rotation and one code field (high_bits_coords=0), "
                           f"not rotation={spec.rotation!r}, high_bits_coords={spec.high_bits_coords}")
        if 3 * spec.bits > MAX_TRIPLET_BITS:
            return False, (f"numba reads three TurboQuant coordinate codes as one from 3 bytes: bits up to "
                           f"{MAX_TRIPLET_BITS // 3}, not {spec.bits}")
    if kind == "cpu":
        return True, None
    if kind != "cuda":
        return False, f"numba runs on cpu and cuda devices, not {device!r}"
    if spec.method not in CUDA_METHODS:
        return False, f"numba has CUDA kernels for {', '.join(CUDA_METHODS)} only, not {spec.method!r}"
    if spec.method == "oscar" and spec.bits not in (2, 4, 8):
        return False, f"numba's CUDA OScaR kernels take bits 2, 4 or 8, not {spec.bits}"
    if spec.head_dim > CUDA_MAX_HEAD_DIM or spec.head_dim % 4:
        return False, (f"numba's CUDA kernels take head_dim a multiple of 4 up to {CUDA_MAX_HEAD_DIM} "
                       f"(shared-memory rows), not {spec.head_dim}")
    return _cuda_status()


def _available() -> tuple[bool, str | None]:
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        return False, f"numba is not installed: {exc}"
    return True, None


#: ``kvq::attend_paged`` (CPU: the same kernels through the page table; other specs and CUDA: torch's)
PAGED = "kvq_numba.paged:PagedNumba"
#: ``kvq::write_paged`` (CPU: the numba encoders, rows written straight into the pages; else torch's)
PAGED_WRITE = "kvq_numba.paged_write:PagedWriteNumba"


@hookimpl
def kvq_register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(BackendInfo(NAME, KERNELS, NumbaArrays(), _available, supports=supports,
                         summary="Numba: @njit CPU kernels; numba.cuda kernels for CUDA input",
                         paged={method: PAGED for method in PAGED_METHODS},
                         paged_write={method: PAGED_WRITE for method in PAGED_METHODS},
                         compiled="kvq_numba.cache_stamp:NumbaCompileCache"))


@hookimpl
def kvq_select_backend(method: str, device: str | None, candidates: list[str]) -> str | None:
    """``backend="auto"`` for CPU tensors (device "cpu": e.g. ``KVQCache`` on the CPU) picks numba
    when it supports the method; NumPy arrays (device None) keep the reference."""
    if NAME not in candidates or device is None or _device_kind(device) != "cpu":
        return None
    ok, _ = supports(make_spec(method), device)
    return NAME if ok else None
