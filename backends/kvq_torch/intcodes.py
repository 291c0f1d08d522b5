"""Torch kernels of the integer-code methods (OScaR, KIVI, QuaRot; mirrors ``kvq_numpy/intcodes.py``).

One class serves every :class:`~kvq_core.methods.intcodes.IntCodeRecipe`: keys ``u = H k / n_t``
(H when the recipe rotates, ``n_t`` the L2 norm of token t over every KV head and channel when it
has the token norm), values ``H v``, each coded by the asymmetric min/max group quantizer of
common.py over the recipe's groups (along tokens or channels, integer or float zero-point,
clipped range). Encoding follows the reference float32 arithmetic step for step (the token norm
uses an order-fixed tree sum, so eager and inductor codes are bit-identical).

Under torch.compile, ``attend`` for keys grouped along tokens and values along channels (OScaR,
KIVI) scores from the packed codes without materialising float32 keys or values, with the
per-group affine identity (c codes, s scale, o offset of one group):

    q . (c*s + o) = (q*s) . c + q . o            (keys: groups of tokens share s, o per channel)
    sum_t p_t (c_t*s_t + o_t) = sum_t (p_t*s_t) c_t + sum_t p_t o_t   (values: per token group of channels)

so the only O(tokens * head_dim) work is a product over small integer codes (uint8 cast to
float32 chunk by chunk); the rotation is applied once to the query and once to the output.
"""
from __future__ import annotations

import torch

