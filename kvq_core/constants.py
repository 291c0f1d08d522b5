"""The constants a kernel needs besides the data (rotations, signs, codebooks), computed once.

``constants(spec, kv_heads, layer)`` is the public accessor every backend uses: a cached,
read-only dict of NumPy arrays from :meth:`MethodSpec.constants`. Kernels hold no constants
of their own.

Per-head constants (:data:`PER_HEAD`: rotation signs, Haar rotations, QJL sketches) are drawn per
*global* kv head. A tensor-parallel rank holds a slice of the heads, ``kv_heads`` of them from
``head_offset`` on; ``constants(spec, kv_heads, layer, head_offset)`` gives it those heads' rows,
so its codes equal a single-rank engine's codes for the same heads.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import numpy as np

from kvq_core.errors import SpecError
from kvq_core.spec import MethodSpec


# Constants whose leading axis is the kv head (every method names them so; tests/test_constants.py
# checks that no other constant has a per-head axis).
PER_HEAD = frozenset({"signs", "rotation", "sketch"})


@functools.lru_cache(maxsize=256)
def constants(spec: MethodSpec, kv_heads: int, layer: int, head_offset: int = 0) -> Mapping[str, np.ndarray]:
    """The spec's constants for ``kv_heads`` heads of ``layer`` starting at global head
    ``head_offset`` (cached; arrays read-only)."""
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise SpecError(spec.method, "head_offset", head_offset, "an integer >= 0 (the first global kv head)")
    consts = spec.constants(int(kv_heads) + head_offset, int(layer))
    if head_offset:
        consts = {name: arr[head_offset:].copy() if name in PER_HEAD else arr for name, arr in consts.items()}
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

    def __init__(self, spec: MethodSpec, kv_heads: int, layer: int, head_offset: int = 0) -> None:
        self._key = (spec, kv_heads, layer, head_offset)
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
