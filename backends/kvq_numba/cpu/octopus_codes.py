"""Numba CPU kernels of OCTOPUS (kvq_numpy.octopus): per head vector, the norm gamma, the seeded
signed Hadamard rotation ``v = H diag(s) x / gamma``, and one code per triplet of v (octahedral
direction xi/eta and triplet norm rho, nearest centroid; "joint" rounding tries the 3x3 index
neighbourhood of (xi, eta) and keeps the one with the largest projection).

Encode repeats the reference's float32 steps without fastmath (norms in NumPy's pairwise order),
so codes are bitwise the reference's.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kvq_numba.cpu.common import fwht_block, fwht_heads, pack_row, sum_squares
from kvq_numba.cpu.simd import load_u64, move4
from kvq_numba.rules import NEIGHBOURS, row_bytes, sgn

#: rows (b x h x t) up to which :func:`encode` makes one serial compiled call: a decode step's few tokens, where
#: the parallel path's two parallel regions and three calls cost ~10 us against ~5 us (AVX-512, one thread)
SERIAL_ROWS = 64


def encode(x, signs, inv_sqrt_d, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint):
    """Codes uint8 [b, h, t, row_bytes] and norms gamma float32 [b, h, t] of C-contiguous float32
    x [b, h, t, d]: normalise and sign, rotate (:func:`fwht_heads`), then one code per triplet. Up to
    :data:`SERIAL_ROWS` rows in one serial call (:func:`encode_serial`, the same steps: bit-identical)."""
    if x.shape[0] * x.shape[1] * x.shape[2] <= SERIAL_ROWS:
        return encode_serial(x, signs, inv_sqrt_d, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits,
                             joint)
    v, gamma = signed_units(x, signs)
    fwht_heads(v, v, inv_sqrt_d)
    codes = _triplet_codes(v, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint)
    return codes, gamma


@njit(cache=True)
def encode_serial(x, signs, inv_sqrt_d, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint):
    """:func:`encode` of a few rows in one compiled call on this thread (:func:`signed_unit`, :func:`fwht_block`
    over all rows, :func:`code_row`)."""
    nb, nh, nt, d = x.shape
    v = np.empty_like(x)
    gamma = np.empty((nb, nh, nt), np.float32)
    for b in range(nb):
        for h in range(nh):
            for t in range(nt):
                gamma[b, h, t] = signed_unit(x[b, h, t], signs[h], v[b, h, t])
    rows = v.reshape(-1, d)
    fwht_block(rows, rows, inv_sqrt_d)
    codes = np.zeros((nb, nh, nt, row_bytes((d + 2) // 3, bits)), np.uint8)
    fs, js = code_scratch(d)
    for b in range(nb):
        for h in range(nh):
            for t in range(nt):
                code_row(v[b, h, t], xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint, fs, js,
                         codes[b, h, t])
    return codes, gamma


@njit(parallel=True, cache=True)
def signed_units(x, signs):
    """(``s_h * x / gamma``, gamma) per row, gamma the float32 L2 norm in NumPy's pairwise order
    (rows of norm 0 divide by 1)."""
    nb, nh, nt, d = x.shape
    u = np.empty_like(x)
    gamma = np.empty((nb, nh, nt), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        for t in range(nt):
            gamma[b, h, t] = signed_unit(x[b, h, t], signs[h], u[b, h, t])
    return u, gamma


@njit(inline="always", cache=True)
def signed_unit(x, sign, u) -> np.float32:
    """``u = sign * x / gamma`` of one row (gamma 0: divided by 1); returns gamma, the float32 L2
    norm of ``x`` in NumPy's pairwise order."""
    d = x.shape[0]
    g = np.sqrt(sum_squares(x, d))
    gd = g if g > 0 else np.float32(1)
    for c in range(d):
        u[c] = sign[c] * (x[c] / gd)
    return g


