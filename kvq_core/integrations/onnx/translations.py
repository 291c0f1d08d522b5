"""The onnxscript translations kvq's ONNX graphs need besides torchlib's (one place, one table).

- **Unsigned shifts.** torchlib (onnxscript 0.7.2, ``aten_bitwise_right_shift`` /
  ``aten_bitwise_left_shift``) casts the result of every ``>>`` and ``<<`` to the *signed* type of
  the same width, so ``uint8 >> 4`` comes out int8 and the unpacking of kvq's uint8 code rows
  (a BitwiseOr/Concat of uint8 and "int8" halves) fails to load in onnxruntime
  (shared/specs/platform.md section 4). Unsigned operands get a plain ``BitShift`` here (the
  type stays unsigned); signed ones keep torchlib's translation (arithmetic right shift).
- **kvq::materialize**, the layout barrier some torch kernels use under tracing, is an
  ``Identity``: ONNX has no memory layout, so no ``kvq::`` node is left opaque.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from onnxscript import ir
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import core as torchlib

import kvq_core.torch_ops.ops  # noqa: F401  (defines torch.ops.kvq.*)

UNSIGNED = frozenset({ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64})


def _shift(direction: str, signed: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A translation of ``self << other`` / ``self >> other`` that keeps an unsigned type unsigned."""

    def translate(self: Any, other: Any) -> Any:
        if isinstance(other, int):
            other = op.Constant(value=ir.tensor(other, dtype=self.dtype))
        if self.dtype in UNSIGNED:
            return op.BitShift(self, op.CastLike(other, self), direction=direction)
        return signed(self, other)

    return translate


def _identity(x: Any) -> Any:
    return op.Identity(x)


_right = _shift("RIGHT", torchlib.aten_bitwise_right_shift)
_left = _shift("LEFT", torchlib.aten_bitwise_left_shift)

aten = torch.ops.aten
#: ``custom_translation_table`` of every kvq ONNX export.
TRANSLATIONS: dict[Any, Callable[..., Any]] = {
    aten.__rshift__.Scalar: _right,
    aten.__rshift__.Tensor: _right,
    aten.bitwise_right_shift.Tensor: _right,
    aten.bitwise_right_shift.Tensor_Scalar: _right,
    aten.__lshift__.Scalar: _left,
    aten.__lshift__.Tensor: _left,
    aten.bitwise_left_shift.Tensor: _left,
    aten.bitwise_left_shift.Tensor_Scalar: _left,
    torch.ops.kvq.materialize.default: _identity,
}
