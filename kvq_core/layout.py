"""The one packed layout: named fields with dtypes and shapes, sub-byte codes in uint8 rows.

Bit order (the rule every backend follows): a code field holds ``count`` unsigned codes of
``bits`` bits per row (the last axis). The row is a little-endian bitstream: code ``i``
occupies stream bits ``[i*bits, (i+1)*bits)``, least significant bit first, and stream bit
``j`` is bit ``j % 8`` of byte ``j // 8``. Each row is padded with zero bits to whole bytes.
Those padding bits are stored, so they are counted in :func:`kvq_core.packed.bits_per_element`.

The block that holds such fields is :class:`kvq_core.packed.PackedKV`; joining and splitting
blocks along tokens is :mod:`kvq_core.tokens`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvq_core.errors import LayoutError

if TYPE_CHECKING:  # pragma: no cover
    from kvq_core.spec import MethodSpec

Kind = Literal["keys", "values"]

#: the dtypes a float field (scales, zero-points, norms) may store
FLOAT_DTYPES = ("float16", "float32")


@dataclasses.dataclass(frozen=True)
class Field:
    """One stored array: its name, stored dtype and stored shape.

    For a code field ``bits`` and ``count`` give the codes per row; the stored array is
    ``uint8`` of shape ``(*lead, ceil(count * bits / 8))``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    bits: int | None = None
    count: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def is_codes(self) -> bool:
        return self.bits is not None


def codes_field(name: str, lead: tuple[int, ...], count: int, bits: int) -> Field:
    """A field of ``count`` codes of ``bits`` bits per row, rows indexed by ``lead``."""
    if not 1 <= bits <= 32:
        raise LayoutError(f"field {name}: bits={bits} is outside 1..32")
    return Field(name, "uint8", (*lead, packed_row_bytes(count, bits)), bits=bits, count=count)


def float_field(name: str, shape: tuple[int, ...], dtype: str = "float16") -> Field:
    """A field of plain floats (scales, zero-points, norms)."""
    if dtype not in FLOAT_DTYPES:
        raise LayoutError(f"field {name}: dtype {dtype!r} is not one of {FLOAT_DTYPES}")
    return Field(name, dtype, tuple(shape))


Layout = Mapping[str, Field]


def make_layout(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


def packed_row_bytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes ``(..., count)`` into uint8 rows ``(..., ceil(count*bits/8))``."""
    codes = np.asarray(codes)
    count = codes.shape[-1]
    c = codes.astype(np.uint64)
    stream = ((c[..., None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    stream = stream.reshape(*codes.shape[:-1], count * bits)
    pad = packed_row_bytes(count, bits) * 8 - count * bits
    if pad:
        stream = np.concatenate([stream, np.zeros((*codes.shape[:-1], pad), np.uint8)], axis=-1)
    return np.packbits(stream, axis=-1, bitorder="little")


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: uint8 rows to codes ``(..., count)`` as int64."""
    packed = np.asarray(packed, dtype=np.uint8)
    stream = np.unpackbits(packed, axis=-1, bitorder="little")[..., : count * bits]
    stream = stream.reshape(*packed.shape[:-1], count, bits).astype(np.int64)
    return (stream << np.arange(bits, dtype=np.int64)).sum(axis=-1)


@functools.lru_cache(maxsize=512)
def _cached_layout(spec: "MethodSpec", kind: str, batch: int, kv_heads: int, tokens: int) -> Mapping[str, Field]:
    make = spec.key_layout if kind == "keys" else spec.value_layout
    return types.MappingProxyType(dict(make(batch, kv_heads, tokens)))


def block_layout(spec: "MethodSpec", kind: str, batch: Any, kv_heads: Any, tokens: Any) -> Mapping[str, Field]:
    """The layout of a ``kind`` block (read-only), cached per (spec, kind, batch, kv_heads, tokens)
    for plain integer sizes (symbolic sizes under torch.compile are laid out afresh)."""
    if type(batch) is int and type(kv_heads) is int and type(tokens) is int:
        return _cached_layout(spec, kind, batch, kv_heads, tokens)
    make = spec.key_layout if kind == "keys" else spec.value_layout
    return dict(make(batch, kv_heads, tokens))


@functools.lru_cache(maxsize=512)
def _cached_nbytes(spec: "MethodSpec", kind: str, batch: int, kv_heads: int, tokens: int) -> int:
    return sum(f.nbytes for f in _cached_layout(spec, kind, batch, kv_heads, tokens).values())


def block_nbytes(spec: "MethodSpec", kind: str, batch: Any, kv_heads: Any, tokens: Any) -> int:
    """Bytes a ``kind`` block of these sizes stores (every field, padding included), cached as
    :func:`block_layout` is: a cache layer counts every block it stores and frees."""
    if type(batch) is int and type(kv_heads) is int and type(tokens) is int:
        return _cached_nbytes(spec, kind, batch, kv_heads, tokens)
    return sum(f.nbytes for f in block_layout(spec, kind, batch, kv_heads, tokens).values())
