"""One attention call over a layer's packed blocks and its exact window (``KVQCache``'s decode
step): the paged kernels' job machinery (:mod:`kvq_numba.cpu.page_table`) with several contiguous
blocks as consecutive segments of the coded tokens and the window as the tail.

Request ``b`` is batch element ``b``; its coded tokens are the blocks' tokens in order (every
query sees them all), then the window's ``w`` exact tokens, whose last ``q_len`` are the queries
(causal among them). :func:`plan_segments` cuts each (request, kv head, tile of query rows) into
splits of each block, then one tail job, so a job never straddles two blocks; each block's CODES
kernel runs on its own jobs (:func:`local_jobs`: token range in the block's coordinates, the
others marked :data:`SKIP`); the codes' partial outputs are brought back from the values' domain
(linear, so the unnormalised partials can be), the tail jobs score the window with the original
queries, and one log-sum-exp combine merges everything. No per-block output, no merge in torch.
The int-code kernels run one or two blocks (a KVQCache layer's usual state) through the same steps
compiled into one call (:func:`kvq_numba.cpu.attend_planes.planes_window`).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from numba import njit

from kvq_numba import threads
from kvq_numba.cpu import page_table
from kvq_numba.cpu.page_table import CODES, J_KIND, J_NROWS, J_REQ, J_ROW, J_T0, J_T1, TAIL
from kvq_numba.cpu.tiles import ROWS

#: job kind a CODES kernel skips (a job of another block)
SKIP = 2


@njit(cache=True)
def plan_segments(nreq, lq, g, nhk, starts, tail, split):
    """``(jobs int64 [n, 7], segment int64 [n], groups int64 [tiles + 1])``: per (request, kv head,
    tile of the ``lq * g`` query rows), splits of at most ``split`` tokens of each segment
    ``[starts[s], starts[s + 1])`` of the coded tokens, then the tile's tail job over the window
    tokens it sees (the ``tail`` window's last ``lq`` are the queries); ``segment`` is -1 for tail jobs."""
    rows = lq * g
    nseg = starts.shape[0] - 1
    count, tiles = 0, 0
    for phase in range(2):
        if phase == 1:
            jobs = np.empty((count, 7), np.int64)
            segment = np.empty(count, np.int64)
            groups = np.empty(tiles + 1, np.int64)
            count, tiles = 0, 0
        for req in range(nreq):
            for h in range(nhk):
                for row0 in range(0, rows, ROWS):
                    nrows = min(ROWS, rows - row0)
                    seen = tail - lq + (row0 + nrows - 1) // g + 1  # window tokens the tile's last row sees
                    if phase == 1:
                        groups[tiles] = count
                    tiles += 1
                    for s in range(nseg):
                        for t0 in range(starts[s], starts[s + 1], split):
                            if phase == 1:
                                jobs[count, J_REQ], jobs[count, 1] = req, h
                                jobs[count, J_ROW], jobs[count, J_NROWS] = req * rows + row0, nrows
                                jobs[count, J_T0], jobs[count, J_T1] = t0, min(starts[s + 1], t0 + split)
                                jobs[count, J_KIND], segment[count] = CODES, s
                            count += 1
                    if seen > 0:
                        if phase == 1:
                            jobs[count, J_REQ], jobs[count, 1] = req, h
                            jobs[count, J_ROW], jobs[count, J_NROWS] = req * rows + row0, nrows
                            jobs[count, J_T0], jobs[count, J_T1], jobs[count, J_KIND] = 0, seen, TAIL
                            segment[count] = -1
                        count += 1
        if phase == 1:
            groups[tiles] = count
    return jobs, segment, groups


@njit(cache=True)
def local_jobs(jobs, segment, starts):
    """``out [segments, n, 7]``: segment ``s``'s CODES jobs with their tokens in its own coordinates,
    every other job marked :data:`SKIP`."""
    nseg = starts.shape[0] - 1
    out = np.empty((nseg, jobs.shape[0], 7), np.int64)
    for s in range(nseg):
        for j in range(jobs.shape[0]):
            for c in range(7):
                out[s, j, c] = jobs[j, c]
            if segment[j] == s:
                out[s, j, J_T0] -= starts[s]
                out[s, j, J_T1] -= starts[s]
            else:
                out[s, j, J_KIND] = SKIP
    return out


@njit(cache=True, inline="always")
def group_rows(q, nhk):
    """Compiled :func:`grouped_queries`: queries float32 [b, q_heads, q_len, d] as a new [kv_heads, b * q_len *
    g, d] array."""
    b, hq, lq, d = q.shape
    g = hq // nhk
    qo = np.empty((nhk, b * lq * g, d), np.float32)
    for bi in range(b):
        for h in range(nhk):
            for t in range(lq):
                for gi in range(g):
                    qo[h, (bi * lq + t) * g + gi] = q[bi, h * g + gi, t]
    return qo


@njit(cache=True, inline="always")
def block_plan(b, lq, g, nhk, d, tokens, nseg, w, split):
    """The jobs of one compiled window call over the first ``nseg`` blocks (``tokens[s]`` tokens each) then a
    ``w``-token window (:func:`plan_segments`): ``(coded, jobs, groups, local, first, row_lo, table, pm, pl,
    pacc)``, ``local[s]`` block ``s``'s jobs in its own coordinates, the partials allocated."""
    starts = np.zeros(nseg + 1, np.int64)
    for s in range(nseg):
        starts[s + 1] = starts[s] + tokens[s]
    coded = starts[nseg]
    jobs, segment, groups = plan_segments(b, lq, g, nhk, starts, w, split)
    local = local_jobs(jobs, segment, starts)
    first = np.full(b, coded + w - lq, np.int64)
    row_lo = np.arange(b) * (lq * g)
    table = np.arange(b).reshape(b, 1)
    pm = np.empty((jobs.shape[0], ROWS), np.float32)
    pl = np.empty((jobs.shape[0], ROWS), np.float32)
    pacc = np.empty((jobs.shape[0], ROWS * d), np.float32)
    return coded, jobs, groups, local, first, row_lo, table, pm, pl, pacc


@njit(cache=True, inline="always")
def finish(qo, jobs, groups, first, row_lo, g, chunks, coded, tk, tv, scale, pm, pl, pacc, b, lq):
    """After the CODES jobs of a compiled window call (partials in the original domain): the window's TAIL
    jobs on the original queries ``qo`` (:func:`group_rows`), the combine, and the rows back to ``(out [b,
    q_heads, q_len, d], lse [b, q_heads, q_len])``."""
    nhk, nrow, d = qo.shape
    hq = nhk * g
    page_table.tail_jobs(qo, jobs, first, row_lo, g, chunks, np.full(b, coded, np.int64), tk, tv, np.arange(b), scale, pm,
                    pl, pacc)
    o = np.zeros((nhk, nrow, d), np.float32)
    lo = np.zeros((nhk, nrow), np.float32)
    page_table.combine(jobs, groups, pm, pl, pacc, o, lo)
    out = np.empty((b, hq, lq, d), np.float32)
    lse = np.empty((b, hq, lq), np.float32)
    for bi in range(b):
        for h in range(nhk):
            for t in range(lq):
                for gi in range(g):
                    out[bi, h * g + gi, t] = o[h, (bi * lq + t) * g + gi]
                    lse[bi, h * g + gi, t] = lo[h, (bi * lq + t) * g + gi]
    return out, lse


def grouped_queries(q: np.ndarray, hk: int) -> np.ndarray:
    """Queries float32 [b, q_heads, q_len, d] as [kv_heads, b * q_len * g, d]: rows by request, then
    query token, then the GQA group (the plan's row order)."""
    b, hq, lq, d = q.shape
    g = hq // hk
    return np.ascontiguousarray(q.reshape(b, hk, g, lq, d).transpose(1, 0, 3, 2, 4)).reshape(hk, b * lq * g, d)


def ungrouped(x: np.ndarray, b: int, lq: int, g: int) -> np.ndarray:
    """:func:`grouped_queries`' inverse for outputs ``[hk, rows, d]`` (to ``[b, q_heads, q_len, d]``)
    or log-sum-exps ``[hk, rows]`` (to ``[b, q_heads, q_len]``)."""
    hk = x.shape[0]
    tail = x.shape[2:]
    y = x.reshape(hk, b, lq, g, *tail).transpose(1, 0, 3, 2, *range(4, 4 + len(tail)))
    return np.ascontiguousarray(y).reshape(b, hk * g, lq, *tail)


def split_plan(b: int, lq: int, g: int, nhk: int, coded: int, aligns: Sequence[int]) -> tuple[int, int]:
    """``(split, chunks)`` of a window plan over ``coded`` tokens in blocks whose splits are multiples of
    ``aligns``: on one thread one job per block and tile (splits only pay off spread over threads)."""
    nthreads = threads.count()
    if nthreads == 1:
        return max(coded, 1), page_table.chunks(1)
    align = int(np.lcm.reduce(list(aligns))) if aligns else 1
    return page_table.split_tokens(-(-(lq * g) // ROWS) * b * coded * nhk, align, nthreads), page_table.chunks(nthreads)


def run(q: np.ndarray, qc: np.ndarray, b: int, lq: int, g: int, blocks: Sequence[tuple[page_table.JobsFn, int, int]],
        window: tuple[np.ndarray, np.ndarray], values_back: page_table.BackFn | None,
        scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``(out [kv_heads, rows, d], lse [kv_heads, rows])`` of queries ``q`` [kv_heads, rows, d]
    (:func:`grouped_queries`; ``qc`` the same in the keys' domain) over the ``blocks`` (``(jobs_fn,
    align, tokens)`` each, in token order) then the exact ``window`` (float32 keys and values
    [b, kv_heads, w, d], original domain, ``w >= lq``). ``values_back(pacc, jobs)`` brings the codes' partial
    outputs ``[jobs, ROWS * d]`` from the values' domain to the original one, in place (None: same)."""
    nhk, _, d = q.shape
    tk, tv = window
    w = tk.shape[2]
    starts = np.array([0, *itertools.accumulate(tokens for _, _, tokens in blocks)], np.int64)
    coded = int(starts[-1])
    split, chunks = split_plan(b, lq, g, nhk, coded, [a for _, a, _ in blocks])
    jobs, segment, groups = plan_segments(b, lq, g, nhk, starts, w, split)
    local = local_jobs(jobs, segment, starts) if len(blocks) > 1 else jobs[None]  # one block: its coordinates
    pm = np.empty((jobs.shape[0], ROWS), np.float32)
    pl = np.empty((jobs.shape[0], ROWS), np.float32)
    pacc = np.empty((jobs.shape[0], ROWS * d), np.float32)
    row_lo = np.arange(b, dtype=np.int64) * (lq * g)
    first = np.full(b, coded + w - lq, np.int64)
    table = np.arange(b, dtype=np.int64)[:, None]
    for s, (jobs_fn, _, _) in enumerate(blocks):
        jobs_fn(qc, local[s], first, row_lo, g, table, chunks, pm, pl, pacc)
    if values_back is not None and blocks:
        values_back(pacc, jobs)
    page_table.tail_jobs(q, jobs, first, row_lo, g, chunks, np.full(b, coded, np.int64), tk, tv, np.arange(b, dtype=np.int64),
                        np.float32(scale), pm, pl, pacc)
    out = np.zeros((nhk, q.shape[1], d), np.float32)
    lse = np.zeros((nhk, q.shape[1]), np.float32)
    page_table.combine(jobs, groups, pm, pl, pacc, out, lse)
    return out, lse
