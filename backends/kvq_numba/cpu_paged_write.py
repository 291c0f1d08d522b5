"""The Numba CPU kernel of ``kvq::write_paged``: a step's encoded fields, byte for byte, into the
page rows of their slots (:class:`kvq_core.paged.PageLayout`: per-token fields at their columns,
a group's statistics striped over its rows, a field shared by the heads striped over their rows,
zeros where a stripe pads), as ``PageLayout.pack`` and a scatter would, without either.

Fields come as uint8 source rows: a per-token field ``[B * heads * T, nbytes]``, a per-group one
``[B * heads * (T / group), nbytes]``, a field shared by the heads ``[B * T, nbytes]`` (the block
order of :func:`kvq_core.paged.step_blocks`: token ``i`` is ``(i // T, i % T)``).
"""
from __future__ import annotations

from numba import njit

#: descriptor columns of a field: its stripe, its first byte in a row, its bytes per row, its source row's bytes
STRIPE, START, WIDTH, NBYTES = range(4)
DESC = 4
#: stripes (kvq_core.paged.TOKEN / GROUP / HEADS)
TOKEN, GROUP, HEADS = 0, 1, 2


@njit(cache=True)
def scatter_rows(fields, desc, tokens_per_block, group, slots, pages) -> None:
    """Write token ``i``'s row of every kv head at ``slots[i]`` (skipped when < 0) into ``pages``
    uint8 ``[num_blocks, kv_heads, block_size, row_bytes]`` (any strides)."""
    t_blk, heads, block_tokens = tokens_per_block, pages.shape[1], pages.shape[2]
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0:
            continue
        b, t = i // t_blk, i % t_blk
        page, at = s // block_tokens, s % block_tokens
        for f in range(len(fields)):
            src = fields[f]
            kind, start, width, nbytes = desc[f, STRIPE], desc[f, START], desc[f, WIDTH], desc[f, NBYTES]
            for h in range(heads):
                out = pages[page, h, at, start:start + width]
                if kind == TOKEN:
                    row = src[(b * heads + h) * t_blk + t]
                    for c in range(width):
                        out[c] = row[c]
                    continue
                if kind == GROUP:
                    row = src[(b * heads + h) * (t_blk // group) + t // group]
                    lo = (t % group) * width
                else:
                    row = src[b * t_blk + t]
                    lo = h * width
                for c in range(width):
                    out[c] = row[lo + c] if lo + c < nbytes else 0
