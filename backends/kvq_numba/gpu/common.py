"""numba.cuda building blocks of the CUDA kernels: device-array plumbing and per-block helpers.

Kernels follow real CUDA rules: one block of :data:`THREADS` threads per row (or per query row),
fixed-size shared and local arrays (rows up to :data:`MAX_D` channels; their sizes are module
constants, which numba-cuda takes as literals, never expressions), ``syncthreads`` reached by
every thread of the block. Device functions are inlined into their kernels
(:data:`device_function`). Importing this module imports numba.cuda (after the NumPy 2.5 shim of
:mod:`kvq_numba.gpu.compat`); nothing here runs at import.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import config, cuda

from kvq_numba import rules
from kvq_numba.gpu.compat import import_array_overloads

import_array_overloads()

#: threads per block (one warp); threads stride over channels
THREADS = 32
#: largest head_dim the shared arrays hold
MAX_D = 256
#: channels each thread of a row accumulates (local array size)
SLOTS = MAX_D // THREADS
#: a shared row padded to whole OCTOPUS triplets
ROW_PAD = MAX_D + 3

#: Device functions are inlined at Numba IR level: numba-cuda compiles a called (not inlined)
#: device function for the current GPU's compute capability, which needs a GPU, so only inlined
#: helpers let ``numba.cuda.compile_ptx`` build every kernel for any target without one (the
#: compile gate, tests/test_numba_ptx.py).
device_function = cuda.jit(device=True, inline="always")

if config.ENABLE_CUDASIM:  # the simulator runs device code as Python: NumPy's rint
    rint = device_function(lambda x: np.rint(x))
else:
    @device_function
    def rint(x):
        """Round half to even, float32 (libdevice ``rintf``: PTX ``cvt.rni.f32.f32``)."""
        return cuda.libdevice.rintf(x)

#: the CUDA target's copies of the shared coding rules (kvq_numba.rules)
_RULES = rules.for_target(device_function, rint)
group_params = _RULES["group_params"]
int_code = _RULES["int_code"]
triplet_code = _RULES["triplet_code"]


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


@device_function
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


@device_function
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


@device_function
def online_update(m, l, z):
    """Online softmax with a new logit ``z``: returns (new max, new sum, rescale of old acc, weight)."""
    mx = max(m, z)
    corr = math.exp(m - mx)
    w = math.exp(z - mx)
    return mx, l * corr + w, corr, w
