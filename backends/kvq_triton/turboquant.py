"""TurboQuant (MSE) on Triton (mirrors ``kvq_numpy/turboquant.py``; the codec is described in
:mod:`kvq_core.methods.turboquant`). ``high_bits_coords`` > 0 is not served (see ``plugin.supports``).

Host glue in torch: the norm and the rotation (randomized Hadamard or Haar). Triton: the
per-coordinate codebook encoder and packing (:mod:`kvq_triton.codebook`), the decoder
(:mod:`kvq_triton.tiles`) and the fused attention, which scores n_t <R q, c[idx]_t>.
"""
from __future__ import annotations

import torch

from kvq_core.methods.turboquant import codebook_key, thresholds_key
from kvq_torch.common import Fields, TorchContext, TorchMethod
from kvq_torch.rotation import normalize_rotate, rotate_queries, unrotate, unrotate_output
from kvq_triton import attention, codebook, tiles
from kvq_triton.tiles import CODEBOOK, HEAD_SCALE, Stored


class TurboQuantTriton(TorchMethod):
    """TurboQuant_mse for keys and values."""

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        n, v = normalize_rotate(k, ctx.consts)
        bits = self.spec.bits
        return codebook.coordinate_codes(v, n, bits, ctx.consts[thresholds_key(bits)], ctx.consts[codebook_key(bits)],
                                         self.spec.norm_correction)

    def _stored(self, fields: Fields, ctx: TorchContext) -> Stored:
        """Rotated vectors c[idx], each row (or logit) scaled by its stored norm."""
        return Stored(CODEBOOK, fields["codes"], self.spec.bits, ctx.consts[codebook_key(self.spec.bits)],
                      token_scale=fields["norm"], scale_mode=HEAD_SCALE)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return unrotate(tiles.decode(self._stored(fields, ctx), ctx.shape), ctx.consts)

    encode_values = encode_keys
    decode_values = decode_keys

    def attend(self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float):
        """Score n_t <R q, c[idx]_t> from the codes; un-rotate the output once."""
        b, hq, lq, d = q.shape
        hk = ctx.shape[1]
        q_rot = rotate_queries(q, ctx.consts, hk).reshape(b, hk, -1, d)
        out, lse = attention.attend(q_rot, self._stored(kfields, ctx), self._stored(vfields, ctx), scale)
        return unrotate_output(out.reshape(b, hq, lq, d), ctx.consts, hk), lse.reshape(b, hq, lq)
