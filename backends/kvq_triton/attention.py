"""Fused decode attention over the packed cache in Triton: split-KV (flash-decoding).

One program takes one KV head's query rows (the ``g * q_len`` rows that share it, GQA) and one
split of the tokens; it rebuilds each block of keys and values in registers from the codes
(:func:`kvq_triton.tiles.tile`: integer codes with scale/offset, codebook indices, OCTOPUS
triplets, or float16),
scores with an online softmax, and writes its partial (max, sum, output). A second kernel merges
the splits by log-sum-exp. No dequantized K/V ever reaches global memory. Queries arrive rotated
(the host rotates them once) and outputs leave in the rotated domain (the host un-rotates once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_triton.config import INTERPRETER
from kvq_triton.packing import span
from kvq_triton.tiles import INT_TOKENS, Stored, kernel_args, tile, token_scale

#: ``tl.dot`` precision on a GPU: three TF32 tensor-core products (float32-level accuracy, within
#: the conformance tolerance); the interpreter computes in float32 ("ieee").
DOT_PRECISION = "tf32x3"

@triton.jit
def _attend_block(q, m_i, l_i, acc, n0, end, bh, d, kc, ka, kb, ks, vc, va, vb, vs, T, HK, k_nb, k_nstat, v_nb,
                  v_nstat, scale, D: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
                  K_ONE_GROUP: tl.constexpr, K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_SPAN: tl.constexpr,
                  K_GROUP: tl.constexpr, K_RHO: tl.constexpr, K_SCALE: tl.constexpr,
                  V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_SPAN: tl.constexpr, V_GROUP: tl.constexpr,
                  V_RHO: tl.constexpr, V_SCALE: tl.constexpr):
    """The online-softmax step over the ``BN`` tokens from ``n0``: returns the new (m, l, acc)."""
    t1 = n0 + tl.arange(0, BN)
    t_ok = t1 < end
    t = t1[:, None]
    k = tile(kc, ka, kb, bh, n0, t, t_ok[:, None], d, T, k_nb, k_nstat, D, K_KIND, K_BITS, K_SPAN, K_GROUP,
             K_RHO, K_ONE_GROUP)
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    logits = logits * token_scale(ks, bh, t1, t_ok, T, HK, K_SCALE)[None, :]
    logits = tl.where(t_ok[None, :], logits * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tile(vc, va, vb, bh, n0, t, t_ok[:, None], d, T, v_nb, v_nstat, D, V_KIND, V_BITS, V_SPAN, V_GROUP,
             V_RHO, False)
    v = v * token_scale(vs, bh, t1, t_ok, T, HK, V_SCALE)[:, None]
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def split_start(q_ptr, R, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr):
    """A split program's start, shared by the split kernels: its (batch x kv head, query rows
    ``BM`` of ``R``, split) coordinates, the channel index ``d`` [1, DP], which rows exist, the
    rows' queries ``q`` [BM, DP] (zeros past ``D`` and past ``R``) and the empty online-softmax
    state (max -inf, sum 0, output 0)."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    d = tl.arange(0, DP)[None, :]
    row_ok = rows < R
    q = tl.load(q_ptr + (bh.to(tl.int64) * R + rows[:, None]) * D + d, mask=row_ok[:, None] & (d < D), other=0.0)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, DP), tl.float32)
    return bh, rows, tl.program_id(2), d, row_ok, q, m_i, l_i, acc


@triton.jit
def _attend_split_kernel(
    q_ptr, kc, ka, kb, ks, vc, va, vb, vs, o_part, m_part, l_part,
    R, T, HK, k_nb, k_nstat, v_nb, v_nstat, scale, tokens_per_split, n_splits,
    D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
    K_ONE_GROUP: tl.constexpr, K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_SPAN: tl.constexpr, K_GROUP: tl.constexpr,
    K_RHO: tl.constexpr, K_SCALE: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_SPAN: tl.constexpr, V_GROUP: tl.constexpr,
    V_RHO: tl.constexpr, V_SCALE: tl.constexpr,
):
    bh, rows, split, d, row_ok, q, m_i, l_i, acc = split_start(q_ptr, R, D, DP, BM)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, T)
    if INTERPRETER:  # run-time loop bounds: see kvq_triton.config.INTERPRETER
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, n0, end, bh, d, kc, ka, kb, ks, vc, va, vb, vs, T, HK,
                                          k_nb, k_nstat, v_nb, v_nstat, scale, D, BN, PRECISION, K_ONE_GROUP,
                                          K_KIND, K_BITS, K_SPAN, K_GROUP, K_RHO, K_SCALE,
                                          V_KIND, V_BITS, V_SPAN, V_GROUP, V_RHO, V_SCALE)
            n0 += BN
    else:
        for n0 in range(start, end, BN):
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, n0, end, bh, d, kc, ka, kb, ks, vc, va, vb, vs, T, HK,
                                          k_nb, k_nstat, v_nb, v_nstat, scale, D, BN, PRECISION, K_ONE_GROUP,
                                          K_KIND, K_BITS, K_SPAN, K_GROUP, K_RHO, K_SCALE,
                                          V_KIND, V_BITS, V_SPAN, V_GROUP, V_RHO, V_SCALE)
    part = (bh.to(tl.int64) * n_splits + split) * R + rows
    tl.store(m_part + part, m_i, mask=row_ok)
    tl.store(l_part + part, l_i, mask=row_ok)
    tl.store(o_part + part[:, None] * D + d, acc, mask=row_ok[:, None] & (d < D))


