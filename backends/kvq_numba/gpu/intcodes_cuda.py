"""numba.cuda kernels of the integer-code methods (OScaR; KIVI's layout is the same): encode,
decode and decode-attention for device input. Codes are 2, 4 or 8 bits (no code straddles a
byte), see ``kvq_numba.plugin.supports``. Scales and offsets are stored float16 on the device
(round to nearest even, as the reference's ``astype(float16)``).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from kvq_core.contract import KernelContext
from kvq_numba.gpu.common import (SLOTS, THREADS, as_float32, block_sum, device, device_function, group_params,
                                  int_code, online_update, rotate)

Fields = dict[str, Any]
_FLAT = 128  # threads per block of the elementwise kernels


@cuda.jit
def _unit_keys(kr, norm, u):
    """OTS per (b, t) block: n = ||kr[b, :, t, :]|| (1 if not > 0), u = kr / n."""
    sh = cuda.shared.array(THREADS, np.float32)
    nb, nh, nt, d = kr.shape
    b, t = cuda.blockIdx.x // nt, cuda.blockIdx.x % nt
    tid = cuda.threadIdx.x
    ss = np.float32(0)
    for k in range(tid, nh * d, THREADS):
        v = kr[b, k // d, t, k % d]
        ss += v * v
    n = math.sqrt(block_sum(sh, tid, ss))
    n = np.float32(n) if n > 0 else np.float32(1)
    if tid == 0:
        norm[b, t] = n
    for k in range(tid, nh * d, THREADS):
        u[b, k // d, t, k % d] = kr[b, k // d, t, k % d] / n


@cuda.jit
def _quant_token_groups(x, bits, group, zero_mode, codes, scale, offset):
    """One thread per (b, h, token group, channel): stats over the group's tokens, then its codes."""
    nb, nh, nt, d = x.shape
    ng = scale.shape[2]
    i = cuda.grid(1)
    if i >= nb * nh * ng * d:
        return
    c, g, h, b = i % d, (i // d) % ng, (i // (d * ng)) % nh, i // (d * ng * nh)
    t0, t1 = g * group, min(nt, (g + 1) * group)
    mn = x[b, h, t0, c]
    mx = mn
    for t in range(t0 + 1, t1):
        mn = min(mn, x[b, h, t, c])
        mx = max(mx, x[b, h, t, c])
    levels = np.float32((1 << bits) - 1)
    s, zq, off, var = group_params(mn, mx, levels, zero_mode)
    scale[b, h, g, c] = s
    offset[b, h, g, c] = off
    for t in range(t0, t1):
        codes[b, h, t, c] = np.uint8(int_code(x[b, h, t, c], s, zq, mn, levels, zero_mode)) if var else 0


@cuda.jit
def _quant_channel_groups(x, bits, group, zero_mode, codes, scale, offset):
    """One thread per (b, h, t, channel group)."""
    nb, nh, nt, d = x.shape
    ng = d // group
    i = cuda.grid(1)
    if i >= nb * nh * nt * ng:
        return
    g, t, h, b = i % ng, (i // ng) % nt, (i // (ng * nt)) % nh, i // (ng * nt * nh)
    c0 = g * group
    mn = x[b, h, t, c0]
    mx = mn
    for c in range(c0 + 1, c0 + group):
        mn = min(mn, x[b, h, t, c])
        mx = max(mx, x[b, h, t, c])
    levels = np.float32((1 << bits) - 1)
    s, zq, off, var = group_params(mn, mx, levels, zero_mode)
    scale[b, h, t, g] = s
    offset[b, h, t, g] = off
    for c in range(c0, c0 + group):
        codes[b, h, t, c] = np.uint8(int_code(x[b, h, t, c], s, zq, mn, levels, zero_mode)) if var else 0


@cuda.jit
def _pack(codes, bits, packed):
    """One thread per packed byte: ``8 // bits`` codes, LSB first (bits 2, 4 or 8)."""
    nb, nh, nt, nbytes = packed.shape
    i = cuda.grid(1)
    if i >= nb * nh * nt * nbytes:
        return
    j, t, h, b = i % nbytes, (i // nbytes) % nt, (i // (nbytes * nt)) % nh, i // (nbytes * nt * nh)
    per = 8 // bits
    v = 0
    for k in range(per):
        v |= int(codes[b, h, t, j * per + k]) << (k * bits)
    packed[b, h, t, j] = np.uint8(v)


@device_function
def code_at(row, c, bits):
    """Code ``c`` of a packed row (bits 2, 4 or 8), as float32."""
    p = c * bits
    return np.float32((int(row[p >> 3]) >> (p & 7)) & ((1 << bits) - 1))


@cuda.jit
def _dequant(codes, scale, offset, bits, group, along_tokens, norm, use_norm, out):
    """One thread per element: ``code * scale + offset`` (stats per token group or per channel
    group), times the token norm when ``use_norm``."""
    nb, nh, nt, d = out.shape
    i = cuda.grid(1)
    if i >= nb * nh * nt * d:
        return
    c, t, h, b = i % d, (i // d) % nt, (i // (d * nt)) % nh, i // (d * nt * nh)
    if along_tokens:
        s, o = np.float32(scale[b, h, t // group, c]), np.float32(offset[b, h, t // group, c])
    else:
        s, o = np.float32(scale[b, h, t, c // group]), np.float32(offset[b, h, t, c // group])
    v = code_at(codes[b, h, t], c, bits) * s + o
    out[b, h, t, c] = v * norm[b, t] if use_norm else v


@cuda.jit
def _attend(q, kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset, bits, kgroup, vgroup, scale,
            out, lse):
    """One block per (b, kv head, query row); threads stride over channels; tokens in sequence
    with an online softmax (the block-wide dot product is a shared-memory tree sum)."""
    sh = cuda.shared.array(THREADS, np.float32)
    acc = cuda.local.array(SLOTS, np.float32)
    nb, nhk, nr, d = q.shape
    nt = kcodes.shape[2]
    bid = cuda.blockIdx.x
    b, h, r = bid // (nhk * nr), (bid // nr) % nhk, bid % nr
    tid = cuda.threadIdx.x
    per = (d + THREADS - 1) // THREADS
    for k in range(per):
        acc[k] = 0
    m = np.float32(-np.inf)
    l = np.float32(0)
    for t in range(nt):
        g = t // kgroup
        part = np.float32(0)
        for c in range(tid, d, THREADS):
            kv = code_at(kcodes[b, h, t], c, bits) * np.float32(kscale[b, h, g, c]) + np.float32(koffset[b, h, g, c])
            part += q[b, h, r, c] * kv
        z = block_sum(sh, tid, part) * scale
        if use_norm:
            z = z * knorm[b, t]
        m, l, corr, w = online_update(m, l, z)
        k = 0
        for c in range(tid, d, THREADS):
            vv = code_at(vcodes[b, h, t], c, bits) * np.float32(vscale[b, h, t, c // vgroup]) \
                + np.float32(voffset[b, h, t, c // vgroup])
            acc[k] = acc[k] * corr + w * vv
            k += 1
    k = 0
    for c in range(tid, d, THREADS):
        out[b, h, r, c] = acc[k] / l
        k += 1
    if tid == 0:
        lse[b, h, r] = m + math.log(l)


def _grid(n: int) -> tuple[int, int]:
    return max(1, math.ceil(n / _FLAT)), _FLAT


class IntCodesCuda:
    """CUDA kernels for an :class:`kvq_numba.intcodes.IntCodesNumba` (its parameters)."""

    def __init__(self, host: Any) -> None:
        self.p = host
        self.d = host.spec.head_dim

    def _rotate(self, x: Any, inverse: bool = False) -> Any:
        return rotate(x, None, self.p.inv_sqrt_d, inverse) if self.p.rotation else x

    def _codes(self, x: Any, group: int, along_tokens: bool) -> Fields:
        nb, nh, nt, d = x.shape
        bits = self.p.bits
        codes = cuda.device_array(x.shape, np.uint8)
        stats = (nb, nh, math.ceil(nt / group), d) if along_tokens else (nb, nh, nt, d // group)
        scale = cuda.device_array(stats, np.float16)
        offset = cuda.device_array(stats, np.float16)
        if along_tokens:
            _quant_token_groups[_grid(math.prod(stats))](x, bits, group, self.p.zero_mode, codes, scale, offset)
        else:
            _quant_channel_groups[_grid(math.prod(stats))](x, bits, group, self.p.zero_mode, codes, scale, offset)
        packed = cuda.device_array((nb, nh, nt, d * bits // 8), np.uint8)
        _pack[_grid(packed.size)](codes, bits, packed)
        return {"codes": packed, "scale": scale, "offset": offset}

    def encode_keys(self, k: Any, ctx: KernelContext) -> Fields:
        kr = self._rotate(as_float32(k))
        norm = None
        if self.p.token_scaling:
            nb, nh, nt, d = kr.shape
            norm = cuda.device_array((nb, nt), np.float32)
            u = cuda.device_array(kr.shape, np.float32)
            _unit_keys[nb * nt, THREADS](kr, norm, u)
            kr = u
        fields = self._codes(kr, self.p.key_group, True)
        if norm is not None:
            fields["norm"] = norm
        return fields

    def encode_values(self, v: Any, ctx: KernelContext) -> Fields:
        return self._codes(self._rotate(as_float32(v)), self.p.value_group, False)

    def _decode(self, fields: Fields, group: int, along_tokens: bool, norm: Any) -> Any:
        codes = device(fields["codes"])
        nb, nh, nt = codes.shape[:3]
        out = cuda.device_array((nb, nh, nt, self.d), np.float32)
        use = norm is not None
        n = device(norm) if use else cuda.to_device(np.ones((1, 1), np.float32))
        _dequant[_grid(out.size)](codes, device(fields["scale"]), device(fields["offset"]), self.p.bits, group,
                                  along_tokens, n, use, out)
        return self._rotate(out, inverse=True)

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> Any:
        return self._decode(fields, self.p.key_group, True, fields["norm"] if self.p.token_scaling else None)

    def decode_values(self, fields: Fields, ctx: KernelContext) -> Any:
        return self._decode(fields, self.p.value_group, False, None)

    def attend(self, q: Any, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float) -> tuple[Any, Any]:
        qd = as_float32(q)
        b, hq, lq, d = qd.shape
        hk = ctx.shape[1]
        qr = self._rotate(qd.reshape((b, hk, (hq // hk) * lq, d)))
        nr = qr.shape[2]
        out = cuda.device_array(qr.shape, np.float32)
        lse = cuda.device_array((b, hk, nr), np.float32)
        use = self.p.token_scaling
        norm = device(kfields["norm"]) if use else cuda.to_device(np.ones((1, 1), np.float32))
        _attend[b * hk * nr, THREADS](qr, device(kfields["codes"]), device(kfields["scale"]), device(kfields["offset"]),
                                      norm, use, device(vfields["codes"]), device(vfields["scale"]),
                                      device(vfields["offset"]), self.p.bits, self.p.key_group, self.p.value_group,
                                      np.float32(scale), out, lse)
        return self._rotate(out, inverse=True).reshape((b, hq, lq, d)), lse.reshape((b, hq, lq))
