"""The Numba CPU kernels of ``kvq::write_paged``.

:func:`write_octopus` (and its parallel twin) encodes OCTOPUS K and V rows straight into their page
rows in one call. :func:`scatter_rows` writes encoded fields (OScaR, KIVI), byte for byte, into the
page rows of their slots (:class:`kvq_core.paged.PageLayout`: per-token fields at their columns,
a group's statistics striped over its rows, a field shared by the heads striped over their rows,
zeros where a stripe pads), as ``PageLayout.pack`` and a scatter would, without either.

Fields come as uint8 source rows: a per-token field ``[B * heads * T, nbytes]``, a per-group one
``[B * heads * (T / group), nbytes]``, a field shared by the heads ``[B * T, nbytes]`` (the block
order of :func:`kvq_core.paged.step_blocks`: token ``i`` is ``(i // T, i % T)``).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu import octopus_codes
from kvq_numba.cpu.common import fwht_block
from kvq_numba.rules import row_bytes

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


#: ``write_octopus``'s column starts of a row: key codes, key norm, value codes (or float16 values), value norm
KC, KN, VC, VN = range(4)
#: tokens ``write_octopus`` rotates together (one FWHT call; a parallel task)
CHUNK_TOKENS = 16


def _write_octopus(key, value, vhalf, slots, signs, inv_sqrt_d, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits,
                   rho_bits, bits, joint, starts, pages) -> None:
    """OCTOPUS's paged write in one pass: token ``i``'s K and V rows of every kv head (float32 ``[n,
    heads, d]``, any strides) encoded straight into its page row at ``slots[i]`` (skipped when < 0;
    slots distinct): codes, then the float32 norm, at the columns ``starts``. Float16 values
    (``vhalf``: float16 bits ``[n, heads, d]``, non-empty) are copied instead of coded.

    Per chunk of :data:`CHUNK_TOKENS` tokens: the signed unit rows
    (:func:`kvq_numba.cpu.octopus_codes.signed_unit`), one :func:`kvq_numba.cpu.common.fwht_block` over
    all of them (it vectorises across rows), then each row's codes
    (:func:`kvq_numba.cpu.octopus_codes.code_row`) into its page row: the batched encoder's float32 steps
    per row, so codes and norms are bitwise :func:`kvq_numba.cpu.octopus_codes.encode`'s."""
    n, heads, d = key.shape
    fp16 = vhalf.shape[0] > 0
    coded = heads if fp16 else 2 * heads  # rows encoded per token: K (and V) of every head
    block_tokens = pages.shape[2]
    nbytes = row_bytes((d + 2) // 3, bits)
    for chunk in prange((n + CHUNK_TOKENS - 1) // CHUNK_TOKENS):
        t0 = chunk * CHUNK_TOKENS
        m = min(CHUNK_TOKENS, n - t0)
        u = np.empty((m * coded, d), np.float32)
        gamma = np.empty(m * coded, np.float32)
        for i in range(m):
            for r in range(coded):
                x = key[t0 + i, r] if r < heads else value[t0 + i, r - heads]
                gamma[i * coded + r] = octopus_codes.signed_unit(x, signs[r % heads], u[i * coded + r])
        fwht_block(u, u, inv_sqrt_d)
        norm = gamma.view(np.uint8)
        fs, js = octopus_codes.code_scratch(d)
        for i in range(m):
            s = slots[t0 + i]
            if s < 0:
                continue
            page, at = s // block_tokens, s % block_tokens
            for r in range(coded):
                out = pages[page, r % heads, at]
                c, g = (starts[KC], starts[KN]) if r < heads else (starts[VC], starts[VN])
                octopus_codes.code_row(u[i * coded + r], xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits,
                                     bits, joint, fs, js, out[c:c + nbytes])
                for b in range(4):
                    out[g + b] = norm[4 * (i * coded + r) + b]
            if fp16:
                for h in range(heads):
                    out = pages[page, h, at]
                    half = vhalf[t0 + i, h]
                    for c in range(d):
                        out[starts[VC] + 2 * c] = np.uint8(half[c] & 0xFF)
                        out[starts[VC] + 2 * c + 1] = np.uint8(half[c] >> 8)


#: the kernel on the calling thread (small writes: a decode step) and in parallel over tokens (prefill chunks)
write_octopus = njit(cache=True)(_write_octopus)
write_octopus_parallel = njit(parallel=True, cache=True)(_write_octopus)
