"""NumPy reference kernels of OCTOPUS (the codec is described in :mod:`kvq_core.methods.octopus`).

Everything is vectorised over [batch, kv_heads, tokens, triplets] and computed in float32, the
precision the GPU kernels work in. Keys stay in the rotated domain inside :meth:`OctopusKernels.attend`.
"""
from __future__ import annotations

import numpy as np

from kvq_core.contract import KernelContext
from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.math.octahedral import JOINT_NEIGHBOURS, oct_encode
from kvq_core.methods.octopus import OctopusSpec
from kvq_numpy.attention import softmax_attend
from kvq_numpy.rotation import normalize_rotate, rotate_queries, unrotate, unrotate_output

Consts = dict[str, np.ndarray]
Fields = dict[str, np.ndarray]

_NEIGHBOURS = np.array(JOINT_NEIGHBOURS)


def _quantize(x: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Nearest-centroid index: the Codebook.quantize rule, with thresholds from the constants."""
    return np.searchsorted(thresholds, x, side="right")


def triplets(v: np.ndarray, n_triplets: int) -> np.ndarray:
    """The first 3 * n_triplets coordinates of [..., d] as [..., n_triplets, 3], zero-padding a
    short tail (spec 1.3); coordinates beyond them are the scalar tail's."""
    pad = max(3 * n_triplets - v.shape[-1], 0)
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])[..., : 3 * n_triplets]
    return v.reshape(*v.shape[:-1], n_triplets, 3)


def _directions(i_xi: np.ndarray, i_eta: np.ndarray, consts: Consts) -> np.ndarray:
    """Unit directions (..., 3) of xi/eta codebook indices: rows of the decoded-direction table
    (``oct_decode`` of every centroid pair, see :meth:`OctopusSpec.constants`)."""
    return consts["directions"][i_xi * consts["eta_codebook"].size + i_eta]


def _direction_indices(t: np.ndarray, consts: Consts) -> tuple[np.ndarray, np.ndarray]:
    """Nearest-centroid xi/eta indices of each triplet's octahedral point.

    oct_encode is scale-invariant and maps 0 like (0, 0, 1), so t needs no division by rho."""
    xi_eta = oct_encode(t)
    return _quantize(xi_eta[..., 0], consts["xi_thresholds"]), _quantize(xi_eta[..., 1], consts["eta_thresholds"])


def _round_plain(t: np.ndarray, consts: Consts) -> tuple[np.ndarray, ...]:
    """Independent nearest-centroid rounding of xi, eta and rho = ||t||."""
    i_xi, i_eta = _direction_indices(t, consts)
    return i_xi, i_eta, _quantize(np.linalg.norm(t, axis=-1), consts["rho_thresholds"])


def _round_joint(t: np.ndarray, consts: Consts) -> tuple[np.ndarray, ...]:
    """Spec 1.8: the 3x3 index neighbour maximising s = <t, n_hat>, then rho index = Q_rho(s)."""
    i_xi, i_eta = _direction_indices(t, consts)
    c_xi = np.clip(i_xi[..., None] + _NEIGHBOURS[:, 0], 0, consts["xi_codebook"].size - 1)
    c_eta = np.clip(i_eta[..., None] + _NEIGHBOURS[:, 1], 0, consts["eta_codebook"].size - 1)
    s = np.einsum("...c,...kc->...k", t, _directions(c_xi, c_eta, consts))
    best = s.argmax(axis=-1)[..., None]
    i_xi, i_eta, s = (np.take_along_axis(a, best, axis=-1)[..., 0] for a in (c_xi, c_eta, s))
    return i_xi, i_eta, _quantize(np.maximum(s, 0), consts["rho_thresholds"])


def _join(spec: OctopusSpec, i_xi: np.ndarray, i_eta: np.ndarray, i_rho: np.ndarray) -> np.ndarray:
    """One code per triplet: xi in the high bits, then eta, then rho."""
    return (i_xi << (spec.eta_bits + spec.rho_bits)) | (i_eta << spec.rho_bits) | i_rho


def _split(spec: OctopusSpec, code: np.ndarray) -> tuple[np.ndarray, ...]:
    """Inverse of :func:`_join`."""
    eta_mask, rho_mask = (1 << spec.eta_bits) - 1, (1 << spec.rho_bits) - 1
    return code >> (spec.eta_bits + spec.rho_bits), (code >> spec.rho_bits) & eta_mask, code & rho_mask


