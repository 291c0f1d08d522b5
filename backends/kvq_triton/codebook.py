"""Codebook codes in Triton: nearest-centroid indices by threshold counting (``np.searchsorted(
thresholds, x, side="right")``) for TurboQuant's per-coordinate codebook, and OCTOPUS's triplet
encoder (octahedral map, xi/eta/rho codebooks, plain or joint 3x3 rounding). Codes go to an
int32 scratch and are packed by :func:`kvq_triton.packing.pack_rows`; decoding is
:func:`kvq_triton.tiles.decode`.

The float32 arithmetic follows the reference op for op (three-term sums left to right,
correctly rounded division and square root); kernels launch without FMA contraction so a GPU
rounds as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_triton import config
from kvq_triton.packing import pack_rows


@triton.jit
def searchsorted(x, thresholds, N: tl.constexpr):
    """Index of the centroid nearest to ``x``: the count of the ``N`` sorted thresholds <= x.
    ``N`` is a compile-time bound: a run-time one is a tensor, which the interpreter of Triton
    < 3.9 cannot take as a loop bound on NumPy >= 2.5."""
    idx = tl.zeros(x.shape, tl.int32)
    for k in range(N):
        idx += (x >= tl.load(thresholds + k)).to(tl.int32)
    return idx


@triton.jit
def _coordinate_kernel(v_ptr, codes_ptr, norm_ptr, rows, thresholds, centroids, N_THRESHOLDS: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, RB: tl.constexpr, NORM_CORRECTION: tl.constexpr):
    r1 = tl.program_id(0) * RB + tl.arange(0, RB)
    r = r1[:, None]
    d = tl.arange(0, DP)[None, :]
    ok = (r < rows) & (d < D)
    at = r.to(tl.int64) * D + d
    idx = searchsorted(tl.load(v_ptr + at, mask=ok, other=0.0), thresholds, N_THRESHOLDS)
    tl.store(codes_ptr + at, idx, mask=ok)
    if NORM_CORRECTION:
        c = tl.where(ok, tl.load(centroids + idx, mask=ok, other=0.0), 0.0)
        n = tl.load(norm_ptr + r1, mask=r1 < rows, other=1.0)
        tl.store(norm_ptr + r1, tl.math.div_rn(n, tl.math.sqrt_rn(tl.sum(c * c, axis=1))), mask=r1 < rows)


def coordinate_codes(v: torch.Tensor, norm: torch.Tensor, bits: int, thresholds: torch.Tensor,
                     centroids: torch.Tensor, norm_correction: bool) -> dict[str, torch.Tensor]:
    """Fields ``codes`` (packed) and ``norm`` of rotated unit vectors ``v [b, h, t, d]`` with norms
    ``norm [b, h, t]``; with ``norm_correction`` the norm is divided by ||c[idx]||."""
    v = v.to(torch.float32).contiguous()
    d = v.shape[-1]
    rows = v.numel() // d
    codes = torch.empty(v.shape, dtype=torch.int32, device=v.device)
    norm = norm.to(torch.float32).contiguous().clone()
    if rows:
        dp = max(16, triton.next_power_of_2(d))
        rb = max(1, config.tile() // dp)
        _coordinate_kernel[(triton.cdiv(rows, rb),)](
            v, codes, norm, rows, thresholds.contiguous(), centroids.contiguous(), N_THRESHOLDS=thresholds.numel(),
            D=d, DP=dp, RB=rb, NORM_CORRECTION=norm_correction, enable_fp_fusion=False)
    return {"codes": pack_rows(codes, bits), "norm": norm}


@triton.jit
def _sgn(x):
    """Sign-not-zero: +1 where x >= 0 (also -0.0), else -1."""
    return tl.where(x >= 0, 1.0, -1.0)


@triton.jit
def _dot3(t0, t1, t2, directions, index):
    """<t, directions[index]> as (t0 d0 + t1 d1) + t2 d2."""
    d0 = tl.load(directions + index * 3)
    d1 = tl.load(directions + index * 3 + 1)
    d2 = tl.load(directions + index * 3 + 2)
    return (t0 * d0 + t1 * d1) + t2 * d2


@triton.jit
def _triplet_kernel(v_ptr, codes_ptr, rows, n_triplets, xi_thr, eta_thr, rho_thr, directions,
                    N_XI: tl.constexpr, N_ETA: tl.constexpr, N_RHO: tl.constexpr,
                    D: tl.constexpr, TP: tl.constexpr, RB: tl.constexpr, RHO_BITS: tl.constexpr, JOINT: tl.constexpr):
    r = tl.program_id(0) * RB + tl.arange(0, RB)[:, None]
    i = tl.arange(0, TP)[None, :]
    ok = (r < rows) & (i < n_triplets)
    base = v_ptr + r.to(tl.int64) * D + 3 * i
    t0 = tl.load(base, mask=ok & (3 * i < D), other=0.0)
    t1 = tl.load(base + 1, mask=ok & (3 * i + 1 < D), other=0.0)
    t2 = tl.load(base + 2, mask=ok & (3 * i + 2 < D), other=0.0)
    # octahedral map (kvq_core.math.octahedral.oct_encode); zero maps like (0, 0, 1)
    l1 = (tl.abs(t0) + tl.abs(t1)) + tl.abs(t2)
    zero = l1 == 0.0
    den = tl.where(zero, 1.0, l1)
    px = tl.math.div_rn(tl.where(zero, 0.0, t0), den)
    py = tl.math.div_rn(tl.where(zero, 0.0, t1), den)
    pz = tl.math.div_rn(tl.where(zero, 1.0, t2), den)
    lower = pz < 0
    xi = tl.where(lower, _sgn(px) * (1 - tl.abs(py)), px)
    eta = tl.where(lower, _sgn(py) * (1 - tl.abs(px)), py)
    i_xi = searchsorted(xi, xi_thr, N_XI)
    i_eta = searchsorted(eta, eta_thr, N_ETA)
    k_xi = N_XI + 1
    k_eta = N_ETA + 1
    if JOINT:  # spec 1.8: the 3x3 neighbour maximising <t, n_hat> (centre first, first maximum kept)
        best = i_xi * k_eta + i_eta
        best_s = _dot3(t0, t1, t2, directions, best)
        for a in tl.static_range(3):
            for b in tl.static_range(3):
                if a * 3 + b != 4:
                    c = tl.minimum(tl.maximum(i_xi + (a - 1), 0), k_xi - 1) * k_eta \
                        + tl.minimum(tl.maximum(i_eta + (b - 1), 0), k_eta - 1)
                    s = _dot3(t0, t1, t2, directions, c)
                    take = s > best_s
                    best = tl.where(take, c, best)
                    best_s = tl.where(take, s, best_s)
        i_rho = searchsorted(tl.maximum(best_s, 0.0), rho_thr, N_RHO)
    else:
        best = i_xi * k_eta + i_eta
        i_rho = searchsorted(tl.math.sqrt_rn((t0 * t0 + t1 * t1) + t2 * t2), rho_thr, N_RHO)
    tl.store(codes_ptr + r.to(tl.int64) * n_triplets + i, (best << RHO_BITS) | i_rho, mask=ok)


def triplet_codes(v: torch.Tensor, bits: int, n_triplets: int, rho_bits: int, joint: bool,
                  consts) -> torch.Tensor:
    """Packed OCTOPUS codes ``[b, h, t, nbytes]`` of rotated unit vectors ``v [b, h, t, d]``."""
    v = v.to(torch.float32).contiguous()
    d = v.shape[-1]
    rows = v.numel() // d
    codes = torch.empty((*v.shape[:-1], n_triplets), dtype=torch.int32, device=v.device)
    if rows:
        tp = triton.next_power_of_2(n_triplets)
        rb = max(1, config.tile() // (4 * tp))
        _triplet_kernel[(triton.cdiv(rows, rb),)](
            v, codes, rows, n_triplets, consts["xi_thresholds"], consts["eta_thresholds"], consts["rho_thresholds"],
            consts["directions"].contiguous(),
            N_XI=consts["xi_thresholds"].numel(), N_ETA=consts["eta_thresholds"].numel(),
            N_RHO=consts["rho_thresholds"].numel(), D=d, TP=tp, RB=rb, RHO_BITS=rho_bits, JOINT=joint,
            enable_fp_fusion=False)
    return pack_rows(codes, bits)
