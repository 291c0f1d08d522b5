"""The two OCP FP8 formats and the exact NumPy rounding to them (the plugin's reference).

- ``e4m3`` is E4M3FN: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; the largest
  finite value is 448 (code 0x7E), 0x7F/0xFF are NaN, the smallest subnormal 2**-9.
- ``e5m2``: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like; largest finite 57344 (code
  0x7B), 0x7C is Inf, the smallest subnormal 2**-16.

Rounding is round-to-nearest, ties to the even code (IEEE round-half-to-even: a code's lowest
bit is its mantissa's lowest bit), with subnormals, and *saturating*: a magnitude past the
largest finite value becomes that value, never Inf or NaN (as vLLM's CUDA conversion does with
``__NV_SATFINITE``). It is written out here rather than taken from ``ml_dtypes`` so the
reference depends on nothing but NumPy; the tests check it against ``ml_dtypes`` and torch.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: field widths, bias and the largest finite code."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_code: int

    def value(self, code: int) -> float:
        """The value of a non-negative finite code (sign bit clear)."""
        e, f = code >> self.mantissa_bits, code & ((1 << self.mantissa_bits) - 1)
        if e == 0:  # subnormal: f * 2**(1 - bias - m)
            return f * 2.0 ** (1 - self.bias - self.mantissa_bits)
        return (1 + f / (1 << self.mantissa_bits)) * 2.0 ** (e - self.bias)

    @functools.cached_property
    def magnitudes(self) -> np.ndarray:
        """float64 values of the codes 0 .. max_code, ascending (every one exact)."""
        return np.array([self.value(c) for c in range(self.max_code + 1)], dtype=np.float64)

    @property
    def max(self) -> float:
        """The largest finite value (448 for e4m3, 57344 for e5m2)."""
        return float(self.magnitudes[-1])

    def encode(self, y: np.ndarray) -> np.ndarray:
        """uint8 codes of ``y`` (finite floats): nearest value, ties to the even code, saturating."""
        y = np.asarray(y)
        a = np.minimum(np.abs(y.astype(np.float64)), self.max)
        mags = self.magnitudes
        hi = np.searchsorted(mags, a, side="left")  # mags[hi - 1] < a <= mags[hi]
        lo = np.maximum(hi - 1, 0)
        below, above = a - mags[lo], mags[hi] - a  # exact in float64
        up = (above < below) | ((above == below) & (hi % 2 == 0))
        code = np.where(up, hi, lo).astype(np.uint8)
        return code | (np.signbit(y).astype(np.uint8) << 7)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """float32 values of codes (the sign bit negates); codes past ``max_code`` (Inf/NaN in
        the format, never produced by :meth:`encode`) decode to NaN."""
        codes = np.asarray(codes, dtype=np.uint8)
        table = np.full(128, np.nan, dtype=np.float32)
        table[: self.max_code + 1] = self.magnitudes
        mags = table[codes & 0x7F]
        return np.where(codes & 0x80, -mags, mags).astype(np.float32)


FORMATS: dict[str, Fp8Format] = {
    "e4m3": Fp8Format("e4m3", exponent_bits=4, mantissa_bits=3, bias=7, max_code=0x7E),
    "e5m2": Fp8Format("e5m2", exponent_bits=5, mantissa_bits=2, bias=15, max_code=0x7B),
}
