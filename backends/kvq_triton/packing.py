"""Bit packing in Triton: the row rule of :mod:`kvq_core.layout` (little-endian bitstream, LSB
first, rows zero-padded to whole bytes), for any code width from 1 to 16 bits.

Packing is a gather: output byte ``j`` collects the codes ``i = (8 j) // bits + m`` for
``m < SLOTS``, each shifted into place; unpacking code ``i`` reads the ``SPAN`` bytes from
``(i * bits) // 8``. Every shift stays below 32, so the int32 arithmetic is defined on GPUs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_core.layout import packed_row_bytes
from kvq_triton import config


def slots(bits: int) -> int:
    """Codes gathered per output byte: at least the most that touch one byte, a power of two
    (the extra ones land outside the byte and are masked off by ``& 255``)."""
    return 8 // bits if 8 % bits == 0 else triton.next_power_of_2(7 // bits + 2)


def span(bits: int) -> int:
    """Most bytes one code touches."""
    return 1 if 8 % bits == 0 else (bits + 14) // 8


@triton.jit
def unpack_at(row_ptr, i, nbytes, BITS: tl.constexpr, SPAN: tl.constexpr, mask):
    """Codes at indices ``i`` (any shape) of the packed row(s) at ``row_ptr`` (same shape), int32."""
    start = (i * BITS) // 8
    acc = tl.zeros(i.shape, tl.int32)
    for m in tl.static_range(SPAN):
        byte = tl.load(row_ptr + start + m, mask=mask & (start + m < nbytes), other=0).to(tl.int32)
        acc = acc | (byte << (8 * m))
    return (acc >> ((i * BITS) % 8)) & ((1 << BITS) - 1)


@triton.jit
def _pack_kernel(codes_ptr, out_ptr, rows, count, nbytes,
                 BITS: tl.constexpr, SLOTS: tl.constexpr, ROWS: tl.constexpr, NBP: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    j = tl.program_id(1) * NBP + tl.arange(0, NBP)[None, :, None]
    m = tl.arange(0, SLOTS)[None, None, :]
    i = (8 * j) // BITS + m
    ok = (r < rows) & (j < nbytes) & (i < count)
    code = tl.load(codes_ptr + r.to(tl.int64) * count + i, mask=ok, other=0).to(tl.int32)
    off = i * BITS - 8 * j  # where code i starts relative to byte j's first bit, in (-BITS, 8 + BITS)
    part = tl.where(off >= 0, code << tl.maximum(off, 0), code >> tl.maximum(-off, 0)) & 255
    byte = tl.sum(tl.where(ok, part, 0), axis=2)
    r2 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    j2 = tl.program_id(1) * NBP + tl.arange(0, NBP)[None, :]
    tl.store(out_ptr + r2.to(tl.int64) * nbytes + j2, byte.to(tl.uint8), mask=(r2 < rows) & (j2 < nbytes))


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``(..., count)`` (any integer dtype, values < 2**bits) as uint8 rows ``(..., ceil(count*bits/8))``."""
    codes = codes.contiguous()
    count = codes.shape[-1]
    lead = codes.shape[:-1]
    rows = codes.numel() // max(count, 1)
    nbytes = packed_row_bytes(count, bits)
    out = torch.empty((*lead, nbytes), dtype=torch.uint8, device=codes.device)
    if rows == 0:
        return out
    nbp = min(triton.next_power_of_2(nbytes), 128)
    block_rows = max(1, config.tile() // (nbp * slots(bits)))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(nbytes, nbp))
    _pack_kernel[grid](codes, out, rows, count, nbytes, BITS=bits, SLOTS=slots(bits), ROWS=block_rows, NBP=nbp)
    return out
