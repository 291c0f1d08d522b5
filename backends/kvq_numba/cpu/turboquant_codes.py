"""The Numba CPU encoder of TurboQuant_mse's coordinate codes (kvq_numpy.turboquant); decode and attend
run OCTOPUS's kernels on a coordinate-code table (:mod:`kvq_numba.turboquant`)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu.common import pack_row, sum_squares
from kvq_numba.rules import row_bytes


@njit(parallel=True, cache=True)
def coord_codes(v, n, thresholds, codebook, bits, norm_correction):
    """``(codes uint8 [b, h, t, row_bytes], norm float32 [b, h, t])`` of rotated unit rows ``v``
    [b, h, t, d] with norms ``n``: each coordinate's codebook index (thresholds at or below it),
    packed; the norm divided by ``||c[idx]||`` under ``norm_correction``."""
    nb, nh, nt, d = v.shape
    codes = np.zeros((nb, nh, nt, row_bytes(d, bits)), np.uint8)
    norm = np.empty((nb, nh, nt), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        row = np.empty(d, np.int32)
        c = np.empty(d, np.float32)
        for t in range(nt):
            for j in range(d):
                k = np.searchsorted(thresholds, v[b, h, t, j], side="right")
                row[j] = k
                c[j] = codebook[k]
            pack_row(row, bits, codes[b, h, t])
            norm[b, h, t] = n[b, h, t] / np.sqrt(sum_squares(c, d)) if norm_correction else n[b, h, t]
    return codes, norm
