"""TurboQuant (MSE) on Triton (mirrors ``kvq_numpy/turboquant.py``; the codec is described in
:mod:`kvq_core.methods.turboquant`). ``high_bits_coords`` > 0 is not served (see ``plugin.supports``).

Host glue in torch: the norm and the rotation (randomized Hadamard or Haar). Triton: the
per-coordinate codebook encoder and packing (:mod:`kvq_triton.codebook`), the decoder
(:mod:`kvq_triton.tiles`) and the fused attention (:class:`kvq_triton.method.TritonMethod`),
which scores n_t <R q, c[idx]_t>.
"""
from __future__ import annotations

import torch

from kvq_core.methods.turboquant import codebook_key, thresholds_key
from kvq_torch.common import Fields, TorchContext
from kvq_torch.rotation import normalize_rotate, rotate, unrotate
from kvq_triton import codebook, tiles
from kvq_triton.method import TritonMethod
from kvq_triton.tiles import CODEBOOK, HEAD_SCALE, Stored


class TurboQuantTriton(TritonMethod):
    """TurboQuant_mse for keys and values."""

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        n, v = normalize_rotate(k, ctx.consts)
        bits = self.spec.bits
        return codebook.coordinate_codes(v, n, bits, ctx.consts[thresholds_key(bits)], ctx.consts[codebook_key(bits)],
                                         self.spec.norm_correction)

    def stored_keys(self, fields: Fields, ctx: TorchContext) -> Stored:
        """Rotated vectors c[idx], each row (or logit) scaled by its stored norm."""
        return Stored(CODEBOOK, fields["codes"], self.spec.bits, ctx.consts[codebook_key(self.spec.bits)],
                      token_scale=fields["norm"], scale_mode=HEAD_SCALE)

    stored_values = stored_keys

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return unrotate(tiles.decode(self.stored_keys(fields, ctx), ctx.shape), ctx.consts)

    encode_values = encode_keys
    decode_values = decode_keys

    def to_codes(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """R x per kv head (the codes are of rotated unit vectors)."""
        return rotate(x, ctx.consts)

    def from_values(self, out: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """R^T out: un-rotate the output once."""
        return unrotate(out, ctx.consts)
