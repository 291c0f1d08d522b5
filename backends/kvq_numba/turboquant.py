"""The Numba kernels of TurboQuant_mse (kvq_numpy.turboquant) on OCTOPUS's attend and decode kernels.

Both codecs store per head vector its norm and codes of the rotated unit vector ``v = H diag(s)
x / n`` (the same seeded signed Hadamard), in the rotated domain inside attend. TurboQuant codes
each coordinate with ``b`` bits, packed least significant bit first; three consecutive codes are
then one ``3b``-bit code at bit ``3bj``, exactly where OCTOPUS's triplet ``j`` lies, so
:func:`coord_table` (entry ``i0 | i1 << b | i2 << 2b`` -> ``(c[i0], c[i1], c[i2])``) lets the triplet
decoder, the fused attend (:mod:`kvq_numba.cpu.attend_octopus`) and the window kernel read them
unchanged. Served: Hadamard rotation, one code field (``high_bits_coords=0``), ``3b <= 17``.

Encode repeats the reference's float32 steps (norms in NumPy's pairwise order, the thresholds'
``searchsorted(side="right")``), so codes are bitwise the reference's.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from kvq_core.methods.turboquant import TurboQuantSpec, codebook_key, thresholds_key
from kvq_numba.arrays import as_float32
from kvq_numba.cpu import octopus_codes
from kvq_numba.cpu.common import fwht_heads
from kvq_numba.cpu.turboquant_codes import coord_codes
from kvq_numba.octopus import OctopusNumba

Fields = dict[str, Any]


def coord_table(bits: int, codebook: np.ndarray) -> np.ndarray:
    """float32 [2**(3 bits) * 4]: per ``3 bits``-bit code ``i0 | i1 << bits | i2 << 2 bits`` the
    centroids ``(c[i0], c[i1], c[i2])`` and a zero (OCTOPUS's triplet table layout, octopus_codes.code_table)."""
    code = np.arange(1 << (3 * bits))
    mask = (1 << bits) - 1
    table = np.zeros((code.size, 4), np.float32)
    for k in range(3):
        table[:, k] = codebook[(code >> (k * bits)) & mask]
    return table.reshape(-1)


class TurboQuantNumba(OctopusNumba):
    """TurboQuant_mse keys and values: OCTOPUS's kernels with a coordinate-code table (module docstring)."""

    spec: TurboQuantSpec

    @staticmethod
    def _fp16_values(spec: Any) -> bool:
        return False

    def _books(self, consts: Any) -> tuple[Any, ...]:
        """The "triplet" code width (three coordinate codes) and its table, built once per codebook."""
        book = consts[codebook_key(self.spec.bits)]
        if self._table is None or self._table[0] is not book:
            self._table = (book, coord_table(self.spec.bits, np.asarray(book, np.float32)))
        return 3 * self.spec.bits, self._table[1]

    def _encode(self, x: Any, consts: Any) -> Fields:
        v, n = octopus_codes.signed_units(as_float32(x), np.ascontiguousarray(consts["signs"]))
        fwht_heads(v, v, self.inv_sqrt_d)
        bits = self.spec.bits
        codes, norm = coord_codes(v, n, np.ascontiguousarray(consts[thresholds_key(bits)], np.float32),
                                  np.ascontiguousarray(consts[codebook_key(bits)], np.float32), bits,
                                  self.spec.norm_correction)
        return {"codes": codes, "norm": norm}
