"""NumPy reference kernels of TurboQuant (the codecs are described in :mod:`kvq_core.methods.turboquant`).

Encoding runs in float32 (the precision GPU kernels use); scoring in float64. Keys and values
stay in the rotated domain inside ``attend``: the query is rotated once and the output is
un-rotated once, so no key is ever decoded to the original domain.
"""
from __future__ import annotations

import numpy as np

from kvq_core.contract import KernelContext
from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.methods.turboquant import TurboQuantProdSpec, TurboQuantSpec, codebook_key, thresholds_key
from kvq_numpy.attention import by_kv_head, from_kv_head, softmax_attend, softmax_over_logits
from kvq_numpy.sketch import encode_signs, qjl_reconstruct, qjl_scores, sketch
from kvq_numpy.rotation import normalize_rotate, rotate, rotate_queries, unrotate, unrotate_output

Consts = dict[str, np.ndarray]
Fields = dict[str, np.ndarray]


def quantize_coords(v: np.ndarray, spec: TurboQuantSpec, consts: Consts) -> tuple[Fields, np.ndarray]:
    """Nearest-centroid codes of rotated unit vectors v: the packed code fields and c[idx] (float32)."""
    fields, c = {}, np.empty_like(v, dtype=np.float32)
    for field, start, stop, bits in spec.coord_groups():
        idx = np.searchsorted(consts[thresholds_key(bits)], v[..., start:stop], side="right")
        fields[field] = pack_codes(idx, bits)
        c[..., start:stop] = consts[codebook_key(bits)][idx]
    return fields, c


def dequantize_coords(fields: Fields, spec: TurboQuantSpec, consts: Consts) -> np.ndarray:
    """c[idx] [b, h, t, d] (float32), the decoded rotated unit vectors."""
    groups = spec.coord_groups()
    lead = fields[groups[0].field].shape[:-1]
    c = np.empty((*lead, spec.head_dim), dtype=np.float32)
    for field, start, stop, bits in groups:
        c[..., start:stop] = consts[codebook_key(bits)][unpack_codes(fields[field], bits, stop - start)]
    return c


def encode_mse(x: np.ndarray, spec: TurboQuantSpec, consts: Consts) -> Fields:
    """TurboQuant_mse code fields and ``norm`` (n, or n / ||c[idx]|| with norm correction)."""
    n, v = normalize_rotate(x, consts)
    fields, c = quantize_coords(v, spec, consts)
    if spec.norm_correction:
        n = n / np.linalg.norm(c, axis=-1)
    fields["norm"] = n.astype(np.float32)
    return fields


def decode_mse_rotated(fields: Fields, spec: TurboQuantSpec, consts: Consts) -> np.ndarray:
    """norm * c[idx]: a TurboQuant_mse block decoded in the rotated domain."""
    return fields["norm"][..., None] * dequantize_coords(fields, spec, consts)


def encode_prod(x: np.ndarray, spec: TurboQuantProdSpec, consts: Consts) -> Fields:
    """TurboQuant_prod: (b-1)-bit codes of v = R x / n, signs of S r for r = v - c[idx], ||r|| and n."""
    n, v = normalize_rotate(x, consts)
    fields, c = quantize_coords(v, spec.mse_stage, consts)
    r = v - c
    fields.update(qjl=encode_signs(r, consts["sketch"]), norm=n, residual_norm=np.linalg.norm(r, axis=-1))
    return fields


def decode_prod_rotated(fields: Fields, spec: TurboQuantProdSpec, consts: Consts) -> np.ndarray:
    """n (c[idx] + sqrt(pi/2)/d gamma S^T h) in the rotated domain."""
    unit = dequantize_coords(fields, spec.mse_stage, consts)
    unit += qjl_reconstruct(fields["qjl"], fields["residual_norm"], consts["sketch"])
    return fields["norm"][..., None] * unit


def prod_scores(q_rot: np.ndarray, fields: Fields, spec: TurboQuantProdSpec, consts: Consts) -> np.ndarray:
    """n_t (<q', c_t> + sqrt(pi/2)/d gamma_t <S q', h_t>) for rotated queries q' [b, h, n, d]: [b, h, n, t]."""
    mse = q_rot @ np.swapaxes(dequantize_coords(fields, spec.mse_stage, consts), -1, -2).astype(np.float64)
    residual = qjl_scores(sketch(q_rot, consts["sketch"]), fields["qjl"], fields["residual_norm"])
    return (mse + residual) * fields["norm"].astype(np.float64)[:, :, None, :]


class TurboQuantKernels:
    """TurboQuant_mse for keys and values; attend scores n <R q, c[idx]> from the codes."""

    def __init__(self, spec: TurboQuantSpec) -> None:
        self.spec = spec

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> Fields:
        return encode_mse(k, self.spec, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        return unrotate(decode_mse_rotated(fields, self.spec, ctx.consts), ctx.consts)

    encode_values = encode_keys
    decode_values = decode_keys

    def attend(
        self, q: np.ndarray, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Score n_t <R q, c[idx]_t> from the codes; un-rotate the output once."""
        consts, kv_heads = ctx.consts, ctx.shape[1]
        q_rot = rotate_queries(np.asarray(q, np.float64), consts, kv_heads)
        k_unit = dequantize_coords(kfields, self.spec, consts)
        v_rot = decode_mse_rotated(vfields, self.spec, consts)
        out, lse = softmax_attend(q_rot, k_unit, v_rot, scale, token_scale=kfields["norm"])
        return unrotate_output(out, consts, kv_heads), lse


class TurboQuantProdKernels:
    """TurboQuant_prod keys (and values unless ``values="mse"``); attend scores by the unbiased estimator."""

    def __init__(self, spec: TurboQuantProdSpec) -> None:
        self.spec = spec

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> Fields:
        return encode_prod(k, self.spec, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        """n R^T (c[idx] + sqrt(pi/2)/d gamma S^T h): <q, k_hat> equals the attend score."""
        return unrotate(decode_prod_rotated(fields, self.spec, ctx.consts), ctx.consts)

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> Fields:
        if self.spec.values == "mse":
            return encode_mse(v, self.spec.value_codec, ctx.consts)
        return self.encode_keys(v, ctx)

    def _decode_values_rotated(self, fields: Fields, consts: Consts) -> np.ndarray:
        if self.spec.values == "mse":
            return decode_mse_rotated(fields, self.spec.value_codec, consts)
        return decode_prod_rotated(fields, self.spec, consts)

    def decode_values(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        return unrotate(self._decode_values_rotated(fields, ctx.consts), ctx.consts)

    def attend(
        self, q: np.ndarray, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Score the rotated queries by :func:`prod_scores`; un-rotate the output once."""
        consts = ctx.consts
        q_rot = rotate(by_kv_head(np.asarray(q, np.float64), ctx.shape[1]), consts)
        logits = prod_scores(q_rot, kfields, self.spec, consts)
        out, lse = softmax_over_logits(logits, self._decode_values_rotated(vfields, consts), scale)
        return from_kv_head(unrotate(out, consts), q.shape), from_kv_head(lse, q.shape)
