"""Scalar and row helpers shared by the Numba CPU kernels: float16 bits, bit (un)packing, the FWHT.

Numba has no float16 on the CPU, so stored float16 fields travel as their uint16 bit patterns and
are widened here exactly. Code rows follow kvq_core.layout's rule (little-endian bitstream, LSB
first, zero padding to whole bytes). The FWHT repeats kvq_core.math.hadamard.fwht's float32
butterflies in the same order, so a rotation is bitwise the reference's.
"""
from __future__ import annotations

import numpy as np
from numba import njit

#: 2**(e - 25) for float16 exponent field e (e = 0: subnormals, scale 2**-24), as float32.
_POW2 = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf], dtype=np.float32)
_F16, _U16 = np.dtype(np.float16), np.dtype(np.uint16)


@njit(inline="always", cache=True)
def half_to_float(h: np.uint16) -> np.float32:
    """The float32 value of float16 bits ``h`` (exact; NaN payloads become Inf)."""
    u = np.int32(h)
    e = (u >> 10) & 0x1F
    m = u & 0x3FF
    if e != 0:
        m |= 0x400
    v = np.float32(m) * _POW2[e]
    return -v if u & 0x8000 else v


@njit(inline="always", cache=True)
def _sum_squares_block(a, lo, n) -> np.float32:
    """NumPy's pairwise-sum leaf (n <= 128) over ``a[lo:lo+n] ** 2``: 8 running sums, then the rest."""
    if n < 8:
        res = np.float32(0)
        for i in range(n):
            res += a[lo + i] * a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo] * a[lo], a[lo + 1] * a[lo + 1], a[lo + 2] * a[lo + 2], a[lo + 3] * a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4] * a[lo + 4], a[lo + 5] * a[lo + 5], a[lo + 6] * a[lo + 6], a[lo + 7] * a[lo + 7]
    i = 8
    while i < n - (n % 8):
        j = lo + i
        r0 += a[j] * a[j]
        r1 += a[j + 1] * a[j + 1]
        r2 += a[j + 2] * a[j + 2]
        r3 += a[j + 3] * a[j + 3]
        r4 += a[j + 4] * a[j + 4]
        r5 += a[j + 5] * a[j + 5]
        r6 += a[j + 6] * a[j + 6]
        r7 += a[j + 7] * a[j + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i] * a[lo + i]
        i += 1
    return res


@njit(cache=True)
def sum_squares(a, n) -> np.float32:
    """``sum(a[:n] ** 2)`` in float32 in NumPy's pairwise order (leaves of up to 128, halves
    rounded to multiples of 8 above), so norms are bitwise the reference's ``np.linalg.norm`` /
    ``np.square(x).sum(dtype=float32)`` and codes near boundaries decide alike.

    The halving recursion runs on explicit stacks (numba's cache rejects recursive functions).
    """
    if n <= 128:
        return _sum_squares_block(a, 0, n)
    todo_lo = np.empty(64, np.int64)
    todo_n = np.empty(64, np.int64)
    todo_join = np.empty(64, np.bool_)
    vals = np.empty(64, np.float32)
    top, nvals = 0, 0
    todo_lo[0], todo_n[0], todo_join[0] = 0, n, False
    top = 1
    while top > 0:
        top -= 1
        lo, m, join = todo_lo[top], todo_n[top], todo_join[top]
        if join:
            nvals -= 1
            vals[nvals - 1] = vals[nvals - 1] + vals[nvals]
        elif m <= 128:
            vals[nvals] = _sum_squares_block(a, lo, m)
            nvals += 1
        else:
            m2 = m // 2
            m2 -= m2 % 8
            todo_lo[top], todo_n[top], todo_join[top] = lo, m, True
            todo_lo[top + 1], todo_n[top + 1], todo_join[top + 1] = lo + m2, m - m2, False
            todo_lo[top + 2], todo_n[top + 2], todo_join[top + 2] = lo, m2, False
            top += 3
    return vals[0]


def half_bits(a: np.ndarray) -> np.ndarray:
    """A float16 array as its contiguous uint16 bit patterns (no copy when already contiguous)."""
    if a.dtype is _F16:  # NumPy's native float16 descriptor: the stored fields' (4 per attend call)
        return np.ascontiguousarray(a).view(_U16)
    return np.ascontiguousarray(a, dtype=np.float16).view(np.uint16)


