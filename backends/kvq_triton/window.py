"""``kvq::attend_window`` in Triton: a layer's packed blocks and its exact window in one online softmax.

One program per (batch x KV head, tile of query rows, split) scores the rows against the tiles of
every packed block, rebuilt in registers from the codes by :func:`kvq_triton.attention._attend_block`
(the one-block kernel's step: :func:`kvq_triton.tiles.tile` and the per-token scale), then against
the full-precision window tokens, causal among the last ``q_len`` of them (query ``i`` sees the
window up to ``w - q_len + i``). The blocks arrive through a table of int64 rows, one per block
(:data:`COLUMNS`: the addresses of its fields, its token count, its first tile, its stats length), so
a layer's O(log n) blocks are read where they lie: no concatenation, no decoded K/V in global
memory, no per-block outputs to merge. The tiles, every block's then the window's, are dealt to
splits that fill the GPU; with one split the kernel writes ``out`` and ``lse`` itself, else
:func:`kvq_triton.attention._combine_kernel` merges the splits by log-sum-exp (two launches).

Queries and window arrive in the codes' domain (the method's rotation, applied by the host) and
outputs leave in the values' domain: :class:`kvq_triton.method.TritonMethod` does both.
Every method of the Triton backend is served (the blocks are stored as :mod:`kvq_triton.tiles` reads them).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvq_triton.attention import _attend_block, _combine_kernel, precision, split_start, stored_constexprs, tile_sizes
from kvq_triton.config import INTERPRETER
from kvq_triton.tiles import Stored, kernel_args

#: One table row per block: the addresses of its keys' and values' (codes, aux0, aux1, token
#: scale) as :func:`kvq_triton.tiles.kernel_args` gives them, its tokens, the index of its first
#: tile among all blocks' tiles, and the stats lengths of its keys and values.
COLUMNS = ("k_codes", "k_aux0", "k_aux1", "k_scale", "v_codes", "v_aux0", "v_aux1", "v_scale",
           "tokens", "first_tile", "k_nstat", "v_nstat")
WIDTH = len(COLUMNS)
_ROW = tl.constexpr(WIDTH)  # the kernels' copy (a global a kernel reads must be a constexpr)


@triton.jit
def _fields(row_ptr, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """The (codes, aux0, aux1, token scale) pointers at ``row_ptr``, typed for a stored ``KIND``:
    float16 codes for DENSE, float16 scale/offset for the integer kinds, float32 constants else.
    ``ALIGNED``: the codes start on 16 bytes (as a kernel argument would be specialised), so rows
    of whole 16-byte multiples load as vectors."""
    if KIND == 4:
        codes = tl.load(row_ptr).to(tl.pointer_type(tl.float16))
    else:
        codes = tl.load(row_ptr).to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        codes = tl.multiple_of(codes, 16)
    if KIND <= 1:
        aux0 = tl.load(row_ptr + 1).to(tl.pointer_type(tl.float16))
        aux1 = tl.load(row_ptr + 2).to(tl.pointer_type(tl.float16))
    else:
        aux0 = tl.load(row_ptr + 1).to(tl.pointer_type(tl.float32))
        aux1 = tl.load(row_ptr + 2).to(tl.pointer_type(tl.float32))
    return codes, aux0, aux1, tl.load(row_ptr + 3).to(tl.pointer_type(tl.float32))


@triton.jit
def _window_block(q, m_i, l_i, acc, n0, bh, rows, d, wk, wv, W, LQ, scale,
                  D: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    """The online-softmax step over window tokens ``n0 .. n0 + BN``, causal: row ``r`` (query
    ``r % LQ``) sees tokens ``<= W - LQ + r % LQ``. A row that sees none of them yet keeps
    (-inf, 0, 0) (a split holding only later window tiles)."""
    t = n0 + tl.arange(0, BN)
    t_ok = t < W
    at = (bh.to(tl.int64) * W + t[:, None]) * D + d
    ok = t_ok[:, None] & (d < D)
    k = tl.load(wk + at, mask=ok, other=0.0)
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    seen = t_ok[None, :] & (t[None, :] <= (W - LQ + rows % LQ)[:, None])
    logits = tl.where(seen, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(wv + at, mask=ok, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _window_kernel(
    q_ptr, table, n_blocks, wk, wv, o_part, m_part, l_part, out_ptr, lse_ptr,
    R, LQ, W, HK, k_nb, v_nb, scale, tiles_per_split, n_splits, window_tile,
    D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
    ONE_SPLIT: tl.constexpr, ALIGNED: tl.constexpr, K_ONE_GROUP: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_SPAN: tl.constexpr, K_GROUP: tl.constexpr,
    K_RHO: tl.constexpr, K_SCALE: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_SPAN: tl.constexpr, V_GROUP: tl.constexpr,
    V_RHO: tl.constexpr, V_SCALE: tl.constexpr,
):
    bh, rows, split, d, row_ok, q, m_i, l_i, acc = split_start(q_ptr, R, D, DP, BM)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, window_tile + tl.cdiv(W, BN))
    i = 0
    while i < n_blocks:  # few blocks (O(log n) per layer): a while loop, compiled and interpreted
        row = table + i * _ROW
        kc, ka, kb, ks = _fields(row, K_KIND, ALIGNED)
        vc, va, vb, vs = _fields(row + 4, V_KIND, ALIGNED)
        T = tl.load(row + 8).to(tl.int32)  # the columns after the pointers, in COLUMNS' order
        t0 = tl.load(row + 9).to(tl.int32)
        k_nstat = tl.load(row + 10).to(tl.int32)
        v_nstat = tl.load(row + 11).to(tl.int32)
        lo = tl.maximum(first, t0) - t0
        hi = tl.minimum(last, t0 + tl.cdiv(T, BN)) - t0
        if INTERPRETER:  # run-time loop bounds: see kvq_triton.config.INTERPRETER
            j = lo
            while j < hi:
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, j * BN, T, bh, d, kc, ka, kb, ks, vc, va, vb, vs, T,
                                              HK, k_nb, k_nstat, v_nb, v_nstat, scale, D, BN, PRECISION, K_ONE_GROUP,
                                              K_KIND, K_BITS, K_SPAN, K_GROUP, K_RHO, K_SCALE,
                                              V_KIND, V_BITS, V_SPAN, V_GROUP, V_RHO, V_SCALE)
                j += 1
        else:
            for j in range(lo, hi):
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, j * BN, T, bh, d, kc, ka, kb, ks, vc, va, vb, vs, T,
                                              HK, k_nb, k_nstat, v_nb, v_nstat, scale, D, BN, PRECISION, K_ONE_GROUP,
                                              K_KIND, K_BITS, K_SPAN, K_GROUP, K_RHO, K_SCALE,
                                              V_KIND, V_BITS, V_SPAN, V_GROUP, V_RHO, V_SCALE)
        i += 1
    j = tl.maximum(first, window_tile) - window_tile
    while j < last - window_tile:  # the window: a few tiles, every Triton interpreter takes this bound
        m_i, l_i, acc = _window_block(q, m_i, l_i, acc, j * BN, bh, rows, d, wk, wv, W, LQ, scale, D, BN, PRECISION)
        j += 1
    out_rows = bh.to(tl.int64) * R + rows
    if ONE_SPLIT:
        tl.store(out_ptr + out_rows[:, None] * D + d, acc / l_i[:, None], mask=row_ok[:, None] & (d < D))
        tl.store(lse_ptr + out_rows, m_i + tl.log(l_i), mask=row_ok)
    else:
        part = (bh.to(tl.int64) * n_splits + split) * R + rows
        tl.store(m_part + part, m_i, mask=row_ok)
        tl.store(l_part + part, l_i, mask=row_ok)
        tl.store(o_part + part[:, None] * D + d, acc, mask=row_ok[:, None] & (d < D))


@functools.lru_cache(maxsize=256)
def _table(device: torch.device, entries: tuple[int, ...]) -> torch.Tensor:
    """The block table holding ``entries`` on ``device`` (cached: a layer's blocks stay the same
    from one decode step to the next, and the table holds nothing but its key). A call captured in
    a CUDA graph finds its table here after one warm-up call with the same blocks (a first call
    copies the table to the device, which a capture cannot)."""
    return torch.tensor(entries, dtype=torch.int64).reshape(-1, WIDTH).to(device)


def _split_tiles(tiles: int, programs: int, device: torch.device, splits: int | None) -> tuple[int, int]:
    """(tiles per split, splits): ``splits`` if given, else enough programs to fill the GPU; every
    split non-empty."""
    if splits is None:
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = max(1, (4 * sms) // max(1, programs))
        else:
            splits = 2  # the interpreter: exercise the merge without paying for many programs
    per = triton.cdiv(tiles, max(1, min(splits, tiles)))
    return per, triton.cdiv(tiles, per)


def attend(q_rot: torch.Tensor, q_len: int, blocks: Sequence[tuple[Stored, Stored]], window_k: torch.Tensor,
           window_v: torch.Tensor, scale: float, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries ``q_rot [b, kv_heads, g * q_len, d]`` (rows ordered (head in
    group, query), in the codes' domain) over the packed ``blocks`` (``(keys, values)`` in token
    order, one spec) and then the window ``[b, kv_heads, w, d]`` (keys in the codes' domain, values
    in the values' domain; ``w >= q_len``, its last ``q_len`` tokens the queries' own). Returns
    ``out [b, kv_heads, g * q_len, d]`` (values' domain) and ``lse [b, kv_heads, g * q_len]``,
    float32. ``splits``: how many programs share a row tile's tokens (None: sized to the device)."""
    if not blocks:
        raise ValueError("window.attend needs at least one packed block")
    q_rot = q_rot.to(torch.float32).contiguous()
    wk = window_k.to(torch.float32).contiguous()
    wv = window_v.to(torch.float32).contiguous()
    b, hk, r, d = q_rot.shape
    w = int(wk.shape[2])
    bh, dev = b * hk, q_rot.device
    keys, values = blocks[0]
    dp, bm, bn, one_group = tile_sizes(keys, r, d)
    entries: list[int] = []
    held: list[torch.Tensor] = []  # the contiguous fields, alive until the launch
    tiles = 0
    for k, v in blocks:
        kargs, vargs = kernel_args(k, q_rot), kernel_args(v, q_rot)
        held += [*kargs, *vargs]
        t = int(k.codes.shape[2])
        entries += [x.data_ptr() for x in (*kargs, *vargs)] + [t, tiles, k.stats_len(), v.stats_len()]
        tiles += triton.cdiv(t, bn)
    k_nb, v_nb = held[0].shape[-1], held[4].shape[-1]  # codes bytes per row: the same in every block
    aligned = all(entries[at] % 16 == 0 for row in range(0, len(entries), WIDTH) for at in (row, row + 4))
    table = _table(dev, tuple(entries))
    m_blocks = triton.cdiv(r, bm)
    per, n_splits = _split_tiles(tiles + triton.cdiv(w, bn), bh * m_blocks, dev, splits)
    out = torch.empty((b, hk, r, d), dtype=torch.float32, device=dev)
    lse = torch.empty((b, hk, r), dtype=torch.float32, device=dev)
    if n_splits == 1:
        o_part = m_part = l_part = out
    else:
        o_part = torch.empty((bh, n_splits, r, d), dtype=torch.float32, device=dev)
        m_part = torch.empty((bh, n_splits, r), dtype=torch.float32, device=dev)
        l_part = torch.empty((bh, n_splits, r), dtype=torch.float32, device=dev)
    _window_kernel[(bh, m_blocks, n_splits)](
        q_rot, table, len(blocks), wk, wv, o_part, m_part, l_part, out, lse,
        r, q_len, w, hk, k_nb, v_nb, float(scale), per, n_splits, tiles,
        D=d, DP=dp, BM=bm, BN=bn, PRECISION=precision(dev), ONE_SPLIT=n_splits == 1, ALIGNED=aligned,
        K_ONE_GROUP=one_group, **stored_constexprs(keys, values),
    )
    if n_splits > 1:
        _combine_kernel[(bh, m_blocks)](o_part, m_part, l_part, out, lse, r, n_splits, D=d, DP=dp, BM=bm)
    return out, lse
