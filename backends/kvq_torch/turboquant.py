"""Torch kernels of TurboQuant (mirrors ``kvq_numpy/turboquant.py``; the codecs are described in
:mod:`kvq_core.methods.turboquant`).

Encoding runs in float32 with the reference's order (norms through :func:`kvq_torch.rotation.norm`),
so with the Hadamard rotation the fields match the NumPy backend bit for bit. A Haar rotation and
the QJL sketch are float32 matmuls whose summation order is the BLAS's: there a code can differ
only where a value sits within rounding of a threshold (or of 0, for a sign), and a norm taken
after the matmul (``residual_norm``, a norm-corrected ``norm``) by an ulp. Keys and values stay in
the rotated domain inside ``attend``: the query is rotated once, the output un-rotated once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvq_core.methods.turboquant import TurboQuantProdSpec, TurboQuantSpec, codebook_key, thresholds_key
from kvq_torch.common import (
    Consts,
    Fields,
    TorchContext,
    TorchMethod,
    codebook_quantize,
    pack_codes,
    softmax_attend,
    softmax_combine,
    unpack_codes,
)
from kvq_torch.sketch import encode_signs, qjl_reconstruct, qjl_scores, sketch
from kvq_torch.rotation import by_kv_head, from_kv_head, norm, normalize_rotate, rotate, rotate_queries, unrotate, unrotate_output


class CoordCode(NamedTuple):
    """One code field of :class:`CoordCodec`: rotated coordinates [start, stop) at ``bits`` bits,
    with the constants' names of that bit width's codebook and thresholds."""

    field: str
    start: int
    stop: int
    bits: int
    codebook: str
    thresholds: str


class CoordCodec:
    """The per-coordinate codebook stage of one :class:`TurboQuantSpec`, resolved once outside
    traced code (the constants' names are formatted here, not from symbolic ints in a graph)."""

    def __init__(self, spec: TurboQuantSpec) -> None:
        self.head_dim = spec.head_dim
        self.norm_correction = spec.norm_correction
        self.codes = tuple(
            CoordCode(g.field, g.start, g.stop, g.bits, codebook_key(g.bits), thresholds_key(g.bits))
            for g in spec.coord_groups()
        )

    def quantize(self, v: torch.Tensor, consts: Consts) -> tuple[Fields, torch.Tensor]:
        """Nearest-centroid codes of rotated unit vectors v: the packed code fields and c[idx] (float32)."""
        fields, c = {}, torch.empty_like(v, dtype=torch.float32)
        for code in self.codes:
            idx = codebook_quantize(v[..., code.start : code.stop], consts[code.thresholds])
            fields[code.field] = pack_codes(idx, code.bits)
            c[..., code.start : code.stop] = consts[code.codebook][idx]
        return fields, c

    def dequantize(self, fields: Fields, consts: Consts) -> torch.Tensor:
        """c[idx] [b, h, t, d] (float32), the decoded rotated unit vectors."""
        packed = fields[self.codes[0].field]
        c = packed.new_empty((*packed.shape[:-1], self.head_dim), dtype=torch.float32)
        for code in self.codes:
            idx = unpack_codes(fields[code.field], code.bits, code.stop - code.start)
            c[..., code.start : code.stop] = consts[code.codebook][idx]
        return c

    def encode(self, x: torch.Tensor, consts: Consts) -> Fields:
        """TurboQuant_mse code fields and ``norm`` (n, or n / ||c[idx]|| with norm correction)."""
        n, v = normalize_rotate(x, consts)
        fields, c = self.quantize(v, consts)
        if self.norm_correction:
            n = n / norm(c)
        fields["norm"] = n
        return fields

    def decode_rotated(self, fields: Fields, consts: Consts) -> torch.Tensor:
        """norm * c[idx]: a TurboQuant_mse block decoded in the rotated domain."""
        return fields["norm"].unsqueeze(-1) * self.dequantize(fields, consts)


def encode_prod(x: torch.Tensor, stage: CoordCodec, consts: Consts) -> Fields:
    """TurboQuant_prod: (b-1)-bit codes of v = R x / n, signs of S r for r = v - c[idx], ||r|| and n."""
    n, v = normalize_rotate(x, consts)
    fields, c = stage.quantize(v, consts)
    r = v - c
    fields.update(qjl=encode_signs(r, consts["sketch"]), norm=n, residual_norm=norm(r))
    return fields


def decode_prod_rotated(fields: Fields, stage: CoordCodec, consts: Consts) -> torch.Tensor:
    """n (c[idx] + sqrt(pi/2)/d gamma S^T h) in the rotated domain."""
    unit = stage.dequantize(fields, consts)
    unit = unit + qjl_reconstruct(fields["qjl"], fields["residual_norm"], consts["sketch"])
    return fields["norm"].unsqueeze(-1) * unit


def prod_scores(q_rot: torch.Tensor, fields: Fields, stage: CoordCodec, consts: Consts) -> torch.Tensor:
    """n_t (<q', c_t> + sqrt(pi/2)/d gamma_t <S q', h_t>) for rotated queries q' [b, h, n, d]: [b, h, n, t]."""
    mse = torch.matmul(q_rot, stage.dequantize(fields, consts).transpose(-1, -2))
    residual = qjl_scores(sketch(q_rot, consts["sketch"]), fields["qjl"], fields["residual_norm"])
    return (mse + residual) * fields["norm"].unsqueeze(2)


class TurboQuantTorch(TorchMethod):
    """TurboQuant_mse for keys and values; attend scores n <R q, c[idx]> from the codes."""

    spec: TurboQuantSpec

    def __init__(self, spec: TurboQuantSpec) -> None:
        super().__init__(spec)
        self.codec = CoordCodec(spec)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return self.codec.encode(k, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return unrotate(self.codec.decode_rotated(fields, ctx.consts), ctx.consts)

    def attend(
        self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score n_t <R q, c[idx]_t> from the codes; un-rotate the output once."""
        consts, kv_heads = ctx.consts, kfields["norm"].shape[1]
        q_rot = rotate_queries(q, consts, kv_heads)
        k_unit = self.codec.dequantize(kfields, consts)
        v_rot = self.codec.decode_rotated(vfields, consts)
        out, lse = softmax_attend(q_rot, k_unit, v_rot, scale, token_scale=kfields["norm"])
        return unrotate_output(out, consts, kv_heads), lse


class TurboQuantProdTorch(TorchMethod):
    """TurboQuant_prod keys (and values unless ``values="mse"``); attend scores by the unbiased estimator."""

    spec: TurboQuantProdSpec

    def __init__(self, spec: TurboQuantProdSpec) -> None:
        super().__init__(spec)
        self.stage = CoordCodec(spec.mse_stage)
        self.value_codec = CoordCodec(spec.value_codec) if spec.values == "mse" else None

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return encode_prod(k, self.stage, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        """n R^T (c[idx] + sqrt(pi/2)/d gamma S^T h): <q, k_hat> equals the attend score."""
        return unrotate(decode_prod_rotated(fields, self.stage, ctx.consts), ctx.consts)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        if self.value_codec is not None:
            return self.value_codec.encode(v, ctx.consts)
        return self.encode_keys(v, ctx)

    def _decode_values_rotated(self, fields: Fields, consts: Consts) -> torch.Tensor:
        if self.value_codec is not None:
            return self.value_codec.decode_rotated(fields, consts)
        return decode_prod_rotated(fields, self.stage, consts)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return unrotate(self._decode_values_rotated(fields, ctx.consts), ctx.consts)

    def attend(
        self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score the rotated queries by :func:`prod_scores`; un-rotate the output once."""
        consts = ctx.consts
        q_rot = rotate(by_kv_head(q, kfields["norm"].shape[1]), consts)
        logits = prod_scores(q_rot, kfields, self.stage, consts)
        out, lse = softmax_combine(logits * scale, self._decode_values_rotated(vfields, consts), tuple(q_rot.shape))
        return from_kv_head(unrotate(out, consts), tuple(q.shape)), from_kv_head(lse, tuple(q.shape))