@njit(parallel=True, cache=True)
def _triplet_codes(v, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint):
    """Packed triplet codes uint8 [b, h, t, row_bytes] of rotated unit rows v [b, h, t, d] (:func:`code_row`)."""
    nb, nh, nt, d = v.shape
    ntrip = (d + 2) // 3
    codes = np.zeros((nb, nh, nt, row_bytes(ntrip, bits)), np.uint8)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        fs, js = code_scratch(d)
        for t in range(nt):
            code_row(v[b, h, t], xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint, fs, js,
                     codes[b, h, t])
    return codes


@njit(inline="always", cache=True)
def code_scratch(d):
    """:func:`code_row`'s scratch for rows of ``d``: float32 [5, ceil(d / 3)] and int32 [3, ceil(d / 3)]."""
    ntrip = (d + 2) // 3
    return np.empty((5, ntrip), np.float32), np.empty((3, ntrip), np.int32)


@njit(inline="always", cache=True)
def _count_le(thresholds, x, counts) -> None:
    """``counts[j] += how many thresholds are <= x[j]`` (:func:`kvq_numba.rules.bucket` of every triplet):
    the thresholds outer, the triplets inner, so the compares run as vectors without a branch."""
    for k in range(thresholds.shape[0]):
        th = thresholds[k]
        for j in range(counts.shape[0]):
            counts[j] += np.int32(th <= x[j])


@njit(inline="always", cache=True)
def code_row(v, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint, fs, js, out) -> None:
    """``out`` (uint8, every byte written) = the packed triplet codes of one rotated unit row ``v``
    [d]; a last partial triplet is zero-padded; ``fs``, ``js``: :func:`code_scratch`.

    :func:`kvq_numba.rules.triplet_code`'s float32 steps, reordered to run over all the row's
    triplets at once, stage by stage, with selects instead of branches (its per-triplet branches
    mispredict; stage loops vectorise): the octahedral fold, the nearest (xi, eta) centroids, the
    joint search (strictly larger projection wins, centre first, as the rule's loop) or the
    triplet norm, the nearest rho centroid. Codes are bitwise the rule's (the conformance suite).
    """
    d = v.shape[0]
    ntrip = fs.shape[1]
    xs, ys, zs, xi, eta = fs[0], fs[1], fs[2], fs[3], fs[4]
    i_xi, i_eta, i_rho = js[0], js[1], js[2]
    zero, one = np.float32(0), np.float32(1)
    for j in range(ntrip):
        xs[j] = v[3 * j]
        ys[j] = v[3 * j + 1] if 3 * j + 1 < d else zero
        zs[j] = v[3 * j + 2] if 3 * j + 2 < d else zero
    for j in range(ntrip):
        x, y, z = xs[j], ys[j], zs[j]
        l1 = abs(x) + abs(y) + abs(z)
        flat = l1 == 0
        n = one if flat else l1
        px, py, pz = (zero, zero, one) if flat else (x / n, y / n, z / n)
        fold = pz < 0
        xi[j] = (sgn(px) * (one - abs(py))) if fold else px
        eta[j] = (sgn(py) * (one - abs(px))) if fold else py
        i_xi[j], i_eta[j], i_rho[j] = 0, 0, 0
    _count_le(xi_th, xi, i_xi)
    _count_le(eta_th, eta, i_eta)
    rho = xi  # xi's buckets are taken: its scratch holds what rho is coded from
    for j in range(ntrip):
        x, y, z = xs[j], ys[j], zs[j]
        if joint:
            ix, ie = i_xi[j], i_eta[j]
            best, bx, be = np.float32(-np.inf), ix, ie
            for k in range(NEIGHBOURS.shape[0]):
                cx = min(max(ix + NEIGHBOURS[k, 0], 0), n_xi - 1)
                ce = min(max(ie + NEIGHBOURS[k, 1], 0), n_eta - 1)
                p = cx * n_eta + ce
                s = x * dirs[p, 0] + y * dirs[p, 1] + z * dirs[p, 2]
                better = s > best
                best, bx, be = (s, cx, ce) if better else (best, bx, be)
            i_xi[j], i_eta[j] = bx, be
            rho[j] = max(best, zero)
        else:
            rho[j] = np.float32(math.sqrt(x * x + y * y + z * z))
    _count_le(rho_th, rho, i_rho)
    for j in range(ntrip):
        i_xi[j] = (i_xi[j] << (eta_bits + rho_bits)) | (i_eta[j] << rho_bits) | i_rho[j]
    pack_row(i_xi, bits, out)


