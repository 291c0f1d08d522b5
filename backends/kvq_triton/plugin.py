"""Registers the ``triton`` backend through kvq's hooks.

Like the torch backends (``BackendInfo.torch_ops``), every kernel call is one ``kvq::`` op
carrying the backend name (:mod:`kvq_core.torch_ops`); this plugin only registers its kernel table
(lazy ``"module:Class"`` references to :class:`kvq_torch.common.TorchMethod` subclasses, so a
method whose module fails to import is the only one unavailable) and answers ``supports(spec, device)``. Neither Triton
nor the kernels are imported until a kernel runs: ``kvq list`` shows ``triton`` with the reason
it cannot run here.

Where the kernels run: CUDA tensors on an NVIDIA GPU, or CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set before kvq is imported), which is how CI tests them.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from kvq_core.hookspecs import hookimpl
from kvq_core.contract import BackendInfo
from kvq_core.registry import install_hint
from kvq_core.spec import MethodSpec
from kvq_triton.env import interpreting

NAME = "triton"

#: method -> "module:Class" of its Triton kernels (a TorchMethod subclass).
KERNELS: dict[str, str] = {
    "kivi": "kvq_triton.intcodes:IntCodesTriton",
    "octopus": "kvq_triton.octopus:OctopusTriton",
    "oscar": "kvq_triton.intcodes:IntCodesTriton",
    "turboquant": "kvq_triton.turboquant:TurboQuantTriton",
}

#: Largest head_dim one program holds in registers.
MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=1)
def _triton_import() -> str | None:
    """None when Triton imports, else why not."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # noqa: BLE001 - any failure makes the backend unavailable, with the reason
        return f"triton is not installed or fails to import ({type(exc).__name__}: {exc}); install it with {install_hint('triton')}"
    return None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def is_available() -> tuple[bool, str | None]:
    """Triton imports, and either a CUDA device is present or the interpreter is on."""
    missing = _triton_import()
    if missing:
        return False, missing
    if interpreting() or _cuda():
        return True, None
    return False, ("no CUDA device and TRITON_INTERPRET is unset (set TRITON_INTERPRET=1 before importing kvq "
                   "to run the Triton kernels in the CPU interpreter)")


def _method_limits(spec: MethodSpec) -> str | None:
    """Why the kernels cannot serve this spec's parameters, or None."""
    gap = spec.power_of_two_gap()
    if gap:
        return f"the Triton kernels take the power-of-two layout only (tl.arange sizes): {gap}"
    if spec.head_dim > MAX_HEAD_DIM:
        return f"head_dim={spec.head_dim} (the Triton kernels hold a head in registers: head_dim <= {MAX_HEAD_DIM})"
    if spec.method == "turboquant" and spec.high_bits_coords:
        return f"turboquant high_bits_coords={spec.high_bits_coords} (the Triton kernels store one code field: 0 only)"
    return None


def supports(spec: MethodSpec, device: str | None) -> tuple[bool, str | None]:
    """(ok, reason): can the ``triton`` backend serve ``spec`` on ``device`` (a device type, or
    None for NumPy input, which :class:`kvq_triton.arrays.TritonArrays` places where the kernels run)? The reason
    names the method, parameter or device."""
    if spec.method not in KERNELS:
        return False, f"method {spec.method!r} has no Triton kernels (Triton implements {', '.join(sorted(KERNELS))})"
    limit = _method_limits(spec)
    if limit:
        return False, limit
    kind = None if device is None else str(device).split(":")[0]
    if kind not in (None, "cpu", "cuda"):
        return False, f"device {device!r} (Triton kernels run on 'cuda', or on 'cpu' under TRITON_INTERPRET=1)"
    ok, why = is_available()
    if not ok:
        return False, why
    if kind == "cuda" and interpreting():
        return False, "device 'cuda' while TRITON_INTERPRET=1 (the interpreter runs on CPU tensors)"
    if kind == "cuda" and not _cuda():
        return False, "device 'cuda' but torch sees no CUDA device"
    if kind == "cpu" and not interpreting():
        return False, "device 'cpu' needs TRITON_INTERPRET=1 (Triton's CPU interpreter)"
    return True, None


#: ``kvq::attend_paged`` (oscar, kivi, octopus in Triton; other specs: torch's fallback)
PAGED = "kvq_triton.paged:PagedTriton"


@hookimpl
def kvq_register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(BackendInfo(NAME, KERNELS, "kvq_triton.arrays:TritonArrays", is_available,
                         summary="Triton GPU kernels: packed encode/decode, fused split-KV decode attention over a "
                                 "block or a layer's blocks and exact window (CUDA; CPU under TRITON_INTERPRET=1)",
                         supports=supports, torch_ops=True, paged={method: PAGED for method in KERNELS}))


@hookimpl
def kvq_select_backend(method: str, device: str | None, candidates: list[str]) -> str | None:
    """``backend="auto"`` on a CUDA device picks Triton when it can serve the method."""
    if device is not None and str(device).startswith("cuda") and NAME in candidates:
        return NAME
    return None