@njit(inline="always", cache=True)
def pack_row(codes, bits, out) -> None:
    """Pack unsigned ``codes`` (uint8, < 2**bits) into the uint8 row ``out`` (layout rule)."""
    count = codes.shape[0]
    if bits == 2 and count % 4 == 0:
        for j in range(count // 4):
            out[j] = codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) | (codes[4 * j + 3] << 6)
    elif bits == 4 and count % 2 == 0:
        for j in range(count // 2):
            out[j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    elif bits == 8:
        for j in range(count):
            out[j] = codes[j]
    else:
        acc = np.uint32(0)
        nacc = 0
        j = 0
        for i in range(count):
            acc |= np.uint32(codes[i]) << np.uint32(nacc)
            nacc += bits
            while nacc >= 8:
                out[j] = np.uint8(acc & np.uint32(0xFF))
                acc >>= np.uint32(8)
                nacc -= 8
                j += 1
        if nacc > 0:
            out[j] = np.uint8(acc & np.uint32(0xFF))


@njit(inline="always", cache=True)
def unpack_rows(codes, t0, n, bits, count, out) -> None:
    """Unpack rows ``t0 .. t0+n`` of the uint8 code rows ``codes`` [rows, row_bytes] into
    ``out[0 .. n]`` [>= n, count] (float32 or int): ``count`` codes of ``bits`` bits per row.
    Both arrays C-contiguous.

    The 2-, 4- and 8-bit paths (rows of whole bytes) run one loop over all the block's bytes
    (flat views): per-row loops of d/4 bytes were too short to vectorise well (4x slower at d=64).
    """
    if bits == 2 and count % 4 == 0:
        c1 = codes[t0:t0 + n].reshape(n * (count // 4))
        o1 = out[:n].reshape(n * count)
        for j in range(n * (count // 4)):
            b = np.int32(c1[j])
            o1[4 * j] = b & 3
            o1[4 * j + 1] = (b >> 2) & 3
            o1[4 * j + 2] = (b >> 4) & 3
            o1[4 * j + 3] = (b >> 6) & 3
    elif bits == 4 and count % 2 == 0:
        c1 = codes[t0:t0 + n].reshape(n * (count // 2))
        o1 = out[:n].reshape(n * count)
        for j in range(n * (count // 2)):
            b = np.int32(c1[j])
            o1[2 * j] = b & 15
            o1[2 * j + 1] = b >> 4
    elif bits == 8:
        c1 = codes[t0:t0 + n].reshape(n * count)
        o1 = out[:n].reshape(n * count)
        for j in range(n * count):
            o1[j] = c1[j]
    else:
        mask = np.uint32((1 << bits) - 1)
        for i in range(n):
            acc = np.uint32(0)
            nacc = 0
            j = 0
            for c in range(count):
                while nacc < bits:
                    acc |= np.uint32(codes[t0 + i, j]) << np.uint32(nacc)
                    nacc += 8
                    j += 1
                out[i, c] = acc & mask
                acc >>= np.uint32(bits)
                nacc -= bits


#: rows transformed together by :func:`fwht_block`
FWHT_ROWS = 32


@njit(cache=True)
def fwht_block(x, y, inv_sqrt_d) -> None:
    """``y = x H`` (orthonormal Sylvester) for the rows of 2-D float32 ``x`` [n, d] (``y`` may be ``x``).

    Blocks of :data:`FWHT_ROWS` rows are transposed to [d, rows] so every butterfly is a vector
    operation across rows, from one scratch block into the other, on row views indexed from 0. The
    row count is a run-time value (``min(FWHT_ROWS, n)``): a compile-time constant lets LLVM unroll
    the row loop instead of vectorising it, and computed offsets get numba's negative-index fix-up;
    either made this 2-3x slower. Each element sees the reference's float32 operations in its
    order (``a + b``, ``a - b`` per stage, then ``* inv_sqrt_d``), so the result is bitwise the same.
    """
    n, d = x.shape
    rows = min(FWHT_ROWS, n)
    ta = np.empty((d, rows), np.float32)
    tb = np.empty((d, rows), np.float32)
    for t0 in range(0, n, rows):
        m = min(rows, n - t0)
        for i in range(m):
            xr = x[t0 + i]
            for c in range(d):
                ta[c, i] = xr[c]
        src, dst = ta, tb
        h = 1
        while h < d:
            for base in range(0, d, 2 * h):
                for j in range(base, base + h):
                    sa = src[j]
                    sb = src[j + h]
                    da = dst[j]
                    db = dst[j + h]
                    for i in range(rows):
                        da[i] = sa[i] + sb[i]
                    for i in range(rows):
                        db[i] = sa[i] - sb[i]
            src, dst = dst, src
            h *= 2
        for i in range(m):
            yr = y[t0 + i]
            for c in range(d):
                yr[c] = src[c, i] * inv_sqrt_d


def fwht_heads(x: np.ndarray, y: np.ndarray, inv_sqrt_d: np.float32) -> np.ndarray:
    """``y[b, h] = x[b, h] H`` for every [t, d] slab of C-contiguous float32 arrays [b, h, t, d]
    (``y`` may be ``x``); returns ``y``.

    :func:`fwht_block` is called from Python (once for contiguous arrays, else once per slab) on purpose: compiled into an ``@njit``
    caller, LLVM inlines it and its vector loops ran about 2x slower.
    """
    if x.flags.c_contiguous and y.flags.c_contiguous:  # rows are independent: one call for all of them
        d = x.shape[-1]
        fwht_block(x.reshape(-1, d), y.reshape(-1, d), inv_sqrt_d)
        return y
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            fwht_block(x[b, h], y[b, h], inv_sqrt_d)
    return y


def inv_sqrt(d: int) -> np.float32:
    """``float32(1/sqrt(d))``, the factor the reference FWHT scales by."""
    return np.float32(1.0 / np.sqrt(d))
