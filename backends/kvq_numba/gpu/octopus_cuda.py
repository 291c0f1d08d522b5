"""numba.cuda kernels of OCTOPUS for device input: one block per head vector for encode/decode
(norm, signed Hadamard in shared memory, one thread per triplet), and decode-attention with one
block per (batch, KV head, query row) scoring rotated queries against the decoded directions."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from kvq_core.contract import KernelContext
from kvq_core.layout import packed_row_bytes
from kvq_numba.gpu.common import (MAX_D, ROW_PAD, SLOTS, THREADS, as_float32, block_sum, device, device_function,
                                  fwht_shared, online_update, rotate, triplet_code)

Fields = dict[str, Any]
MAX_TRIPLETS = (MAX_D + 2) // 3


@cuda.jit
def _encode(x, signs, inv_sqrt_d, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint,
            codes, gamma):
    """One block per row: gamma = ||x||, v = H diag(s) x / gamma, one code per triplet, packed."""
    sh = cuda.shared.array(THREADS, np.float32)
    row = cuda.shared.array(ROW_PAD, np.float32)
    trip = cuda.shared.array(MAX_TRIPLETS, np.int32)
    nb, nh, nt, d = x.shape
    bid = cuda.blockIdx.x
    b, h, t = bid // (nh * nt), (bid // nt) % nh, bid % nt
    tid = cuda.threadIdx.x
    ntrip = (d + 2) // 3
    ss = np.float32(0)
    for c in range(tid, d, THREADS):
        ss += x[b, h, t, c] * x[b, h, t, c]
    g = np.float32(math.sqrt(block_sum(sh, tid, ss)))
    if tid == 0:
        gamma[b, h, t] = g
    g = g if g > 0 else np.float32(1)
    for c in range(tid, 3 * ntrip, THREADS):
        row[c] = signs[h, c] * (x[b, h, t, c] / g) if c < d else np.float32(0)
    cuda.syncthreads()
    fwht_shared(row, d, tid, inv_sqrt_d)
    for j in range(tid, ntrip, THREADS):
        trip[j] = triplet_code(row[3 * j], row[3 * j + 1], row[3 * j + 2], xi_th, eta_th, rho_th, dirs,
                               n_xi, n_eta, eta_bits, rho_bits, joint)
    cuda.syncthreads()
    if tid == 0:  # the bitstream of one row is short: one thread packs it
        acc = 0
        nacc = 0
        k = 0
        for j in range(ntrip):
            acc |= int(trip[j]) << nacc
            nacc += bits
            while nacc >= 8:
                codes[b, h, t, k] = np.uint8(acc & 0xFF)
                acc >>= 8
                nacc -= 8
                k += 1
        if nacc > 0:
            codes[b, h, t, k] = np.uint8(acc & 0xFF)


@device_function
def triplet_at(row, j, bits):
    """Code ``j`` of a packed row whose codes have ``bits`` (<= 16) bits, reading up to 3 bytes."""
    p = j * bits
    k = p >> 3
    v = int(row[k])
    if k + 1 < row.shape[0]:
        v |= int(row[k + 1]) << 8
    if k + 2 < row.shape[0]:
        v |= int(row[k + 2]) << 16
    return (v >> (p & 7)) & ((1 << bits) - 1)


@device_function
def unit_channel(row, c, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs):
    """Channel ``c`` of the decoded rotated unit vector of a code row (rho * direction)."""
    code = triplet_at(row, c // 3, bits)
    pair = (code >> (eta_bits + rho_bits)) * n_eta + ((code >> rho_bits) & ((1 << eta_bits) - 1))
    return rho_cb[code & ((1 << rho_bits) - 1)] * dirs[pair, c % 3]


@cuda.jit
def _decode(codes, gamma, signs, inv_sqrt_d, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs, out):
    """One block per row: ``gamma * diag(s) H v_hat``."""
    row = cuda.shared.array(MAX_D, np.float32)
    nb, nh, nt, d = out.shape
    bid = cuda.blockIdx.x
    b, h, t = bid // (nh * nt), (bid // nt) % nh, bid % nt
    tid = cuda.threadIdx.x
    for c in range(tid, d, THREADS):
        row[c] = unit_channel(codes[b, h, t], c, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs)
    cuda.syncthreads()
    fwht_shared(row, d, tid, inv_sqrt_d)
    for c in range(tid, d, THREADS):
        out[b, h, t, c] = gamma[b, h, t] * (signs[h, c] * row[c])


@cuda.jit
def _attend(q, kcodes, kgamma, vcodes, vgamma, vdata, values_fp16, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs,
            scale, out, lse):
    """One block per (b, kv head, query row): logits gamma_t <q, v_hat_t> * scale, online softmax,
    values ``vgamma * v_hat`` (rotated) or the float16 rows ``vdata`` (original domain)."""
    sh = cuda.shared.array(THREADS, np.float32)
    acc = cuda.local.array(SLOTS, np.float32)
    nb, nhk, nr, d = q.shape
    nt = kcodes.shape[2]
    bid = cuda.blockIdx.x
    b, h, r = bid // (nhk * nr), (bid // nr) % nhk, bid % nr
    tid = cuda.threadIdx.x
    for k in range(SLOTS):
        acc[k] = 0
    m = np.float32(-np.inf)
    l = np.float32(0)
    for t in range(nt):
        part = np.float32(0)
        for c in range(tid, d, THREADS):
            part += q[b, h, r, c] * unit_channel(kcodes[b, h, t], c, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs)
        z = block_sum(sh, tid, part) * kgamma[b, h, t] * scale
        m, l, corr, w = online_update(m, l, z)
        k = 0
        for c in range(tid, d, THREADS):
            if values_fp16:
                vv = np.float32(vdata[b, h, t, c])
            else:
                vv = vgamma[b, h, t] * unit_channel(vcodes[b, h, t], c, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs)
            acc[k] = acc[k] * corr + w * vv
            k += 1
    k = 0
    for c in range(tid, d, THREADS):
        out[b, h, r, c] = acc[k] / l
        k += 1
    if tid == 0:
        lse[b, h, r] = m + math.log(l)


class OctopusCuda:
    """CUDA kernels for an :class:`kvq_numba.octopus.OctopusNumba` (its spec and constants)."""

    def __init__(self, host: Any) -> None:
        self.p = host
        self.spec = host.spec
        self._consts: dict[int, dict[str, Any]] = {}

    def _dev(self, consts: Any) -> dict[str, Any]:
        """The spec's constants on the device, cached per constants object (one per layer/heads)."""
        key = id(consts)
        if key not in self._consts:
            names = ("signs", "xi_thresholds", "eta_thresholds", "rho_thresholds", "rho_codebook", "directions")
            self._consts = {key: {n: cuda.to_device(np.ascontiguousarray(consts[n])) for n in names}}
            self._consts[key]["n_xi"] = consts["xi_codebook"].size
            self._consts[key]["n_eta"] = consts["eta_codebook"].size
        return self._consts[key]

    def _encode(self, x: Any, consts: Any) -> Fields:
        s = self.spec
        c = self._dev(consts)
        xd = as_float32(x)
        nb, nh, nt, d = xd.shape
        codes = cuda.to_device(np.zeros((nb, nh, nt, packed_row_bytes(s.n_triplets, s.triplet_bits)), np.uint8))
        gamma = cuda.device_array((nb, nh, nt), np.float32)
        _encode[nb * nh * nt, THREADS](xd, c["signs"], self.p.inv_sqrt_d, c["xi_thresholds"], c["eta_thresholds"],
                                        c["rho_thresholds"], c["directions"], c["n_xi"], c["n_eta"], s.eta_bits,
                                        s.rho_bits, s.triplet_bits, s.rounding == "joint", codes, gamma)
        return {"codes": codes, "norm": gamma}

    def _decode(self, fields: Fields, consts: Any) -> Any:
        s = self.spec
        c = self._dev(consts)
        codes = device(fields["codes"])
        nb, nh, nt = codes.shape[:3]
        out = cuda.device_array((nb, nh, nt, s.head_dim), np.float32)
        _decode[nb * nh * nt, THREADS](codes, device(fields["norm"]), c["signs"], self.p.inv_sqrt_d, s.triplet_bits,
                                        s.eta_bits, s.rho_bits, c["n_eta"], c["rho_codebook"], c["directions"], out)
        return out

    def encode_keys(self, k: Any, ctx: KernelContext) -> Fields:
        return self._encode(k, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> Any:
        return self._decode(fields, ctx.consts)

    def encode_values(self, v: Any, ctx: KernelContext) -> Fields:
        if self.spec.values == "fp16":
            xd = device(v)
            return {"data": cuda.to_device(xd.copy_to_host().astype(np.float16))}
        return self._encode(v, ctx.consts)

    def decode_values(self, fields: Fields, ctx: KernelContext) -> Any:
        if self.spec.values == "fp16":
            return as_float32(fields["data"])
        return self._decode(fields, ctx.consts)

    def attend(self, q: Any, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float) -> tuple[Any, Any]:
        s = self.spec
        c = self._dev(ctx.consts)
        qd = as_float32(q)
        b, hq, lq, d = qd.shape
        hk = ctx.shape[1]
        signs = np.ascontiguousarray(ctx.consts["signs"])
        qr = rotate(qd.reshape((b, hk, (hq // hk) * lq, d)), signs, self.p.inv_sqrt_d)
        nr = qr.shape[2]
        out = cuda.device_array(qr.shape, np.float32)
        lse = cuda.device_array((b, hk, nr), np.float32)
        fp16 = s.values == "fp16"
        dummy8 = cuda.to_device(np.zeros((1, 1, 1, 1), np.uint8))
        dummy32 = cuda.to_device(np.zeros((1, 1, 1), np.float32))
        _attend[b * hk * nr, THREADS](
            qr, device(kfields["codes"]), device(kfields["norm"]),
            dummy8 if fp16 else device(vfields["codes"]), dummy32 if fp16 else device(vfields["norm"]),
            device(vfields["data"]) if fp16 else cuda.to_device(np.zeros((1, 1, 1, 1), np.float16)), fp16,
            s.triplet_bits, s.eta_bits, s.rho_bits, c["n_eta"], c["rho_codebook"], c["directions"],
            np.float32(scale), out, lse)
        if not fp16:
            out = rotate(out, signs, self.p.inv_sqrt_d, inverse=True)
        return out.reshape((b, hq, lq, d)), lse.reshape((b, hq, lq))
