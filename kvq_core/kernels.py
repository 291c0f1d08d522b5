"""The contract between the core and a backend's kernels for one method.

A backend's kernel table maps a method name to a class called with the method's spec. The
core validates inputs, computes the constants, and hands kernels backend arrays plus a
:class:`KernelContext`; kernels return plain dicts of fields matching the spec's layout.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from kvq_core.spec import MethodSpec


@dataclasses.dataclass(frozen=True)
class KernelContext:
    """What a kernel call needs besides the data: the spec, the layer, the K/V block shape
    ``(batch, kv_heads, tokens, head_dim)`` and the spec's constants (NumPy, read-only)."""

    spec: MethodSpec
    layer: int
    shape: tuple[int, int, int, int]
    consts: dict[str, np.ndarray]


class MethodKernels(Protocol):
    """Kernels of one method on one backend. Arrays are the backend's own type.

    Decoded K/V and attention outputs are float32 in the original (un-rotated) domain;
    ``attend`` returns ``(out [b, q_heads, q_len, d], lse [b, q_heads, q_len])`` where lse is
    the natural-log sum of exp(scaled logits), so partial attentions can be merged.
    """

    def encode_keys(self, k: Any, ctx: KernelContext) -> dict[str, Any]: ...

    def decode_keys(self, fields: dict[str, Any], ctx: KernelContext) -> Any: ...

    def encode_values(self, v: Any, ctx: KernelContext) -> dict[str, Any]: ...

    def decode_values(self, fields: dict[str, Any], ctx: KernelContext) -> Any: ...

    def attend(
        self, q: Any, kfields: dict[str, Any], vfields: dict[str, Any], ctx: KernelContext, scale: float
    ) -> tuple[Any, Any]: ...
