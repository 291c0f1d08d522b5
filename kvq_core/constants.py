"""The constants a kernel needs besides the data (rotations, signs, codebooks), computed once.

``constants(spec, kv_heads, layer)`` is the public accessor every backend uses: a cached,
read-only dict of NumPy arrays from :meth:`MethodSpec.constants`. Kernels hold no constants
of their own.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import numpy as np

from kvq_core.spec import MethodSpec


@functools.lru_cache(maxsize=256)
def constants(spec: MethodSpec, kv_heads: int, layer: int) -> Mapping[str, np.ndarray]:
    """The spec's constants for ``kv_heads`` heads of ``layer`` (cached; arrays read-only)."""
    consts = spec.constants(int(kv_heads), int(layer))
    for arr in consts.values():
        arr.flags.writeable = False
    return consts


class LazyConstants(Mapping):
    """:func:`constants` computed on first access.

    Kernels that take their constants elsewhere (the torch ops fetch them per device) never
    trigger the NumPy computation, so ``torch.compile`` can trace a Quantizer call without
    tracing into NumPy code.
    """

    __slots__ = ("_key", "_data")

    def __init__(self, spec: MethodSpec, kv_heads: int, layer: int) -> None:
        self._key = (spec, kv_heads, layer)
        self._data: Mapping[str, np.ndarray] | None = None

    def _get(self) -> Mapping[str, np.ndarray]:
        if self._data is None:
            self._data = constants(*self._key)
        return self._data

    def __getitem__(self, name: str) -> np.ndarray:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get())