from kvq_core.torch_ops.ops import materialize
from kvq_core.methods.intcodes import CHANNELS, TOKENS, IntGroups
from kvq_torch.common import (
    Fields,
    TorchContext,
    TorchMethod,
    asym_dequantize,
    asym_quantize,
    group_channels,
    group_range,
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


def grouped(x: torch.Tensor, groups: IntGroups) -> tuple[torch.Tensor, int]:
    """``x [b, h, t, d]`` viewed as the recipe's groups, and the dim that runs within a group:
    ``[b, h, ceil(t/size), size, d]`` (dim 3) along tokens, ``[b, h, t, d/size, size]`` (dim 4) along channels."""
    if groups.axis == TOKENS:
        return group_tokens(x, groups.size), 3
    return group_channels(x, groups.size), 4


def ungrouped(x: torch.Tensor, groups: IntGroups, tokens) -> torch.Tensor:
    """Inverse of :func:`grouped` (``tokens``: the block's token count, dropping the padding)."""
    if groups.axis == TOKENS:
        return ungroup_tokens(x, tokens)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


class IntCodesTorch(TorchMethod):
    """An integer-code method on torch (any spec with a ``recipe``), float32 throughout."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.recipe = spec.recipe

    # -- ingredients ------------------------------------------------------------------------
    def _rotate(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """``x @ H`` (H is its own inverse) with :func:`hadamard_rotate`: one matmul (plus butterfly
        stages above 128 coordinates) in eager and compiled code alike (bit-identical codes), exact
        where the reference butterfly is; float32 ``x`` when the recipe does not rotate."""
        return hadamard_rotate(x, ctx.consts["hadamard"]) if self.recipe.rotates else x.to(torch.float32)

    def _coded(self, x: torch.Tensor, ctx: TorchContext, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the quantizer codes for ``kind``: ``H x``, for keys with the token norm divided by
        it, and the norm (None without)."""
        xr = self._rotate(x, ctx)
        if kind != "keys" or not self.recipe.token_norm:
            return xr, None
        norm = token_norms(xr)
        return xr / norm[:, None, :, None], norm

    def _encode(self, x: torch.Tensor, groups: IntGroups) -> Fields:
        g, dim = grouped(x, groups)
        codes, scale, offset = asym_quantize(g, groups.bits, dim, groups.zero_point, self.recipe.clip_ratio)
        return {"codes": pack_codes(ungrouped(codes, groups, x.shape[2]), groups.bits), "scale": scale, "offset": offset}

    def _decode(self, fields: Fields, groups: IntGroups, tokens) -> torch.Tensor:
        """Dequantized entries in the domain they were coded in (rotated, and normalised for keys with OTS)."""
        codes, dim = grouped(unpack_codes(fields["codes"], groups.bits, self.spec.head_dim, torch.uint8), groups)
        return ungrouped(asym_dequantize(codes, fields["scale"], fields["offset"], dim), groups, tokens)

    # -- kernels ----------------------------------------------------------------------------
    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        u, norm = self._coded(k, ctx, "keys")
        fields = self._encode(u, self.recipe.keys)
        if norm is not None:
            fields["norm"] = norm
        return fields

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        k = self._decode(fields, self.recipe.keys, ctx.shape[2])
        if self.recipe.token_norm:
            k = k * fields["norm"][:, None, :, None]
        return self._rotate(k, ctx)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return self._encode(self._coded(v, ctx, "values")[0], self.recipe.values)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._rotate(self._decode(fields, self.recipe.values, ctx.shape[2]), ctx)

    def clips(self, kind: str) -> bool:
        """``clip_ratio`` < 1 cuts each group's range (QuaRot's clipping)."""
        return self.recipe.clip_ratio < 1.0

    def ste_grad(self, x: torch.Tensor, grad: torch.Tensor, ctx: TorchContext, kind: str) -> torch.Tensor:
        """Straight-through: exact through the rotation, zero for coded entries outside their
        group's clipped range (``H`` is its own inverse: ``H (m * H g)``)."""
        groups = self.recipe.groups(kind)
        g, dim = grouped(self._coded(x, ctx, kind)[0], groups)
        mn, mx = group_range(g, dim, self.recipe.clip_ratio)
        kept = ungrouped((g >= mn) & (g <= mx), groups, x.shape[2])
        return self._rotate(self._rotate(grad, ctx) * kept, ctx)

    def attend(self, q, kfields: Fields, vfields: Fields, ctx: TorchContext, scale):
        """Rotate q once, score the coded keys times ``n_t``, un-rotate the output once.

        Under torch.compile (the ``torch-compiled`` backend) with 1/2/4/8-bit codes grouped as
        OScaR's and KIVI's this scores straight from the packed bytes (:meth:`_attend_packed`);
        eagerly it decodes the coded keys and values and uses matmuls (eager broadcasting would
        materialise far more).
        """
        if torch.compiler.is_compiling() and self._packed_attend_ok():
            return self._attend_packed(q, kfields, vfields, ctx, scale)
        norm = kfields["norm"][:, None, :] if self.recipe.token_norm else None
        keys = self._decode(kfields, self.recipe.keys, ctx.shape[2])
        values = self._decode(vfields, self.recipe.values, ctx.shape[2])
        out, lse = softmax_attend(self._rotate(q, ctx), keys, values, scale, token_scale=norm)
        return self._rotate(out, ctx), lse

    def _packed_attend_ok(self) -> bool:
        keys, values = self.recipe.keys, self.recipe.values
        if keys.axis != TOKENS or values.axis != CHANNELS or keys.bits != values.bits:
            return False
        per = 8 // keys.bits if 8 % keys.bits == 0 else 0
        return per > 0 and values.size % per == 0

    def _attend_packed(self, q, kfields: Fields, vfields: Fields, ctx: TorchContext, scale):
        """Attention from the packed codes, never materialising float K or V.

        A code byte holds ``per = 8 // bits`` codes: channel ``c = per * j + k`` is
        ``(byte[j] >> bits * k) & mask``. Keys: per token group T and query row,
        ``logit = sum_{k,j} (q*s_T)[per*j+k] * code + q . o_T`` (one fused reduction over the
        bytes of each token, the code planes unpacked in registers). Values: with ``w`` the
        softmax weights, ``out[c] = sum_t (w_t s_t,cg) code_t,c + sum_t w_t o_t,cg`` per channel
        group cg (one fused reduction over tokens).
        """
        b, hq, lq, d = q.shape
        hk, t = ctx.shape[1], ctx.shape[2]
        g = (hq // hk) * lq
        bits = self.recipe.keys.bits
        per, mask = 8 // bits, (1 << bits) - 1
        nb = d // per
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
        qr = self._rotate(q, ctx).reshape(b, hk, g, d)
        # keys: logits [b, hk, g, t]; query and key scales in (k, j) channel order, materialised
        # so the fused reduction runs over the code bytes j with contiguous loads
        grp = self.recipe.keys.size
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
        if self.recipe.token_norm:
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
