"""Keys and values rebuilt from their stored fields in registers, one tile at a time: the one
decoder that both the decode kernel (:func:`decode`) and the fused attention use.

Kinds: integer codes with per-group scale/offset along tokens (keys of OScaR/KIVI) or along
channels (values), codebook indices (TurboQuant), OCTOPUS triplets (rho codebook x direction
table, triplet ``d // 3``, component ``d % 3``), and plain float16 (OCTOPUS ``values="fp16"``).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kvq_triton import config
from kvq_triton.packing import span, unpack_at

#: What a block of keys or values is stored as (the ``kind`` of :class:`Stored`).
INT_TOKENS, INT_CHANNELS, CODEBOOK, TRIPLETS, DENSE = 0, 1, 2, 3, 4
#: How each token's logit (keys) or row (values) is scaled: not, by a [batch, tokens] norm
#: shared by the KV heads (OScaR), or by a [batch * kv_heads, tokens] norm.
NO_SCALE, BATCH_SCALE, HEAD_SCALE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Stored:
    """One packed block as the attention kernel reads it.

    ``codes`` ``[b, h, t, nbytes]`` (uint8; float16 ``[b, h, t, d]`` for DENSE); ``aux0``/``aux1``:
    scale/offset (INT_*), the codebook (CODEBOOK), the rho codebook and the direction table
    (TRIPLETS); ``group``: tokens (INT_TOKENS) or channels (INT_CHANNELS) per stats entry;
    ``rho_bits``: the low bits of a triplet code holding the rho index; ``token_scale`` and
    ``scale_mode``: the per-token factor (see NO_SCALE/BATCH_SCALE/HEAD_SCALE)."""

    kind: int
    codes: torch.Tensor
    bits: int = 8
    aux0: torch.Tensor | None = None
    aux1: torch.Tensor | None = None
    group: int = 1
    rho_bits: int = 0
    token_scale: torch.Tensor | None = None
    scale_mode: int = NO_SCALE

    def stats_len(self) -> int:
        """Entries per row of the stats (groups along tokens, or channel groups per token)."""
        return int(self.aux0.shape[-2] if self.kind == INT_TOKENS else self.aux0.shape[-1]) if self.aux0 is not None else 1


@triton.jit
def unpack_bytes(row_ptr, row_ok, BITS: tl.constexpr, NB: tl.constexpr):
    """Every code of rows of ``NB`` bytes holding ``8 // BITS`` codes each (BITS 2, 4 or 8),
    ``[BN, NB * 8 // BITS]`` int32: each byte is loaded once and split in registers (the code
    planes interleaved by ``tl.join``), in place of one gathered load per code."""
    j = tl.arange(0, NB)[None, :]
    b = tl.load(row_ptr + j, mask=row_ok, other=0).to(tl.int32)
    if BITS == 8:
        x = b
    elif BITS == 4:
        x = tl.reshape(tl.join(b & 15, b >> 4), (row_ok.shape[0], NB * 2))
    else:  # code 4j + 2u + v is plane 2u + v: join(join(p0, p2), join(p1, p3))[..., u, v]
        low = tl.join(b & 3, (b >> 4) & 3)
        high = tl.join((b >> 2) & 3, (b >> 6) & 3)
        x = tl.reshape(tl.join(low, high), (row_ok.shape[0], NB * 4))
    return x


@triton.jit
def tile(codes, aux0, aux1, bh, n0, t, row_ok, d, T, nb, nstat,
         D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, SPAN: tl.constexpr,
         GROUP: tl.constexpr, RHO_BITS: tl.constexpr, ONE_GROUP: tl.constexpr):
    """Rows ``t`` ([BN, 1], the first is ``n0``, valid where ``row_ok``) x channels ``d`` ([1, DP])
    of one KV head's block, float32, 0 outside. ``ONE_GROUP``: the rows lie in one token group
    (INT_TOKENS), so one row of scale/offset serves the tile. Whole-byte codes (2, 4, 8 bits) of a
    power-of-two head_dim >= 16 load each byte once (:func:`unpack_bytes`) and, for values, each
    (token, channel group) scale/offset once."""
    ok = row_ok & (d < D)
    row = bh.to(tl.int64) * T + t
    if KIND == 4:  # DENSE float16
        x = tl.load(codes + row * D + d, mask=ok, other=0.0).to(tl.float32)
    elif KIND == 3:  # TRIPLETS: rho codebook x direction table, triplet i = d // 3, component d % 3
        i = d // 3
        code = unpack_at(codes + row * nb, i, nb, BITS, SPAN, ok)
        rho = tl.load(aux0 + (code & ((1 << RHO_BITS) - 1)), mask=ok, other=0.0)
        direction = tl.load(aux1 + (code >> RHO_BITS) * 3 + (d - 3 * i), mask=ok, other=0.0)
        x = rho * direction
    else:
        if (BITS == 2 or BITS == 4 or BITS == 8) and D >= 16 and (D & (D - 1)) == 0:
            code = unpack_bytes(codes + row * nb, row_ok, BITS, D * BITS // 8)
        else:
            code = unpack_at(codes + row * nb, d, nb, BITS, SPAN, ok)
        if KIND == 2:  # CODEBOOK
            x = tl.load(aux0 + code, mask=ok, other=0.0)
        else:
            if KIND == 0 and ONE_GROUP:  # INT_TOKENS, one stats row [1, DP]
                stat = (bh.to(tl.int64) * nstat + n0 // GROUP) * D + d
                s = tl.load(aux0 + stat, mask=d < D, other=0.0).to(tl.float32)
                o = tl.load(aux1 + stat, mask=d < D, other=0.0).to(tl.float32)
            elif KIND == 0:  # INT_TOKENS: stats [bh, token group, d]
                stat = (bh.to(tl.int64) * nstat + t // GROUP) * D + d
                s = tl.load(aux0 + stat, mask=ok, other=0.0).to(tl.float32)
                o = tl.load(aux1 + stat, mask=ok, other=0.0).to(tl.float32)
            elif (BITS == 2 or BITS == 4 or BITS == 8) and D >= 16 and (D & (D - 1)) == 0:  # INT_CHANNELS: [BN, D // GROUP] stats, broadcast over each group's channels
                g = tl.arange(0, D // GROUP)[None, :]
                s = tl.load(aux0 + row * nstat + g, mask=row_ok, other=0.0).to(tl.float32)
                o = tl.load(aux1 + row * nstat + g, mask=row_ok, other=0.0).to(tl.float32)
                s = tl.reshape(tl.broadcast_to(s[:, :, None], (row_ok.shape[0], D // GROUP, GROUP)), (row_ok.shape[0], D))
                o = tl.reshape(tl.broadcast_to(o[:, :, None], (row_ok.shape[0], D // GROUP, GROUP)), (row_ok.shape[0], D))
            else:  # INT_CHANNELS: stats [bh, t, channel group], gathered per channel
                stat = row * nstat + d // GROUP
                s = tl.load(aux0 + stat, mask=ok, other=0.0).to(tl.float32)
                o = tl.load(aux1 + stat, mask=ok, other=0.0).to(tl.float32)
            x = code.to(tl.float32) * s + o
    return tl.where(ok, x, 0.0)


@triton.jit
def token_scale(ptr, bh, t, ok, T, HK, MODE: tl.constexpr):
    """The per-token factor ``[BN]`` (1 where MODE is NO_SCALE)."""
    if MODE == 1:
        f = tl.load(ptr + (bh // HK).to(tl.int64) * T + t, mask=ok, other=1.0)
    elif MODE == 2:
        f = tl.load(ptr + bh.to(tl.int64) * T + t, mask=ok, other=1.0)
    else:
        f = tl.full(t.shape, 1.0, tl.float32)
    return f


def kernel_args(s: Stored, dummy: torch.Tensor) -> tuple:
    """(codes, aux0, aux1, token_scale) as contiguous tensors, ``dummy`` standing in for absent ones."""
    aux0 = s.aux0.contiguous() if s.aux0 is not None else dummy
    aux1 = s.aux1.contiguous() if s.aux1 is not None else dummy
    scale = s.token_scale.contiguous() if s.token_scale is not None else dummy
    return s.codes.contiguous(), aux0, aux1, scale


@triton.jit
def _decode_kernel(codes, aux0, aux1, tscale, out_ptr, T, HK, nb, nstat,
                   D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                   SPAN: tl.constexpr, GROUP: tl.constexpr, RHO_BITS: tl.constexpr, SCALE: tl.constexpr):
    bh = tl.program_id(0)
    t1 = tl.program_id(1) * BN + tl.arange(0, BN)
    t = t1[:, None]
    d = tl.arange(0, DP)[None, :]
    x = tile(codes, aux0, aux1, bh, tl.program_id(1) * BN, t, t < T, d, T, nb, nstat, D, KIND, BITS, SPAN, GROUP,
             RHO_BITS, False)
    x = x * token_scale(tscale, bh, t1, t1 < T, T, HK, SCALE)[:, None]
    tl.store(out_ptr + (bh.to(tl.int64) * T + t) * D + d, x, mask=(t < T) & (d < D))


def decode(s: Stored, shape) -> torch.Tensor:
    """The block ``[b, h, t, d]`` (float32) that ``s`` stores, times its per-token factor."""
    b, h, t, d = (int(x) for x in shape)
    out = torch.empty((b, h, t, d), dtype=torch.float32, device=s.codes.device)
    if out.numel() == 0:
        return out
    dp = max(16, triton.next_power_of_2(d))
    bn = max(1, min(triton.next_power_of_2(t), config.tile() // dp))
    codes, aux0, aux1, tscale = kernel_args(s, out)
    _decode_kernel[(b * h, triton.cdiv(t, bn))](
        codes, aux0, aux1, tscale, out, t, h, codes.shape[-1], s.stats_len(),
        D=d, DP=dp, BN=bn, KIND=s.kind, BITS=s.bits, SPAN=span(s.bits), GROUP=s.group,
        RHO_BITS=s.rho_bits, SCALE=s.scale_mode)
    return out
