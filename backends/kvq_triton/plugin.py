"""Registers the ``triton`` backend through kvq's hooks.

The kernel table maps each method to a lazy ``"module:Class"`` string (a
:class:`kvq_torch.common.TorchMethod` subclass), so a method whose module fails to import is
the only one unavailable, and this plugin imports neither Triton nor the kernels until a
quantizer is built: ``kvq list`` shows ``triton`` with the reason it cannot run here.

Where the kernels run: CUDA tensors on an NVIDIA GPU, or CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set before kvq is imported), which is how CI tests them.
"""
from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

from kvq_core.errors import BackendUnavailableError, InputError
from kvq_core.hookspecs import hookimpl
from kvq_core.kernels import KernelContext
from kvq_core.registry import BackendInfo
from kvq_core.spec import MethodSpec

NAME = "triton"

#: method -> "module:Class" of its Triton kernels (a TorchMethod subclass).
KERNELS: dict[str, str] = {
    "kivi": "kvq_triton.kivi:KiviTriton",
    "octopus": "kvq_triton.octopus:OctopusTriton",
    "oscar": "kvq_triton.oscar:OscarTriton",
    "turboquant": "kvq_triton.turboquant:TurboQuantTriton",
}

#: Largest head_dim one program holds in registers.
MAX_HEAD_DIM = 256


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def _triton_import() -> str | None:
    """None when Triton imports, else why not."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # noqa: BLE001 - any failure makes the backend unavailable, with the reason
        return f"triton is not installed or fails to import ({type(exc).__name__}: {exc}); pip install -e '.[triton]'"
    return None


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
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
    if spec.head_dim > MAX_HEAD_DIM:
        return f"head_dim={spec.head_dim} (the Triton kernels hold a head in registers: head_dim <= {MAX_HEAD_DIM})"
    if spec.method == "turboquant" and spec.high_bits_coords:
        return f"turboquant high_bits_coords={spec.high_bits_coords} (the Triton kernels store one code field: 0 only)"
    return None


def supports(spec: MethodSpec, device: str | None) -> tuple[bool, str | None]:
    """(ok, reason): can the ``triton`` backend serve ``spec`` on ``device`` (a torch device
    string, or None for NumPy input)? The reason names the method, parameter or device."""
    if spec.method not in KERNELS:
        return False, f"method {spec.method!r} has no Triton kernels (Triton implements {', '.join(sorted(KERNELS))})"
    limit = _method_limits(spec)
    if limit:
        return False, limit
    kind = "cpu" if device is None else str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        return False, f"device {device!r} (Triton kernels run on 'cuda', or on 'cpu' under TRITON_INTERPRET=1)"
    ok, why = is_available()
    if not ok:
        return False, why
    if kind == "cuda":
        if interpreting():
            return False, "device 'cuda' while TRITON_INTERPRET=1 (the interpreter runs on CPU tensors)"
        return (True, None) if _cuda() else (False, "device 'cuda' but torch sees no CUDA device")
    return (True, None) if interpreting() else (False, "device 'cpu' needs TRITON_INTERPRET=1 (Triton's CPU interpreter)")


class TritonArrays:
    """Torch tensors as they are; NumPy arrays become tensors on the device the kernels run on
    (CUDA, or the CPU under the interpreter)."""

    def __init__(self) -> None:
        from kvq_torch.arrays import TorchArrays

        self._torch = TorchArrays()

    def asarray(self, x: Any) -> Any:
        t = self._torch.asarray(x)
        if t.device.type == "cpu" and not interpreting() and _cuda():
            return t.cuda()
        return t

    def to_numpy(self, x: Any) -> Any:
        return self._torch.to_numpy(x)

    def all_finite(self, x: Any) -> bool:
        return self._torch.all_finite(x)

    def concat(self, xs: list[Any], axis: int) -> Any:
        return self._torch.concat([self.asarray(x) for x in xs], axis)

    def cast(self, x: Any, dtype: str) -> Any:
        return self._torch.cast(x, dtype)


class TritonKernels:
    """The core's :class:`~kvq_core.kernels.MethodKernels` for one method: adapts a
    :class:`KernelContext` to the torch kernels' ``TorchContext`` (constants as tensors on the
    data's device) and refuses tensors on a device the kernels cannot run on."""

    def __init__(self, target: str, spec: MethodSpec) -> None:
        module, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except Exception as exc:  # noqa: BLE001 - only this method becomes unavailable
            raise BackendUnavailableError(
                f"triton kernels of {spec.method!r} failed to import ({target}): {type(exc).__name__}: {exc}") from exc
        ok, why = supports(spec, None if interpreting() else "cuda")
        if not ok:
            raise BackendUnavailableError(f"backend 'triton' cannot serve {spec.describe()}: {why}")
        self.spec = spec
        self.spec_json = spec.to_json()
        self.impl = cls(spec)

    def _ctx(self, ctx: KernelContext, x: Any) -> Any:
        from kvq_torch.common import TorchContext, consts_for

        device = x.device
        if (device.type == "cpu") != interpreting():
            raise InputError(f"backend 'triton' got a tensor on {device}; expected "
                             f"{'cpu (TRITON_INTERPRET=1)' if interpreting() else 'cuda'}")
        return TorchContext(ctx.spec, ctx.layer, ctx.shape, consts_for(self.spec_json, ctx.shape[1], ctx.layer, device))

    def encode_keys(self, k: Any, ctx: KernelContext) -> dict[str, Any]:
        return self.impl.encode_keys(k, self._ctx(ctx, k))

    def decode_keys(self, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return self.impl.decode_keys(fields, self._ctx(ctx, next(iter(fields.values()))))

    def encode_values(self, v: Any, ctx: KernelContext) -> dict[str, Any]:
        return self.impl.encode_values(v, self._ctx(ctx, v))

    def decode_values(self, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return self.impl.decode_values(fields, self._ctx(ctx, next(iter(fields.values()))))

    def attend(self, q: Any, kfields: dict[str, Any], vfields: dict[str, Any], ctx: KernelContext, scale: float):
        return self.impl.attend(q, kfields, vfields, self._ctx(ctx, q), scale)


class TritonBackendInfo(BackendInfo):
    """BackendInfo plus the ``supports(spec, device)`` check the new dispatch contract asks for."""

    def supports(self, spec: MethodSpec, device: str | None) -> tuple[bool, str | None]:
        return supports(spec, device)


def _table() -> dict[str, Callable[[MethodSpec], Any]]:
    return {method: functools.partial(TritonKernels, target) for method, target in KERNELS.items()}


@hookimpl
def kvq_register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(TritonBackendInfo(NAME, _table(), TritonArrays(), is_available,
                               summary="Triton GPU kernels: packed encode/decode, fused split-KV decode attention "
                                       "(CUDA; CPU under TRITON_INTERPRET=1)"))


@hookimpl
def kvq_select_backend(method: str, device: str | None, candidates: list[str]) -> str | None:
    """``backend="auto"`` on a CUDA device picks Triton when it implements the method."""
    if device is not None and str(device).startswith("cuda") and NAME in candidates:
        return NAME
    return None