@njit(inline="always", cache=True)
def _code_at(row, j, bits, nbytes) -> np.int32:
    """Code ``j`` (``bits`` <= 17) of a packed row: the (up to) three bytes from bit ``j * bits``.

    Unsigned arithmetic and a bounded byte loop: no branch on the row end per byte and no
    negative-index fix-ups, which made the per-code read several times slower.
    """
    p = bits * j
    k = p >> 3
    w = np.uint64(0)
    for i in range(min(3, nbytes - k)):
        w |= np.uint64(row[k + i]) << np.uint64(8 * i)
    return np.int32((w >> np.uint64(p & 7)) & np.uint64((1 << bits) - 1))


@njit(inline="always", cache=True)
def _code_word(buf, a, nbytes, bits, j) -> np.int64:
    """Code ``j`` of the ``nbytes``-byte row at byte ``a`` of ``buf`` (``nbytes >= 8``, ``bits`` <= 56): from
    one 8-byte load that holds it, the one at its first byte, moved back to end with the row when it
    would pass the row's end (so it never reads past the row)."""
    p = bits * j
    k = min(p >> 3, nbytes - 8)
    return np.int64((load_u64(buf, a + k) >> np.uint64(p - 8 * k)) & np.uint64((1 << bits) - 1))


#: floats a decoded row may write past its end: every triplet is one 16-byte move, so a row's last move
#: reaches up to three floats into the next row (which its own first move overwrites); a buffer of decoded
#: rows holds this many floats after its last row
SPILL = 3
#: code widths decoded in groups with constant shifts (:func:`group_plan`): OCTOPUS b=2/3/4 (7, 10, 13 bits at
#: the default splits) and TurboQuant b=2/3/4 (three coordinate codes: 6, 9, 12 bits); other widths one load a code
GROUPED_WIDTHS = (10, 7, 13, 9, 6, 12)


