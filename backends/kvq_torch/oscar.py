"""Torch kernels of OScaR (mirrors ``kvq_numpy/oscar.py``; specs/oscar.md 1.2-1.4, 1.6).

Keys: ``u = H k / n_t`` (``n_t`` the L2 norm of token t over every KV head and channel), then
asymmetric min/max codes per (head, channel) over groups of ``key_group`` tokens. Values: ``H v``,
then codes per (token, head) over groups of ``value_group`` channels. Encoding follows the
reference float32 arithmetic step for step (the token norm uses an order-fixed tree sum, so
eager and inductor codes are bit-identical).

``attend`` scores from the packed codes without materialising float32 keys or values, with the
per-group affine identity (c codes, s scale, o offset of one group):

    q . (c*s + o) = (q*s) . c + q . o            (keys: groups of tokens share s, o per channel)
    sum_t p_t (c_t*s_t + o_t) = sum_t (p_t*s_t) c_t + sum_t p_t o_t   (values: per token group of channels)

so the only O(tokens * head_dim) work is a product over small integer codes (uint8 cast to
float32 chunk by chunk); the rotation is applied once to the query and once to the output.
"""
from __future__ import annotations

import torch

from kvq_core.dispatch.ops import materialize
from kvq_torch.common import (
    Fields,
    TorchContext,
    TorchMethod,
    asym_dequantize,
    asym_quantize,
    group_channels,
    group_tokens,
    hadamard_rotate,
    pack_codes,
    softmax_attend,
    sqrt32,
    tree_sum,
    ungroup_tokens,
    unpack_codes,
)


def token_norms(kr: torch.Tensor) -> torch.Tensor:
    """OTS norm ``[batch, tokens]`` (float32) over every KV head and channel; 1 where not > 0."""
    b, h, t, d = kr.shape
    sq = (kr * kr).permute(0, 2, 1, 3).reshape(b, t, h * d)
    n = sqrt32(tree_sum(sq, -1))
    return torch.where(n > 0, n, 1.0)