@triton.jit
def _combine_kernel(o_part, m_part, l_part, out_ptr, lse_ptr, R, n_splits,
                    D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr):
    """Merges a row block's splits by log-sum-exp (few splits: ``while`` loops, which every
    Triton interpreter takes with a run-time bound, see kvq_triton.config.INTERPRETER)."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    d = tl.arange(0, DP)[None, :]
    row_ok = rows < R
    base = bh.to(tl.int64) * n_splits * R + rows
    m = tl.full((BM,), float("-inf"), tl.float32)
    s = 0
    while s < n_splits:
        m = tl.maximum(m, tl.load(m_part + base + s * R, mask=row_ok, other=0.0))
        s += 1
    total = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, DP), tl.float32)
    s = 0
    while s < n_splits:
        w = tl.exp(tl.load(m_part + base + s * R, mask=row_ok, other=0.0) - m)
        total += w * tl.load(l_part + base + s * R, mask=row_ok, other=0.0)
        o = tl.load(o_part + (base + s * R)[:, None] * D + d, mask=row_ok[:, None] & (d < D), other=0.0)
        acc += w[:, None] * o
        s += 1
    out_rows = bh.to(tl.int64) * R + rows
    tl.store(out_ptr + out_rows[:, None] * D + d, acc / total[:, None], mask=row_ok[:, None] & (d < D))
    tl.store(lse_ptr + out_rows, m + tl.log(total), mask=row_ok)


def _splits(t: int, blocks_per_head: int, bh: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(tokens per split, splits): enough programs to fill the GPU, every split non-empty."""
    n_blocks = triton.cdiv(t, block_n)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = max(1, (4 * sms) // max(1, bh * blocks_per_head))
    else:
        want = 2  # the interpreter: exercise the merge without paying for many programs
    per = triton.cdiv(n_blocks, min(want, n_blocks)) * block_n
    return per, triton.cdiv(t, per)


def tile_sizes(keys: Stored, r: int, d: int) -> tuple[int, int, int, bool]:
    """(DP, BM, BN, K_ONE_GROUP) of an attention launch over ``r`` query rows of head_dim ``d``:
    the padded head_dim, query rows and tokens per tile, and whether each tile lies in one key
    token group (then one row of key stats serves it)."""
    dp = max(16, triton.next_power_of_2(d))
    bm = min(64, max(16, triton.next_power_of_2(r)))
    bn = 64 if d <= 128 else 32
    one_group = keys.kind == INT_TOKENS and keys.group >= 16 and keys.group & (keys.group - 1) == 0
    if one_group:
        bn = min(bn, keys.group)
    return dp, bm, bn, one_group


def stored_constexprs(keys: Stored, values: Stored) -> dict:
    """The ``K_*`` and ``V_*`` kernel constants describing how the keys and values are stored."""
    out = {}
    for prefix, s in (("K", keys), ("V", values)):
        out.update({f"{prefix}_KIND": s.kind, f"{prefix}_BITS": s.bits, f"{prefix}_SPAN": span(s.bits),
                    f"{prefix}_GROUP": s.group, f"{prefix}_RHO": s.rho_bits, f"{prefix}_SCALE": s.scale_mode})
    return out


def precision(device: torch.device) -> str:
    """``tl.dot``'s input precision on ``device`` (see :data:`DOT_PRECISION`)."""
    return DOT_PRECISION if device.type == "cuda" else "ieee"


def attend(q_rot: torch.Tensor, keys: Stored, values: Stored, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped rotated queries ``q_rot [b, kv_heads, R, d]`` (float32) over the
    packed keys and values of ``[b, kv_heads, t, d]``; returns ``out [b, kv_heads, R, d]`` (in the
    rotated domain) and ``lse [b, kv_heads, R]``, float32."""
    q_rot = q_rot.to(torch.float32).contiguous()
    b, hk, r, d = q_rot.shape
    t = int(keys.codes.shape[2])
    bh = b * hk
    dp, bm, bn, one_group = tile_sizes(keys, r, d)
    m_blocks = triton.cdiv(r, bm)
    per, n_splits = _splits(t, m_blocks, bh, bn, q_rot.device)
    dev = q_rot.device
    o_part = torch.empty((bh, n_splits, r, d), dtype=torch.float32, device=dev)
    m_part = torch.empty((bh, n_splits, r), dtype=torch.float32, device=dev)
    l_part = torch.empty((bh, n_splits, r), dtype=torch.float32, device=dev)
    kc, ka, kb, ks = kernel_args(keys, q_rot)
    vc, va, vb, vs = kernel_args(values, q_rot)
    _attend_split_kernel[(bh, m_blocks, n_splits)](
        q_rot, kc, ka, kb, ks, vc, va, vb, vs, o_part, m_part, l_part,
        r, t, hk, kc.shape[-1], keys.stats_len(), vc.shape[-1], values.stats_len(), float(scale), per, n_splits,
        D=d, DP=dp, BM=bm, BN=bn, PRECISION=precision(dev), K_ONE_GROUP=one_group,
        **stored_constexprs(keys, values),
    )
    out = torch.empty((b, hk, r, d), dtype=torch.float32, device=dev)
    lse = torch.empty((b, hk, r), dtype=torch.float32, device=dev)
    _combine_kernel[(bh, m_blocks)](o_part, m_part, l_part, out, lse, r, n_splits, D=d, DP=dp, BM=bm)
    return out, lse
