"""``kvq::attend_paged`` in Triton: split-KV attention straight from vLLM-style pages.

One program per (query token, KV head, token split) scores the token's ``g`` query rows (GQA)
against the coded tokens its request's block table names, causal at the token's position, rebuilding
keys and values in registers from the page rows (:class:`kvq_core.paged.PageLayout`: the same
fields as a contiguous block, addressed ``table[req, t // block] * block_stride + head *
head_stride + (t % block) * row_stride + field offset``); split 0 also attends the request's exact
tail tokens. :func:`kvq_triton.attention._combine_kernel` merges the splits by log-sum-exp, as for
contiguous blocks. The grid depends only on shapes (tokens, heads, block-table width), and nothing
is read back to the host, so a call can be captured in a CUDA graph.

Served: integer-code recipes grouped as OScaR's and KIVI's (keys along tokens, values along
channels; :class:`kvq_core.methods.intcodes.IntCodeRecipe`) at 2, 4 or 8 bits with power-of-two
head_dim, key group and value group (>= 16 tokens per key group), and OCTOPUS with coded values (``values="octopus"``, head_dim <= 256).
Other specs take the torch fallback (``kvq_torch.paged``, through the table).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_core.torch_ops.run import PAGED_FALLBACK, paged_kernel
from kvq_core.torch_ops.torch_kernels import consts_for
from kvq_core.methods.intcodes import CHANNELS, TOKENS
from kvq_core.paged import PageLayout
from kvq_core.spec import MethodSpec
from kvq_torch.common import hadamard_rotate
from kvq_torch.paged import query_positions
from kvq_torch.rotation import rotate_queries, unrotate_output
from kvq_triton.attention import DOT_PRECISION, _combine_kernel
from kvq_triton.config import INTERPRETER
from kvq_triton.packing import span, unpack_at
from kvq_triton.tiles import unpack_bytes

INT, TRIPLETS = 0, 3


@triton.jit
def _half(pages, addr, mask):
    """float32 of the float16 stored little-endian at byte addresses ``addr`` (any shape)."""
    lo = tl.load(pages + addr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(pages + addr + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(pages, addr, head_stride, WIDTH: tl.constexpr, mask):
    """float32 ``[BN]`` stored at byte addresses ``addr`` ``[BN]``, ``WIDTH`` bytes per head row
    (striped over consecutive heads, ``head_stride`` apart; WIDTH >= 4: one row)."""
    p = tl.arange(0, 4)[None, :]
    a = addr[:, None] + (p // WIDTH) * head_stride + (p % WIDTH)
    b = tl.load(pages + a, mask=mask[:, None], other=0).to(tl.int32)
    return tl.sum(b << (8 * p), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _paged_block(q, m_i, l_i, acc, n0, end, req, head, pages, table, aux0, aux1, MB, s_block, s_head, s_row, scale,
                 D: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                 SPAN: tl.constexpr, KGROUP: tl.constexpr, VGROUP: tl.constexpr, RHO_BITS: tl.constexpr,
                 CODE_BYTES: tl.constexpr, K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KO_OFF: tl.constexpr,
                 STAT_W: tl.constexpr, KN_OFF: tl.constexpr, KN_W: tl.constexpr, USE_NORM: tl.constexpr,
                 V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VO_OFF: tl.constexpr, VN_OFF: tl.constexpr,
                 PRECISION: tl.constexpr):
    """The online-softmax step over the ``BN`` paged tokens from ``n0``: returns the new (m, l, acc)."""
    d = tl.arange(0, D)[None, :]
    t = n0 + tl.arange(0, BN)
    t_ok = t < end
    blk = tl.load(table + req.to(tl.int64) * MB + t // BS, mask=t_ok, other=0).to(tl.int64)
    base = blk * s_block + head + (t % BS).to(tl.int64) * s_row  # [BN]
    ok2 = t_ok[:, None]
    if KIND == 0:
        code = unpack_bytes(pages + base[:, None] + K_OFF, ok2, BITS, CODE_BYTES).to(tl.float32)
        g0 = (n0 // KGROUP) * KGROUP  # the tile lies in one key group: its striped stats
        gblk = tl.load(table + req.to(tl.int64) * MB + g0 // BS).to(tl.int64)
        grow = gblk * s_block + head + (g0 % BS) * s_row
        p0 = 2 * d
        sa = grow + (p0 // STAT_W) * s_row + p0 % STAT_W
        sb = grow + ((p0 + 1) // STAT_W) * s_row + (p0 + 1) % STAT_W
        lo_s = tl.load(pages + sa + KS_OFF).to(tl.int32)
        hi_s = tl.load(pages + sb + KS_OFF).to(tl.int32)
        lo_o = tl.load(pages + sa + KO_OFF).to(tl.int32)
        hi_o = tl.load(pages + sb + KO_OFF).to(tl.int32)
        ks = (lo_s | (hi_s << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        ko = (lo_o | (hi_o << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        k = tl.where(ok2, code * ks + ko, 0.0)
        if USE_NORM:
            ts = _f32(pages, blk * s_block + (t % BS).to(tl.int64) * s_row + KN_OFF, s_head, KN_W, t_ok)
        else:
            ts = tl.full((BN,), 1.0, tl.float32)
    else:
        i = d // 3
        ok = ok2 & (d < D)
        kc = unpack_at(pages + base[:, None] + K_OFF, i, CODE_BYTES, BITS, SPAN, ok)
        k = (tl.load(aux0 + (kc & ((1 << RHO_BITS) - 1)), mask=ok, other=0.0)
             * tl.load(aux1 + (kc >> RHO_BITS) * 3 + (d - 3 * i), mask=ok, other=0.0))
        ts = _f32(pages, base + KN_OFF, s_head, 4, t_ok)
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * ts[None, :]
    logits = tl.where(t_ok[None, :], logits * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KIND == 0:
        code = unpack_bytes(pages + base[:, None] + V_OFF, ok2, BITS, CODE_BYTES).to(tl.float32)
        gi = tl.arange(0, D // VGROUP)[None, :]
        vs = _half(pages, base[:, None] + VS_OFF + 2 * gi, ok2)
        vo = _half(pages, base[:, None] + VO_OFF + 2 * gi, ok2)
        vs = tl.reshape(tl.broadcast_to(vs[:, :, None], (BN, D // VGROUP, VGROUP)), (BN, D))
        vo = tl.reshape(tl.broadcast_to(vo[:, :, None], (BN, D // VGROUP, VGROUP)), (BN, D))
        v = tl.where(ok2, code * vs + vo, 0.0)
    else:
        i = d // 3
        ok = ok2 & (d < D)
        vc = unpack_at(pages + base[:, None] + V_OFF, i, CODE_BYTES, BITS, SPAN, ok)
        v = (tl.load(aux0 + (vc & ((1 << RHO_BITS) - 1)), mask=ok, other=0.0)
             * tl.load(aux1 + (vc >> RHO_BITS) * 3 + (d - 3 * i), mask=ok, other=0.0))
        v = v * _f32(pages, base + VN_OFF, s_head, 4, t_ok)[:, None]
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_split_kernel(
    q_ptr, pages, table, req_ptr, pos_ptr, code_lens, tail_k, tail_v, tail_lens, aux0, aux1,
    o_part, m_part, l_part,
    HK, MB, s_block, s_head, s_row, max_tail, scale, tokens_per_split, n_splits,
    G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
    KIND: tl.constexpr, BITS: tl.constexpr, SPAN: tl.constexpr, KGROUP: tl.constexpr, VGROUP: tl.constexpr,
    RHO_BITS: tl.constexpr, CODE_BYTES: tl.constexpr,
    K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KO_OFF: tl.constexpr, STAT_W: tl.constexpr,
    KN_OFF: tl.constexpr, KN_W: tl.constexpr, USE_NORM: tl.constexpr,
    V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VO_OFF: tl.constexpr, VN_OFF: tl.constexpr,
    HAS_TAIL: tl.constexpr, PRECISION: tl.constexpr,
):
    tok = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BM)
    row_ok = rows < G
    d = tl.arange(0, D)[None, :]
    q = tl.load(q_ptr + ((tok.to(tl.int64) * HK + h) * G + rows[:, None]) * D + d, mask=row_ok[:, None], other=0.0)
    req = tl.load(req_ptr + tok)
    pos = tl.load(pos_ptr + tok)
    coded = tl.load(code_lens + req)
    seen = tl.minimum(coded, pos + 1)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seen)
    head = h.to(tl.int64) * s_head
    if INTERPRETER:  # run-time loop bounds: see kvq_triton.config.INTERPRETER
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _paged_block(q, m_i, l_i, acc, n0, end, req, head, pages, table, aux0, aux1, MB, s_block,
                                         s_head, s_row, scale, D, BN, BS, KIND, BITS, SPAN, KGROUP, VGROUP, RHO_BITS,
                                         CODE_BYTES, K_OFF, KS_OFF, KO_OFF, STAT_W, KN_OFF, KN_W, USE_NORM, V_OFF,
                                         VS_OFF, VO_OFF, VN_OFF, PRECISION)
            n0 += BN
    else:
        for n0 in range(start, end, BN):
            m_i, l_i, acc = _paged_block(q, m_i, l_i, acc, n0, end, req, head, pages, table, aux0, aux1, MB, s_block,
                                         s_head, s_row, scale, D, BN, BS, KIND, BITS, SPAN, KGROUP, VGROUP, RHO_BITS,
                                         CODE_BYTES, K_OFF, KS_OFF, KO_OFF, STAT_W, KN_OFF, KN_W, USE_NORM, V_OFF,
                                         VS_OFF, VO_OFF, VN_OFF, PRECISION)
    if HAS_TAIL:
        if split == 0:
            exact = tl.minimum(tl.load(tail_lens + req), pos + 1 - coded)
            trow = (req.to(tl.int64) * HK + h) * max_tail
            n0 = 0  # a while loop: the tail is short, and every Triton interpreter takes its run-time bound
            while n0 < exact:
                t = n0 + tl.arange(0, BN)
                t_ok = t < exact
                k = tl.load(tail_k + (trow + t[:, None]) * D + d, mask=t_ok[:, None], other=0.0)
                logits = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                logits = tl.where(t_ok[None, :], logits * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(logits, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(logits - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(tail_v + (trow + t[:, None]) * D + d, mask=t_ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
                m_i = m_new
                n0 += BN
    part = ((tok.to(tl.int64) * HK + h) * n_splits + split) * G + rows
    tl.store(m_part + part, m_i, mask=row_ok)
    tl.store(l_part + part, l_i, mask=row_ok)
    tl.store(o_part + part[:, None] * D + d, acc, mask=row_ok[:, None])


def fits(spec: MethodSpec) -> bool:
    """Whether the paged Triton kernel serves ``spec`` (module docstring)."""
    d = spec.head_dim
    pow2 = d >= 16 and d & (d - 1) == 0
    recipe = getattr(spec, "recipe", None)  # the integer-code methods' ingredients
    if recipe is not None:
        keys, values = recipe.keys, recipe.values
        kg, vg = keys.size, values.size
        return ((keys.axis, values.axis) == (TOKENS, CHANNELS) and keys.bits == values.bits and keys.bits in (2, 4, 8)
                and pow2 and kg >= 16 and kg & (kg - 1) == 0 and vg & (vg - 1) == 0)
    if spec.method == "octopus":
        return spec.values == "octopus" and pow2 and d <= 256 and spec.triplet_bits <= 24
    return False


class PagedTriton:
    """Paged attention of one spec in Triton (module docstring)."""

    def __init__(self, spec: MethodSpec) -> None:
        self.spec, self.spec_json = spec, spec.to_json()
        self.fast = fits(spec)
        self._layouts: dict[tuple[int, int], PageLayout] = {}

    def _layout(self, block_size: int, kv_heads: int) -> PageLayout:
        key = (block_size, kv_heads)
        if key not in self._layouts:
            self._layouts[key] = PageLayout(self.spec, block_size, kv_heads)
        return self._layouts[key]

    def _transforms(self, consts, hk: int):  # noqa: ANN001, ANN202
        """(to the codes' domain, back from the values' domain) on ``[b, h, t, d]`` tensors."""
        if self.spec.method == "octopus":
            return (lambda x: rotate_queries(x, consts, hk), lambda x: unrotate_output(x, consts, hk))
        if self.spec.recipe.rotates:  # an integer-code recipe (fits)
            rot = lambda x: hadamard_rotate(x, consts["hadamard"])  # noqa: E731
            return rot, rot
        same = lambda x: x.to(torch.float32)  # noqa: E731
        return same, same

    def attend_paged(self, layer: int, q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
                     code_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                     tail_k: torch.Tensor | None, tail_v: torch.Tensor | None, tail_slot: torch.Tensor | None,
                     tail_lens: torch.Tensor | None, head_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fast or pages.stride(3) != 1:
            return paged_kernel(PAGED_FALLBACK, self.spec_json).attend_paged(
                layer, q, pages, block_table, code_lens, query_start_loc, scale, tail_k, tail_v, tail_slot, tail_lens,
                head_offset)
        spec = self.spec
        n, hq, d = q.shape
        nb, hk, bs, _ = pages.shape
        g = hq // hk
        if n == 0:
            return q.new_zeros((0, hq, d), dtype=torch.float32), q.new_zeros((0, hq), dtype=torch.float32)
        dev = q.device
        layout = self._layout(bs, hk)
        consts = consts_for(self.spec_json, hk, layer, dev, head_offset)
        to_codes, from_values = self._transforms(consts, hk)
        # rotate with the query heads as kv heads' groups: [n, hq, 1, d] -> [1, hq, n, d]
        qr = to_codes(q.to(torch.float32).permute(1, 0, 2).unsqueeze(0)).squeeze(0).permute(1, 0, 2).contiguous()
        code = code_lens.to(torch.int32).contiguous()
        tails = tail_lens if tail_lens is not None else torch.zeros_like(code)
        req, pos = query_positions(query_start_loc, code, tails, n)
        req, pos = req.to(torch.int32).contiguous(), pos.to(torch.int32).contiguous()
        if tail_k is not None:
            slot = tail_slot.to(torch.long)
            tk = to_codes(tail_k.index_select(0, slot).to(torch.float32)).contiguous()
            tv = to_codes(tail_v.index_select(0, slot).to(torch.float32)).contiguous()  # values: the same domain
            max_tail, tl_lens = tk.shape[2], tails.to(torch.int32).contiguous()
        else:
            tk = tv = qr
            max_tail, tl_lens = 1, code
        int_codes = spec.method != "octopus"  # else an integer-code recipe (fits)
        kgroup = spec.recipe.keys.size if int_codes else 1
        bn = min(64, kgroup) if int_codes else (64 if d <= 128 else 32)
        bm = max(16, triton.next_power_of_2(g))
        max_ctx = block_table.shape[1] * bs
        if dev.type == "cuda":
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            want = max(1, (4 * sms) // max(1, n * hk))
        else:
            want = 2  # the interpreter: exercise the merge without paying for many programs
        n_splits = max(1, min(want, triton.cdiv(max_ctx, bn)))
        per = triton.cdiv(triton.cdiv(max_ctx, n_splits), bn) * bn
        n_splits = triton.cdiv(max_ctx, per)
        o_part = torch.empty((n * hk, n_splits, g, d), dtype=torch.float32, device=dev)
        m_part = torch.empty((n * hk, n_splits, g), dtype=torch.float32, device=dev)
        l_part = torch.empty((n * hk, n_splits, g), dtype=torch.float32, device=dev)
        kslot = layout.slot("keys", "codes")
        vslot = layout.slot("values", "codes")
        if int_codes:
            aux0 = aux1 = qr
            ks, ko, vs, vo = (layout.slot("keys", "scale"), layout.slot("keys", "offset"),
                              layout.slot("values", "scale"), layout.slot("values", "offset"))
            use_norm = spec.recipe.token_norm
            kn = layout.slot("keys", "norm") if use_norm else ks
            offsets = dict(KS_OFF=ks.start, KO_OFF=ko.start, STAT_W=ks.width, KN_OFF=kn.start, KN_W=kn.width,
                           USE_NORM=use_norm, VS_OFF=vs.start, VO_OFF=vo.start, VN_OFF=0, VGROUP=spec.recipe.values.size,
                           RHO_BITS=0)
            bits = spec.bits
        else:
            aux0, aux1 = consts["rho_codebook"].to(torch.float32), consts["directions"].to(torch.float32)
            offsets = dict(KS_OFF=0, KO_OFF=0, STAT_W=1, KN_OFF=layout.slot("keys", "norm").start, KN_W=4,
                           USE_NORM=True, VS_OFF=0, VO_OFF=0, VN_OFF=layout.slot("values", "norm").start, VGROUP=1,
                           RHO_BITS=spec.rho_bits)
            bits = spec.triplet_bits
        _paged_split_kernel[(n, hk, n_splits)](
            qr, pages, block_table.to(torch.int32).contiguous(), req, pos, code, tk, tv, tl_lens, aux0.contiguous(),
            aux1.contiguous(), o_part, m_part, l_part,
            hk, block_table.shape[1], pages.stride(0), pages.stride(1), pages.stride(2), max_tail, float(scale),
            per, n_splits,
            G=g, D=d, BM=bm, BN=bn, BS=bs, KIND=INT if int_codes else TRIPLETS, BITS=bits, SPAN=span(bits),
            KGROUP=max(kgroup, 1), CODE_BYTES=kslot.width, K_OFF=kslot.start, V_OFF=vslot.start,
            HAS_TAIL=tail_k is not None, PRECISION=DOT_PRECISION if dev.type == "cuda" else "ieee", **offsets)
        out = torch.empty((n * hk, g, d), dtype=torch.float32, device=dev)
        lse = torch.empty((n * hk, g), dtype=torch.float32, device=dev)
        _combine_kernel[(n * hk, 1)](o_part, m_part, l_part, out, lse, g, n_splits, D=d, DP=d, BM=bm)
        out = from_values(out.reshape(n, hq, d).permute(1, 0, 2).unsqueeze(0)).squeeze(0).permute(1, 0, 2)
        return out.contiguous(), lse.reshape(n, hq)