def group_plan(bits: int) -> tuple[int, int, tuple[int, int], tuple[int, ...], tuple[int, ...]]:
    """How ``bits``-bit codes (<= 56) are read in groups: ``(n, nb, (l0, l1), sel, shifts)``, ``n`` codes in
    every ``nb`` bytes (``n * bits`` whole bytes, ``n <= 8``), code ``k`` of a group being
    ``(w_sel[k] >> shifts[k]) & mask`` with ``w_i`` the 8-byte load at byte ``l_i`` of the group. The largest
    group one load holds, else the smallest that two loads hold (10 bits: four codes per five bytes, one load;
    9 bits: eight per nine, two)."""
    n0 = 8 // math.gcd(bits, 8)
    one = two = None
    for n in range(n0, 9, n0):
        loads, sel, shifts = [0], [], []
        for k in range(n):
            if k * bits + bits > 8 * loads[-1] + 64:
                loads.append((k * bits) >> 3)
            sel.append(len(loads) - 1)
            shifts.append(k * bits - 8 * loads[-1])
        plan = (n, n * bits // 8, (loads[0], loads[-1]), tuple(sel), tuple(shifts))
        if len(loads) == 1:
            one = plan
        elif len(loads) == 2 and two is None:
            two = plan
    found = one or two
    if found is None:
        raise ValueError(f"{bits}-bit codes do not fit two 8-byte loads per group")
    return found


def _grouped_decoder(bits: int):  # noqa: ANN202
    """A compiled ``decode(buf, a, nbytes, ntrip, table, o, base) -> j``: the row's first ``j`` triplets (whole
    groups of :func:`group_plan` that stay inside the row) as table moves, the group's constants compiled in,
    so that every shift is a constant once the group's loop unrolls (as fast as a hand-written group)."""
    n, nb, (l0, l1), sel, shifts = group_plan(bits)
    mask = np.uint64((1 << bits) - 1)

    @njit(inline="always")
    def decode(buf, a, nbytes, ntrip, table, o, base):  # noqa: ANN001, ANN202
        groups = min(ntrip // n, (nbytes - 8 - l1) // nb + 1) if nbytes >= 8 + l1 else 0
        for g in range(groups):
            w0 = load_u64(buf, a + nb * g + l0)
            w1 = load_u64(buf, a + nb * g + l1)
            p = base + 3 * n * g
            for k in range(n):
                w = w0 if sel[k] == 0 else w1
                move4(o, p + 3 * k, table, 4 * np.int64((w >> np.uint64(shifts[k])) & mask))
        return n * groups
    return decode


def _grouped_dispatch(widths: tuple[int, ...]):  # noqa: ANN202
    """``decode(buf, a, nbytes, ntrip, bits, table, o, base) -> j``: :func:`_grouped_decoder` of ``bits`` when
    it is one of ``widths`` (a chain of compiled branches), else 0 (no triplet decoded)."""
    if not widths:
        @njit(inline="always")
        def none(buf, a, nbytes, ntrip, bits, table, o, base):  # noqa: ANN001, ANN202
            return 0
        return none
    width, first, rest = widths[0], _grouped_decoder(widths[0]), _grouped_dispatch(widths[1:])

    @njit(inline="always")
    def decode(buf, a, nbytes, ntrip, bits, table, o, base):  # noqa: ANN001, ANN202
        if bits == width:
            return first(buf, a, nbytes, ntrip, table, o, base)
        return rest(buf, a, nbytes, ntrip, bits, table, o, base)
    return decode


_decode_groups = _grouped_dispatch(GROUPED_WIDTHS)


@njit(inline="always", cache=True)
def _decode_row(buf, a, nbytes, bits, table, o, base, d) -> None:
    """``o[base:base + d]`` = the rotated unit vector (rho * direction per triplet, gamma not applied) of the
    ``nbytes``-byte code row at byte ``a`` of ``buf``; ``table`` float32 [2**bits * 4] holds each code's rho *
    direction and a zero (:func:`code_table`).

    A triplet is one 16-byte move of its table entry, the last one too: it writes up to :data:`SPILL` floats
    past the row. Codes come from 8-byte loads (:func:`kvq_numba.cpu.simd.load_u64`): the widths of
    :data:`GROUPED_WIDTHS` in groups with constant shifts (:func:`group_plan`), the rest of the row and other
    widths one load a code (:func:`_code_word`); rows under 8 bytes byte by byte (:func:`_code_at`), writing the
    row only. Against assembling each word from single bytes the 2k-token decode attention kernel went from 520
    to 397 us (b=3, d=64, one AVX-512 thread); against copying the row's last two triplets float by float (to
    stay inside the row), decoding 2k x 3 rows went from ~102 to ~58 us; grouped 9-, 12- and 6-bit codes
    (TurboQuant) decode 2k x 3 rows ~2x faster than one load a code.
    """
    ntrip = (d + 2) // 3
    if nbytes < 8:  # rows shorter than one 8-byte load (head_dim < 19 at b=3): byte by byte
        row = buf[a:a + nbytes]
        for j in range(ntrip):
            e = 4 * np.int64(_code_at(row, j, bits, nbytes))
            for k in range(min(3, d - 3 * j)):
                o[base + 3 * j + k] = table[e + k]
        return
    for j in range(_decode_groups(buf, a, nbytes, ntrip, bits, table, o, base), ntrip):
        move4(o, base + 3 * j, table, 4 * _code_word(buf, a, nbytes, bits, j))


@njit(inline="always", cache=True)
def decode_rows_at(buf, addr, n, nbytes, bits, table, out, d) -> None:
    """Rows ``i < n`` of the flat float32 ``out`` (``n * d`` floats and :data:`SPILL` more) = the rotated unit
    vectors of the ``nbytes``-byte code rows at bytes ``addr[i]`` of ``buf`` (:func:`_decode_row`), in order
    (each row's first move overwrites what the row before spilled)."""
    for i in range(n):
        _decode_row(buf, addr[i], nbytes, bits, table, out, i * d, d)


def code_table(bits: int, eta_bits: int, rho_bits: int, n_eta: int, rho_cb: np.ndarray, dirs: np.ndarray) -> np.ndarray:
    """float32 [2**bits * 4]: what each triplet code decodes to, ``rho_cb[i_rho] * dirs[i_xi * n_eta
    + i_eta]`` (the reference's float32 product; codes naming no direction decode to 0), and a zero
    that pads each entry to 16 bytes (one vector move per decoded triplet)."""
    c = np.arange(1 << bits)
    pair = (c >> (eta_bits + rho_bits)) * n_eta + ((c >> rho_bits) & ((1 << eta_bits) - 1))
    ok = pair < dirs.shape[0]
    table = np.zeros((1 << bits, 4), np.float32)
    table[ok, :3] = rho_cb[c[ok] & ((1 << rho_bits) - 1), None].astype(np.float32) * dirs[pair[ok]].astype(np.float32)
    return table.reshape(-1)


def decode(codes, gamma, signs, inv_sqrt_d, bits, table, d):
    """``gamma * diag(s) H v_hat``: decoded vectors float32 [b, h, t, d] in the original domain."""
    y = _unit_rows(codes, bits, table, d)
    fwht_heads(y, y, inv_sqrt_d)
    _scale_signed(y, gamma, signs)
    return y


@njit(parallel=True, cache=True)
def _unit_rows(codes, bits, table, d):
    """The rotated unit vectors ``v_hat`` float32 [b, h, t, d] of code rows (:func:`_decode_row`, each into
    a scratch row with room for its spill, then copied)."""
    nb, nh, nt, nbytes = codes.shape
    out = np.empty((nb, nh, nt, d), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        row = np.empty(d + SPILL, np.float32)
        for t in range(nt):
            _decode_row(codes[b, h, t], 0, nbytes, bits, table, row, 0, d)
            out[b, h, t] = row[:d]
    return out


@njit(parallel=True, cache=True)
def _scale_signed(y, gamma, signs) -> None:
    """In place: ``y[b, h, t] = gamma[b, h, t] * (s_h * y[b, h, t])`` (the reference's order)."""
    nb, nh, nt, d = y.shape
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        for t in range(nt):
            g = gamma[b, h, t]
            for c in range(d):
                y[b, h, t, c] = g * (signs[h, c] * y[b, h, t, c])


def signed_rotate(x: np.ndarray, signs: np.ndarray, inv_sqrt_d: np.float32) -> np.ndarray:
    """``H diag(s_h) x`` per row of C-contiguous float32 x [b, h, n, d] (queries grouped by KV head)."""
    xs = x * signs.astype(np.float32)[None, :, None, :]
    return fwht_heads(xs, xs, inv_sqrt_d)


def signed_unrotate(y: np.ndarray, signs: np.ndarray, inv_sqrt_d: np.float32) -> np.ndarray:
    """``diag(s_h) H y`` per row of C-contiguous float32 y [b, h, n, d], the inverse of :func:`signed_rotate`."""
    x = fwht_heads(y, np.empty_like(y), inv_sqrt_d)
    x *= signs.astype(np.float32)[None, :, None, :]
    return x
