"""Scalar coding rules shared by the CPU (``@njit``) and CUDA (``@cuda.jit``) kernels, written once.

They repeat the reference's float32 operations in its order (kvq_numpy.intquant,
kvq_numpy.octopus). The CPU kernels call them as they are (``register_jitable``), except OCTOPUS's
:func:`triplet_code`, whose float32 steps the CPU runs over a whole row at once, stage by stage
(:func:`kvq_numba.cpu.octopus_codes.code_row`: its per-triplet branches mispredicted; the conformance
suite holds both to the reference's codes bit for bit). The CUDA
kernels call the copies :func:`for_target` makes (``kvq_numba.gpu.common``): the same code
objects with the CUDA target's :func:`rint` (libdevice ``rintf``, a ``cvt.rni`` instruction:
round half to even like ``np.rint``, which numba-cuda does not compile) and each rule calling
the other copies. Only float32 arithmetic, ``min``/``max``/``abs``, ``math.sqrt`` and
:data:`rint` appear here, so each target compiles the same steps.
"""
from __future__ import annotations

import math
import types
from collections.abc import Callable

import numpy as np
from numba.extending import register_jitable

from kvq_core.layout import packed_row_bytes
from kvq_core.math.octahedral import JOINT_NEIGHBOURS

#: zero-point modes: integer (OScaR, QuaRot) and the group minimum (KIVI); kvq_numpy.intquant.
ZERO_INTEGER, ZERO_MIN = 0, 1
#: the joint rounding's (xi, eta) index offsets as a compile-time constant array
NEIGHBOURS = np.array(JOINT_NEIGHBOURS, np.int64)
#: bytes of a packed row of ``count`` codes of ``bits`` (the core's bit rule), callable from ``@njit`` code
row_bytes = register_jitable(packed_row_bytes)
#: round half to even, float32 -> float32 (the CPU target's; for_target swaps in another target's)
rint = np.rint


@register_jitable
def group_params(mn, mx, levels, zero_mode):
    """(scale, zq or 0, offset, varying) of one group from its float32 min and max."""
    if zero_mode == 0 and mn == 0 and mx == 0:
        mn = np.float32(-1)
        mx = np.float32(1)
    if mx > mn:
        s = (mx - mn) / levels
        if zero_mode == 0:
            zq = rint(-mn / s)
            return s, zq, -zq * s, True
        return s, np.float32(0), mn, True
    return np.float32(0), np.float32(0), mn, False


@register_jitable
def int_code(x, s, zq, mn, levels, zero_mode):
    """One code, clipped to [0, levels]: ``rint(x / s + zq)`` or ``rint((x - mn) / s)``."""
    q = rint(x / s + zq) if zero_mode == 0 else rint((x - mn) / s)
    return min(max(q, np.float32(0)), levels)


@register_jitable
def bucket(thresholds, x):
    """Nearest-centroid index: how many thresholds are <= x (searchsorted side="right")."""
    k = 0
    for j in range(thresholds.shape[0]):
        if thresholds[j] <= x:
            k += 1
    return k


@register_jitable
def sgn(x):
    """Sign-not-zero (+1 at 0 and -0.0), float32."""
    return np.float32(1) if x >= 0 else np.float32(-1)


@register_jitable
def triplet_code(x, y, z, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, joint):
    """The code ``(i_xi << (eta_bits + rho_bits)) | (i_eta << rho_bits) | i_rho`` of one triplet."""
    l1 = abs(x) + abs(y) + abs(z)
    if l1 == 0:
        px, py, pz = np.float32(0), np.float32(0), np.float32(1)
    else:
        px, py, pz = x / l1, y / l1, z / l1
    if pz < 0:
        xi = sgn(px) * (np.float32(1) - abs(py))
        eta = sgn(py) * (np.float32(1) - abs(px))
    else:
        xi, eta = px, py
    i_xi = bucket(xi_th, xi)
    i_eta = bucket(eta_th, eta)
    if joint:
        best_s = np.float32(-np.inf)
        bx, be = i_xi, i_eta
        for k in range(NEIGHBOURS.shape[0]):
            cx = min(max(i_xi + NEIGHBOURS[k, 0], 0), n_xi - 1)
            ce = min(max(i_eta + NEIGHBOURS[k, 1], 0), n_eta - 1)
            s = x * dirs[cx * n_eta + ce, 0] + y * dirs[cx * n_eta + ce, 1] + z * dirs[cx * n_eta + ce, 2]
            if s > best_s:
                best_s, bx, be = s, cx, ce
        i_xi, i_eta = bx, be
        i_rho = bucket(rho_th, max(best_s, np.float32(0)))
    else:
        i_rho = bucket(rho_th, np.float32(math.sqrt(x * x + y * y + z * z)))
    return (i_xi << (eta_bits + rho_bits)) | (i_eta << rho_bits) | i_rho


#: the rules for_target rebuilds, callees before their callers
RULES = ("bucket", "sgn", "group_params", "int_code", "triplet_code")


def for_target(jit: Callable[[Callable], Callable], target_rint: Callable) -> dict[str, Callable]:
    """Every rule of :data:`RULES` compiled by ``jit`` (e.g. an inlined CUDA device function), with
    ``target_rint`` for :data:`rint` and the rules they call replaced by these copies: one source,
    no second implementation to keep equal."""
    made: dict[str, Callable] = {}
    for name in RULES:
        fn = globals()[name]
        scope = {**fn.__globals__, "rint": target_rint, **made}
        made[name] = jit(types.FunctionType(fn.__code__, scope, name, fn.__defaults__, fn.__closure__))
    return made
