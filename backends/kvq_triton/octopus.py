"""OCTOPUS on Triton (mirrors ``kvq_numpy/octopus.py``; the codec is described in
:mod:`kvq_core.methods.octopus`).

Host glue in torch: the norm and the seeded Hadamard rotation (the torch backend's helpers).
Triton: the triplet encoder and packing (:mod:`kvq_triton.codebook`), the decoder
(:mod:`kvq_triton.tiles`: rho codebook x direction table per triplet) and the fused attention
(:class:`kvq_triton.method.TritonMethod`), which rebuilds the rotated keys in registers and
scales each logit by the key norm.
"""
from __future__ import annotations

import torch

from kvq_torch.common import Fields, TorchContext
from kvq_torch.rotation import normalize_rotate, rotate, unrotate
from kvq_triton import codebook, tiles
from kvq_triton.method import TritonMethod
from kvq_triton.tiles import DENSE, HEAD_SCALE, TRIPLETS, Stored


class OctopusTriton(TritonMethod):
    """Encode to triplet codes; attend scores from the rotated codes."""

    def _encode(self, x: torch.Tensor, ctx: TorchContext) -> Fields:
        gamma, v = normalize_rotate(x, ctx.consts)
        spec = self.spec
        codes = codebook.triplet_codes(v, spec.triplet_bits, spec.n_triplets, spec.rho_bits,
                                       spec.rounding == "joint", ctx.consts)
        return {"codes": codes, "norm": gamma}

    def _stored(self, fields: Fields, ctx: TorchContext) -> Stored:
        """Rotated vectors, each row (or logit) scaled by its norm."""
        return Stored(TRIPLETS, fields["codes"], self.spec.triplet_bits, ctx.consts["rho_codebook"],
                      ctx.consts["directions"], rho_bits=self.spec.rho_bits, token_scale=fields["norm"],
                      scale_mode=HEAD_SCALE)

    def _decode(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        """gamma * R^T v_hat: the rotated decode un-rotated (gamma commutes with R^T)."""
        return unrotate(tiles.decode(self._stored(fields, ctx), ctx.shape), ctx.consts)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return self._encode(k, ctx)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._decode(fields, ctx)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        if self.spec.values == "fp16":
            return {"data": v.to(torch.float32).to(torch.float16)}
        return self._encode(v, ctx)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        if self.spec.values == "fp16":
            return fields["data"].to(torch.float32)
        return self._decode(fields, ctx)

    def stored_keys(self, fields: Fields, ctx: TorchContext) -> Stored:
        return self._stored(fields, ctx)

    def stored_values(self, fields: Fields, ctx: TorchContext) -> Stored:
        return Stored(DENSE, fields["data"]) if self.spec.values == "fp16" else self._stored(fields, ctx)

    def to_codes(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """R x per kv head: scores are gamma_j <R q, v_hat_j>."""
        return rotate(x, ctx.consts)

    def to_values(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        return x.to(torch.float32) if self.spec.values == "fp16" else rotate(x, ctx.consts)

    def from_values(self, out: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """Un-rotate once (coded values live in the rotated domain; fp16 values do not)."""
        return out.to(torch.float32) if self.spec.values == "fp16" else unrotate(out, ctx.consts)