def encode(x: np.ndarray, spec: OctopusSpec, consts: Consts) -> Fields:
    """Fields ``codes`` and ``norm`` of a block [b, h, t, d]; a zero vector gets gamma 0."""
    gamma, v = normalize_rotate(x, consts)
    t = triplets(v, spec.n_triplets)
    rounding = _round_joint if spec.rounding == "joint" else _round_plain
    codes = _join(spec, *rounding(t, consts))
    if not spec.n_tail:
        return {"codes": pack_codes(codes, spec.triplet_bits), "norm": gamma}
    tail = _quantize(v[..., 3 * spec.n_triplets :], consts["tail_thresholds"])
    stream = np.concatenate((_to_bits(codes, spec.triplet_bits), _to_bits(tail, spec.bits)), axis=-1)
    return {"codes": pack_codes(stream, 1), "norm": gamma}


def _to_bits(codes: np.ndarray, width: int) -> np.ndarray:
    """Codes (..., n) as their bits (..., n * width), least significant first (the layout bit rule)."""
    return ((codes[..., None] >> np.arange(width)) & 1).reshape(*codes.shape[:-1], -1)


def _from_bits(stream: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`_to_bits`."""
    return (stream.reshape(*stream.shape[:-1], -1, width) << np.arange(width)).sum(axis=-1)


def _unpack(fields: Fields, spec: OctopusSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """The triplet codes and the scalar tail's codes (None without a scalar tail)."""
    if not spec.n_tail:
        return unpack_codes(fields["codes"], spec.triplet_bits, spec.n_triplets), None
    head = spec.n_triplets * spec.triplet_bits
    stream = unpack_codes(fields["codes"], 1, head + spec.n_tail * spec.bits)
    return _from_bits(stream[..., :head], spec.triplet_bits), _from_bits(stream[..., head:], spec.bits)


def decode_rotated(fields: Fields, spec: OctopusSpec, consts: Consts) -> np.ndarray:
    """The decoded unit vectors in the rotated domain, R u_hat, [b, h, t, d] (gamma not applied)."""
    codes, tail = _unpack(fields, spec)
    i_xi, i_eta, i_rho = _split(spec, codes)
    t_hat = consts["rho_codebook"][i_rho][..., None] * _directions(i_xi, i_eta, consts)
    v_hat = t_hat.reshape(*t_hat.shape[:-2], -1)[..., : spec.head_dim]
    if tail is None:
        return v_hat
    return np.concatenate((v_hat, consts["tail_codebook"][tail]), axis=-1)


def decode(fields: Fields, spec: OctopusSpec, consts: Consts) -> np.ndarray:
    """gamma * R^T v_hat in the original domain, float32 [b, h, t, d]."""
    return fields["norm"][..., None] * unrotate(decode_rotated(fields, spec, consts), consts)


class OctopusKernels:
    """Encode/decode with :func:`encode`/:func:`decode`; attend scores from the rotated codes."""

    def __init__(self, spec: OctopusSpec) -> None:
        self.spec = spec

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> Fields:
        return encode(k, self.spec, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        return decode(fields, self.spec, ctx.consts)

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> Fields:
        if self.spec.values == "fp16":
            return {"data": np.asarray(v, dtype=np.float16)}
        return encode(v, self.spec, ctx.consts)

    def decode_values(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        if self.spec.values == "fp16":
            return fields["data"].astype(np.float32)
        return decode(fields, self.spec, ctx.consts)

    def attend(
        self, q: np.ndarray, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Score gamma_j <R q, v_hat_j> without un-rotating keys; un-rotate the output once."""
        q_rot = rotate_queries(q, ctx.consts, ctx.shape[1])
        k_rot = decode_rotated(kfields, self.spec, ctx.consts)
        if self.spec.values == "fp16":
            return softmax_attend(q_rot, k_rot, vfields["data"], scale, token_scale=kfields["norm"])
        v_rot = vfields["norm"][..., None] * decode_rotated(vfields, self.spec, ctx.consts)
        out_rot, lse = softmax_attend(q_rot, k_rot, v_rot, scale, token_scale=kfields["norm"])
        return unrotate_output(out_rot, ctx.consts, ctx.shape[1]), lse
