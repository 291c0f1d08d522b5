"""Fused Numba CPU decode attention over OCTOPUS triplet codes.

Per (batch, KV head, tile of four query rows): each block of :data:`BLOCK` key rows is decoded
to rotated unit vectors (:func:`kvq_numba.cpu.octopus_codes.decode_rows_at`: one table move per triplet)
and scored by the register tiles of :mod:`kvq_numba.cpu.tiles` (``logit = gamma_t <q, v_hat_t> *
scale``); online softmax; the value rows (``gamma * v_hat`` in the rotated domain, or float16
rows in the original domain) are decoded the same way and weighted in registers. On AVX-512 hosts
(:data:`WIDE`) both in 16-lane tiles instead (:func:`~kvq_numba.cpu.tiles.logits16`,
:func:`~kvq_numba.cpu.tiles.weighted_rows16`): half the
multiply-adds, and the logits' dot products reduced sixteen at a time. Rows past the query count in
the last tile are zeros; their results are dropped. Decoded blocks stay in L1.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from kvq_numba.cpu import page_table
from kvq_numba.cpu.attend import online_softmax
from kvq_numba.cpu.attend_planes import wide_keys
from kvq_numba.cpu.common import fwht_block, half_to_float
from kvq_numba.cpu.octopus_codes import SPILL, decode_rows_at
from kvq_numba.cpu.page_table import (CODES, DESC, J_HEAD, J_KIND, J_NROWS, J_REQ, J_T0, J_T1, WIDTH, half_at,
                                 mask_block, start_job, store_partial, token_rows)
from kvq_numba.cpu.simd import prefetch_bytes
from kvq_numba.cpu.tiles import ROWS, logits, logits16, weighted_rows, weighted_rows16
from kvq_numba.cpu.window import block_plan, finish, group_rows

#: tokens per online-softmax block (two decoded [BLOCK, d] blocks stay in L1 at d = 128; a multiple of 4)
BLOCK = 32
#: logits and ``P @ V`` in 16-lane tiles (:mod:`kvq_numba.cpu.tiles`) where ``d`` is a multiple
#: of 32: this host has AVX-512 (on AVX2 the tiles' sixteen accumulators would be 32 registers and spill)
WIDE = wide_keys()


#: fields of an OCTOPUS job, in the order of the buffers and descriptor rows (kvq_numba.cpu.page_table)
F_KC, F_KN, F_VC, F_VN, F_VH = range(5)


@njit(cache=True, inline="always")
def _floats(buf, words, addr, n, scratch, out) -> None:
    """``out[i]`` = the float32 at byte ``addr[i]`` (``i < n``): read in place from ``words`` (``buf``'s whole
    4-byte words as float32, a view the caller takes once) when the values follow one another on word
    boundaries (contiguous blocks), else byte by byte (page rows)."""
    if addr[n - 1] - addr[0] == (n - 1) * 4 and addr[0] & 3 == 0:
        w0 = addr[0] >> 2
        for i in range(n):
            out[i] = words[w0 + i]
    else:
        view = scratch.view(np.float32)
        for i in range(n):
            for x in range(4):
                scratch[x] = buf[addr[i] + x]
            out[i] = view[0]


@njit(parallel=True, fastmath=True, cache=True)
def octopus_jobs_at(q, jobs, first, row_lo, g, table, chunks, kc, kn, vc, vn, vh, desc, values_fp16, bits, code_table,
                    scale, pm, pl, pacc, wide) -> None:
    """The CODES jobs of a plan (:func:`kvq_numba.cpu.page_table.plan`): partial softmax state of rotated
    queries ``q`` [kv_heads, rows, d] over OCTOPUS codes, causal per row, fields read through
    ``table`` and ``desc`` (one row per buffer: key codes, key norm, value codes, value norm,
    float16 values). Values: ``gamma * v_hat`` (rotated domain) or, when ``values_fp16``, the
    float16 rows (original domain). The jobs run as ``chunks`` interleaved chunks, each allocating its
    scratch once (:func:`kvq_numba.cpu.attend_planes.planes_jobs`). ``wide``: the 16-lane tiles where ``d`` is a
    multiple of 32 (:data:`WIDE`; an argument, so that both widths run on any host)."""
    nhk, nrow, d = q.shape
    krb = desc[F_KC, WIDTH]
    vrb = desc[F_VC, WIDTH]
    wide = wide and d % 32 == 0
    nch = max(1, min(chunks, jobs.shape[0]))
    for ch in prange(nch):
        lim = np.empty(ROWS, np.int64)
        qf = np.empty(ROWS * d, np.float32)
        m = np.empty(ROWS, np.float32)
        l = np.empty(ROWS, np.float32)
        acc = np.empty(ROWS * d, np.float32)
        no_vbias = np.zeros((ROWS, 0), np.float32)
        kflat = np.empty(BLOCK * d + SPILL, np.float32)  # decoded rows, flat
        vflat = np.empty(BLOCK * d + SPILL, np.float32)
        p = np.zeros((ROWS, BLOCK), np.float32)
        pw = np.empty(ROWS * BLOCK, np.float32)
        tok = np.zeros(BLOCK, np.float32)  # finite past a block's tokens (:func:`_logits16` reads them)
        vgam = np.empty(BLOCK, np.float32)
        ebits = np.empty(ROWS * BLOCK, np.int32)
        ka = np.empty(BLOCK, np.int64)
        va = np.empty(BLOCK, np.int64)
        na = np.empty(BLOCK, np.int64)
        nb4 = np.empty(4, np.uint8)
        # views taken once per chunk: each costs an atomic reference-count pair where a loop takes it
        pf = p.reshape(ROWS * BLOCK)
        knw = kn[:kn.shape[0] - kn.shape[0] % 4].view(np.float32)
        vnw = vn[:vn.shape[0] - vn.shape[0] % 4].view(np.float32)
        dkc, dkn, dvc, dvn, dvh = desc[F_KC], desc[F_KN], desc[F_VC], desc[F_VN], desc[F_VH]
        for job in range(ch, jobs.shape[0], nch):
            if jobs[job, J_KIND] != CODES:
                continue
            req, h, nr = jobs[job, J_REQ], jobs[job, J_HEAD], jobs[job, J_NROWS]
            start_job(q, jobs, job, first, row_lo, g, lim, qf, m, l, acc)
            acc2 = acc[:nr * d].reshape((nr, d))  # the softmax state of the real rows only
            for t0 in range(jobs[job, J_T0], jobs[job, J_T1], BLOCK):
                n = min(BLOCK, jobs[job, J_T1] - t0)
                token_rows(table, req, h, t0, n, dkc, ka)
                token_rows(table, req, h, t0, n, dkn, na)
                ahead = t0 + BLOCK < jobs[job, J_T1]  # prefetch the next block's rows where they follow on
                if ahead:
                    prefetch_bytes(kc, ka[n - 1] + krb, n * krb)
                    prefetch_bytes(kn, na[n - 1] + 4, n * 4)
                _floats(kn, knw, na, n, nb4, tok)
                for i in range(n):
                    tok[i] *= scale
                decode_rows_at(kc, ka, n, krb, bits, code_table, kflat, d)
                if wide:
                    logits16(qf, kflat, d, n, tok, pf, BLOCK, nr)
                else:
                    logits(qf, kflat, d, n, tok, p, nr)
                mask_block(p, n, t0, lim)
                online_softmax(p, n, m, l, acc2, no_vbias, ebits)
                if values_fp16:
                    token_rows(table, req, h, t0, n, dvh, va)
                    if ahead:
                        prefetch_bytes(vh, va[n - 1] + 2 * d, n * 2 * d)
                    for i in range(n):
                        for c in range(d):
                            vflat[i * d + c] = half_to_float(half_at(vh, va[i] + 2 * c))
                        vgam[i] = 1
                else:
                    token_rows(table, req, h, t0, n, dvc, va)
                    token_rows(table, req, h, t0, n, dvn, na)
                    if ahead:
                        prefetch_bytes(vc, va[n - 1] + vrb, n * vrb)
                        prefetch_bytes(vn, na[n - 1] + 4, n * 4)
                    _floats(vn, vnw, na, n, nb4, vgam)
                    decode_rows_at(vc, va, n, vrb, bits, code_table, vflat, d)
                for r in range(nr):
                    for i in range(n):
                        pw[r * BLOCK + i] = p[r, i] * vgam[i]
                if wide:
                    weighted_rows16(pw, BLOCK, vflat, d, n, acc, nr)
                else:
                    weighted_rows(pw, BLOCK, vflat, d, n, acc, nr)
            store_partial(job, m, l, acc, pm, pl, pacc)


#: most blocks :func:`octopus_window` takes (a sliding-flush layer holds 2-3: kvq_core.integrations.hf.flush.JOIN_RATIO)
WINDOW_BLOCKS = 3


@njit(cache=True)
def octopus_window(q, tk, tv, signs, inv_sqrt_d, bufs, desc, tokens, nseg, values_fp16, bits, code_table, scale, split,
                   chunks, wide):
    """``(out [b, q_heads, q_len, d], lse [b, q_heads, q_len])``: a decode step over the first ``nseg`` (at most
    :data:`WINDOW_BLOCKS`) contiguous OCTOPUS blocks then the exact window ``tk`` / ``tv`` float32 [b, kv_heads,
    w, d], in one compiled call: what :func:`kvq_numba.cpu.window.run` does with :func:`octopus_jobs_at` (queries
    grouped and rotated into the keys' domain, ``H diag(s_h) q``; the codes' partials brought back, ``diag(s_h)
    H``, unless the values are float16 rows; the window's jobs; one combine) without its Python steps and
    their kernel launches. Block ``s`` has ``tokens[s]`` tokens, its five field buffers in ``bufs[s]`` and its
    descriptor rows in ``desc[s]`` (:func:`contiguous_block`); ``signs`` float32 [kv_heads, d]. ``wide``: the
    16-lane tiles (:data:`WIDE` on this host), an argument as in :func:`contiguous_jobs`, so both share one
    compiled :func:`octopus_jobs_at` (a constant here would type as a literal and compile it a second time)."""
    b, hq, lq, d = q.shape
    nhk, w = tk.shape[1], tk.shape[2]
    g = hq // nhk
    qo = group_rows(q, nhk)
    qc = np.empty_like(qo)
    for h in range(nhk):
        for r in range(qo.shape[1]):
            for c in range(d):
                qc[h, r, c] = qo[h, r, c] * signs[h, c]
    fwht_block(qc.reshape(nhk * qo.shape[1], d), qc.reshape(nhk * qo.shape[1], d), inv_sqrt_d)
    coded, jobs, groups, local, first, row_lo, table, pm, pl, pacc = block_plan(b, lq, g, nhk, d, tokens, nseg, w, split)
    for s in range(nseg):
        kc, kn, vc, vn, vh = bufs[s]
        octopus_jobs_at(qc, local[s], first, row_lo, g, table, chunks, kc, kn, vc, vn, vh, desc[s], values_fp16, bits,
                        code_table, scale, pm, pl, pacc, wide)
    if not values_fp16:  # partials from the values' domain back to the original one (linear)
        flat = pacc.reshape(jobs.shape[0] * ROWS, d)
        fwht_block(flat, flat, inv_sqrt_d)
        for j in range(jobs.shape[0]):
            h = jobs[j, J_HEAD]
            for r in range(ROWS):
                for c in range(d):
                    pacc[j, r * d + c] *= signs[h, c]
    return finish(qo, jobs, groups, first, row_lo, g, chunks, coded, tk, tv, scale, pm, pl, pacc, b, lq)


def contiguous_block(kcodes, kgamma, vcodes, vgamma, vhalf, values_fp16):
    """``(buffers, desc)``: one contiguous block's five field buffers (flat bytes, no copy) and their descriptor
    rows, as :func:`octopus_jobs_at` reads them (the trivial page table: request ``b`` is batch element ``b``)."""
    desc = _contiguous_desc(kcodes.shape[1], kcodes.shape[2], kcodes.shape[3], vcodes.shape[3], vhalf.shape[3],
                            bool(values_fp16))
    return (_bytes(kcodes), _bytes(kgamma), _bytes(vcodes), _bytes(vgamma), _bytes(vhalf)), desc


@functools.lru_cache(maxsize=256)
def _contiguous_desc(nhk: int, nt: int, krb: int, vrb: int, d: int, values_fp16: bool) -> np.ndarray:
    """The descriptor rows of a contiguous block of these shapes, shared by every block of them (never written;
    a sliding flush makes new blocks every decode step)."""
    desc = np.zeros((5, DESC), np.int64)
    #        rows per block, block stride, head stride, row stride, offset, width, group rows
    desc[F_KC] = (nt, nhk * nt * krb, nt * krb, krb, 0, krb, 1)
    desc[F_KN] = (nt, nhk * nt * 4, nt * 4, 4, 0, 4, 1)
    if values_fp16:
        desc[F_VH] = (nt, nhk * nt * 2 * d, nt * 2 * d, 2 * d, 0, 2 * d, 1)
    else:
        desc[F_VC] = (nt, nhk * nt * vrb, nt * vrb, vrb, 0, vrb, 1)
        desc[F_VN] = desc[F_KN]
    return desc


def contiguous_jobs(kcodes, kgamma, vcodes, vgamma, vhalf, values_fp16, bits, table, scale):
    """``(jobs_fn, align)``: :func:`octopus_jobs_at` over one contiguous block (:func:`contiguous_block`), for
    :func:`kvq_numba.cpu.page_table.run` and its kin, at the width :data:`WIDE` holds when it runs."""
    bufs, desc = contiguous_block(kcodes, kgamma, vcodes, vgamma, vhalf, values_fp16)
    scale = np.float32(scale)

    def jobs_fn(qh, jobs, first, row_lo, g, tab, chunks, pm, pl, pacc):  # noqa: ANN001, ANN202
        octopus_jobs_at(qh, jobs, first, row_lo, g, tab, chunks, *bufs, desc, values_fp16, bits, table, scale, pm, pl,
                        pacc, WIDE)
    return jobs_fn, BLOCK


def attend_octopus(q, kcodes, kgamma, vcodes, vgamma, vhalf, values_fp16, bits, table, scale):
    """OCTOPUS attention of rotated queries ``q`` float32 [b, hk, rows, d] over triplet codes: the
    contiguous blocks as the trivial page table of :func:`octopus_jobs_at`.

    Values: ``vgamma * v_hat`` (rotated domain; the caller un-rotates the output) or, when
    ``values_fp16``, the float16 rows ``vhalf`` (uint16 bits [b, hk, t, d], original domain).
    Returns (out float32 [b, hk, rows, d], lse float32 [b, hk, rows]).
    """
    return page_table.run_trivial(q, kcodes.shape[2], *contiguous_jobs(
        kcodes, kgamma, vcodes, vgamma, vhalf, values_fp16, bits, table, scale))


def _bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, flat (no copy)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
