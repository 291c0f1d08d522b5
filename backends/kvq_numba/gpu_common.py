"""numba.cuda building blocks of the CUDA kernels: device-array plumbing and per-block helpers.

(The CUDA modules are named ``gpu_*``: numba-cuda's import redirector matches any module name
containing "numba.cuda", so ``kvq_numba.cuda_*`` would recurse in its finder.)

Kernels follow real CUDA rules: one block of :data:`THREADS` threads per row (or per query row),
fixed-size shared arrays (rows up to :data:`MAX_D` channels), ``syncthreads`` reached by every
thread of the block. Importing this module imports numba.cuda; nothing here runs at import.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

#: threads per block (one warp); threads stride over channels
THREADS = 32
#: largest head_dim the shared arrays hold
MAX_D = 256


def device(x: Any) -> Any:
    """A C-contiguous numba device array for a CUDA input (numba device array, CUDA tensor, ...)."""
    a = x if cuda.devicearray.is_cuda_ndarray(x) else cuda.as_cuda_array(x)
    if not a.is_c_contiguous():
        a = cuda.to_device(np.ascontiguousarray(a.copy_to_host()))
    return a


@cuda.jit
def _to_float32(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = np.float32(x[i])


def as_float32(x: Any) -> Any:
    """A float32 device copy (or the array itself when already float32), same shape."""
    a = device(x)
    if a.dtype == np.float32:
        return a
    flat = a.reshape(a.size)
    out = cuda.device_array(a.size, np.float32)
    _to_float32[math.ceil(a.size / 128), 128](flat, out)
    return out.reshape(a.shape)


@cuda.jit(device=True)
def block_sum(sh, tid, value):
    """Sum of ``value`` over the block's THREADS threads (every thread gets it); ``sh`` shared [THREADS]."""
    sh[tid] = value
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if tid < step:
            sh[tid] += sh[tid + step]
        cuda.syncthreads()
        step //= 2
    total = sh[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def fwht_shared(row, d, tid, inv_sqrt_d):
    """In place ``row[:d] <- row[:d] H`` for a shared row, the reference's butterfly order."""
    h = 1
    while h < d:
        for k in range(tid, d // 2, THREADS):
            j = (k // h) * 2 * h + (k % h)
            a = row[j]
            b = row[j + h]
            row[j] = a + b
            row[j + h] = a - b
        cuda.syncthreads()
        h *= 2
    for c in range(tid, d, THREADS):
        row[c] *= inv_sqrt_d
    cuda.syncthreads()


@cuda.jit
def rotate_rows(x, signs, use_signs, inv_sqrt_d, out):
    """``out[row] = (signs[h] * x[row]) H`` (or ``x[row] H``), one block per row of [b, h, n, d]."""
    row = cuda.shared.array(MAX_D, np.float32)
    nb, nh, nt, d = x.shape
    bid = cuda.blockIdx.x
    b, h, t = bid // (nh * nt), (bid // nt) % nh, bid % nt
    tid = cuda.threadIdx.x
    for c in range(tid, d, THREADS):
        row[c] = signs[h, c] * x[b, h, t, c] if use_signs else x[b, h, t, c]
    cuda.syncthreads()
    fwht_shared(row, d, tid, inv_sqrt_d)
    for c in range(tid, d, THREADS):
        out[b, h, t, c] = row[c]


@cuda.jit
def unrotate_rows(y, signs, use_signs, inv_sqrt_d, out):
    """``out[row] = signs[h] * (y[row] H)`` (or ``y[row] H``), one block per row of [b, h, n, d]."""
    row = cuda.shared.array(MAX_D, np.float32)
    nb, nh, nt, d = y.shape
    bid = cuda.blockIdx.x
    b, h, t = bid // (nh * nt), (bid // nt) % nh, bid % nt
    tid = cuda.threadIdx.x
    for c in range(tid, d, THREADS):
        row[c] = y[b, h, t, c]
    cuda.syncthreads()
    fwht_shared(row, d, tid, inv_sqrt_d)
    for c in range(tid, d, THREADS):
        out[b, h, t, c] = signs[h, c] * row[c] if use_signs else row[c]


def rotate(x: Any, signs: Any, inv_sqrt_d: np.float32, inverse: bool = False) -> Any:
    """Rows of device float32 ``x`` [b, h, n, d] times H (after ``diag(signs)``, or before it when
    ``inverse``); ``signs`` None for the plain Hadamard."""
    nb, nh, nt, d = x.shape
    out = cuda.device_array(x.shape, np.float32)
    use = signs is not None
    s = cuda.to_device(np.ascontiguousarray(signs, np.float32) if use else np.ones((nh, d), np.float32))
    kernel = unrotate_rows if inverse else rotate_rows
    kernel[nb * nh * nt, THREADS](x, s, use, inv_sqrt_d, out)
    return out


@cuda.jit(device=True)
def online_update(m, l, z):
    """Online softmax with a new logit ``z``: returns (new max, new sum, rescale of old acc, weight)."""
    mx = max(m, z)
    corr = math.exp(m - mx)
    w = math.exp(z - mx)
    return mx, l * corr + w, corr, w
