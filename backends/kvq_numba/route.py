"""Device routing of the numba kernel classes, in one place: a kernel call whose data is a CUDA array
(:func:`kvq_numba.arrays.is_cuda_input`: a CUDA tensor, a numba device array) runs on the class's
CUDA twin in :mod:`kvq_numba.gpu`, any other (NumPy, a CPU tensor) on the class's own CPU methods,
which call :mod:`kvq_numba.cpu`.

The twin is built on the first CUDA input, so numba.cuda is imported only then: a CPU quantizer
never loads it. Whether a spec runs on a device at all, and the error when it does not, is settled
before a call reaches a kernel (the backend's ``supports``, :mod:`kvq_numba.plugin`).
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from kvq_core.contract import KernelContext
from kvq_numba.arrays import is_cuda_input

Fields = dict[str, Any]


class DeviceRouted(ABC):
    """Base of the numba kernel classes: the kernel contract's calls, each sent by its data's device
    (the keys, values or queries; a block's first field, as the core checks it) to the CUDA twin
    or to the subclass's ``*_cpu`` method of the same arguments."""

    #: ``"module:Class"`` of the CUDA twin, constructed with the kernel object on the first CUDA input
    CUDA_TWIN: ClassVar[str]
    _twin: Any = None

    def cuda(self) -> Any:
        """The CUDA twin of these kernels (imported, and numba.cuda with it, on first use)."""
        if self._twin is None:
            module, _, name = self.CUDA_TWIN.partition(":")
            self._twin = getattr(importlib.import_module(module), name)(self)
        return self._twin

    def encode_keys(self, k: Any, ctx: KernelContext) -> Fields:
        if is_cuda_input(k):
            return self.cuda().encode_keys(k, ctx)
        return self.encode_keys_cpu(k, ctx)

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> Any:
        if is_cuda_input(next(iter(fields.values()))):
            return self.cuda().decode_keys(fields, ctx)
        return self.decode_keys_cpu(fields, ctx)

    def encode_values(self, v: Any, ctx: KernelContext) -> Fields:
        if is_cuda_input(v):
            return self.cuda().encode_values(v, ctx)
        return self.encode_values_cpu(v, ctx)

    def decode_values(self, fields: Fields, ctx: KernelContext) -> Any:
        if is_cuda_input(next(iter(fields.values()))):
            return self.cuda().decode_values(fields, ctx)
        return self.decode_values_cpu(fields, ctx)

    def attend(self, q: Any, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float) -> tuple[Any, Any]:
        if is_cuda_input(q):
            return self.cuda().attend(q, kfields, vfields, ctx, scale)
        return self.attend_cpu(q, kfields, vfields, ctx, scale)

    def fuses_window(self, q: Any) -> bool:
        """Whether ``attend_window`` runs for queries like ``q``: host queries only (no CUDA twin fuses
        a window), where :meth:`fuses_window_cpu` says so."""
        return not is_cuda_input(q) and self.fuses_window_cpu()

    @abstractmethod
    def encode_keys_cpu(self, k: Any, ctx: KernelContext) -> Fields:
        """``encode_keys`` of host keys (NumPy, a CPU tensor)."""

    @abstractmethod
    def decode_keys_cpu(self, fields: Fields, ctx: KernelContext) -> Any:
        """``decode_keys`` of a host block."""

    @abstractmethod
    def encode_values_cpu(self, v: Any, ctx: KernelContext) -> Fields:
        """``encode_values`` of host values."""

    @abstractmethod
    def decode_values_cpu(self, fields: Fields, ctx: KernelContext) -> Any:
        """``decode_values`` of a host block."""

    @abstractmethod
    def attend_cpu(self, q: Any, kfields: Fields, vfields: Fields, ctx: KernelContext,
                   scale: float) -> tuple[Any, Any]:
        """``attend`` of host queries over host blocks."""

    @abstractmethod
    def fuses_window_cpu(self) -> bool:
        """Whether ``attend_window`` runs for host queries of this spec."""