class OscarTorch(TorchMethod):
    """OScaR on torch, float32 throughout."""

    def _rotate(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """``x @ H`` (H is its own inverse) with :func:`hadamard_rotate`: one matmul (plus butterfly
        stages above 128 coordinates) in eager and compiled code alike (bit-identical codes), exact
        where the reference butterfly is."""
        return hadamard_rotate(x, ctx.consts["hadamard"]) if self.spec.rotation else x.to(torch.float32)

    def _codes(self, fields: Fields) -> torch.Tensor:
        return unpack_codes(fields["codes"], self.spec.bits, self.spec.head_dim, torch.uint8)

    def _unit_keys(self, fields: Fields, tokens) -> torch.Tensor:
        codes = group_tokens(self._codes(fields), self.spec.key_group)
        return ungroup_tokens(asym_dequantize(codes, fields["scale"], fields["offset"], dim=3), tokens)

    def _rotated_values(self, fields: Fields) -> torch.Tensor:
        codes = group_channels(self._codes(fields), self.spec.value_group)
        v = asym_dequantize(codes, fields["scale"], fields["offset"], dim=4)
        return v.reshape(*v.shape[:-2], self.spec.head_dim)

    # -- kernels ----------------------------------------------------------------------------
    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        kr = self._rotate(k, ctx)
        norm = token_norms(kr) if self.spec.token_scaling else None
        u = kr if norm is None else kr / norm[:, None, :, None]
        codes, scale, offset = asym_quantize(group_tokens(u, self.spec.key_group), self.spec.bits, dim=3)
        fields = {"codes": pack_codes(ungroup_tokens(codes, k.shape[2]), self.spec.bits), "scale": scale, "offset": offset}
        if norm is not None:
            fields["norm"] = norm
        return fields

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        k = self._unit_keys(fields, ctx.shape[2])
        if self.spec.token_scaling:
            k = k * fields["norm"][:, None, :, None]
        return self._rotate(k, ctx)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        codes, scale, offset = asym_quantize(group_channels(self._rotate(v, ctx), self.spec.value_group), self.spec.bits, dim=4)
        return {"codes": pack_codes(codes.reshape(v.shape), self.spec.bits), "scale": scale, "offset": offset}

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._rotate(self._rotated_values(fields), ctx)

    def attend(self, q, kfields: Fields, vfields: Fields, ctx: TorchContext, scale):
        """Rotate q once, score the unit keys times ``n_t``, un-rotate the output once.

        Under torch.compile (the ``torch-compiled`` backend) with 1/2/4/8-bit codes this scores
        straight from the packed bytes (:meth:`_attend_packed`); eagerly it decodes the unit keys
        and rotated values and uses matmuls (eager broadcasting would materialise far more).
        """
        if torch.compiler.is_compiling() and self._packed_attend_ok():
            return self._attend_packed(q, kfields, vfields, ctx, scale)
        norm = kfields["norm"][:, None, :] if self.spec.token_scaling else None
        keys = self._unit_keys(kfields, ctx.shape[2])
        out, lse = softmax_attend(self._rotate(q, ctx), keys, self._rotated_values(vfields), scale, token_scale=norm)
        return self._rotate(out, ctx), lse

    def _packed_attend_ok(self) -> bool:
        per = 8 // self.spec.bits if 8 % self.spec.bits == 0 else 0
        return per > 0 and self.spec.value_group % per == 0

    def _attend_packed(self, q, kfields: Fields, vfields: Fields, ctx: TorchContext, scale):
        """Attention from the packed codes, never materialising float K or V.

        A code byte holds ``per = 8 // bits`` codes: channel ``c = per * j + k`` is
        ``(byte[j] >> bits * k) & mask``. Keys: per token group T and query row,
        ``logit = sum_{k,j} (q*s_T)[per*j+k] * code + q . o_T`` (one fused reduction over the
        bytes of each token, the code planes unpacked in registers). Values: with ``w`` the
        softmax weights, ``out[c] = sum_t (w_t s_t,cg) code_t,c + sum_t w_t o_t,cg`` per channel
        group cg (one fused reduction over tokens).
        """
        spec = self.spec
        b, hq, lq, d = q.shape
        hk, t = ctx.shape[1], ctx.shape[2]
        g = (hq // hk) * lq
        bits = spec.bits
        per, mask = 8 // bits, (1 << bits) - 1
        nb = d // per
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
        qr = self._rotate(q, ctx).reshape(b, hk, g, d)
        # keys: logits [b, hk, g, t]; query and key scales in (k, j) channel order, materialised
        # so the fused reduction runs over the code bytes j with contiguous loads
        grp = spec.key_group
        ks, ko = kfields["scale"].to(torch.float32), kfields["offset"].to(torch.float32)  # [b, hk, ng, d]
        ng = ks.shape[2]
        qo = (qr[:, :, :, None, :] * ko[:, :, None]).sum(-1)                              # [b, hk, g, ng]
        qp = materialize(qr.reshape(b, hk, g, nb, per).transpose(-1, -2))                 # [b, hk, g, per, nb]
        kp = materialize(ks.reshape(b, hk, ng, nb, per).transpose(-1, -2))                # [b, hk, ng, per, nb]
        kc = group_tokens(kfields["codes"], grp)                                           # [b, hk, ng, grp, nb]
        planes = ((kc[..., None, :] >> shifts[:, None]) & mask).to(torch.float32)         # [b, hk, ng, grp, per, nb]
        qs = qp[:, :, :, None] * kp[:, :, None]                                            # [b, hk, g, ng, per, nb]
        logits = (qs[:, :, :, :, None] * planes[:, :, None]).sum((-1, -2)) + qo[..., None]
        logits = logits.reshape(b, hk, g, ng * grp)[..., :t]
        if spec.token_scaling:
            logits = logits * kfields["norm"][:, None, None, :]
        logits = logits * scale
        m = logits.amax(dim=-1, keepdim=True)
        p = torch.exp(logits - m)
        den = p.sum(dim=-1, keepdim=True)
        # values: out [b, hk, g, d]. Codes and scales transposed to token-minor order
        # (materialised, one pass over 1/16 of the fp32 bytes) so the reduction over tokens runs
        # with contiguous vector loads.
        vs, vo = vfields["scale"].to(torch.float32), vfields["offset"].to(torch.float32)  # [b, hk, t, ncg]
        ncg = vs.shape[-1]
        vg = d // ncg
        w = vg // per
        po = (p[..., None] * vo[:, :, None]).sum(-2)                                       # [b, hk, g, ncg]
        vcT = materialize(vfields["codes"].transpose(-1, -2)).reshape(b, hk, ncg, w, t)   # [b, hk, ncg, w, t]
        vsT = materialize(vs.transpose(-1, -2))                                            # [b, hk, ncg, t]
        vplanes = ((vcT[:, :, :, None] >> shifts[:, None, None]) & mask).to(torch.float32)  # [b, hk, ncg, per, w, t]
        pw = p[:, :, :, None, :] * vsT[:, :, None]                                         # [b, hk, g, ncg, t]
        o1 = (pw[:, :, :, :, None, None, :] * vplanes[:, :, None]).sum(-1)                 # [b, hk, g, ncg, per, w]
        o1 = o1.transpose(-1, -2).reshape(b, hk, g, ncg, vg)                               # c = cg*vg + per*jj + k
        out = ((o1 + po[..., None]) / den[..., None]).reshape(b, hq, lq, d)
        lse = (m + torch.log(den)).reshape(b, hq, lq)
        return self._rotate(out, ctx), lse
