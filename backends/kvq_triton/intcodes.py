"""The integer-code methods on Triton (mirrors ``kvq_numpy/intcodes.py``; specs/oscar.md 1.2-1.4 and 2).

:class:`IntCodesTriton` serves a spec's :class:`~kvq_core.methods.intcodes.IntCodeRecipe`
(OScaR, KIVI; QuaRot's clipped per-token groups are not served: ``plugin.supports`` keeps it
out). Host glue in torch: the Hadamard rotation as one matmul and the omni-token norm (the
torch backend's helpers, so the float32 input to the quantizer is the same). Triton: the
asymmetric min/max group quantizer of ``kvq_numpy/intquant.py`` and packing (:func:`quantize`),
the tile decoder (:mod:`kvq_triton.tiles`), and the fused attention (:class:`kvq_triton.method.TritonMethod`:
one block, or a layer's blocks and its exact window), which multiplies each logit by the token norm.

A block is viewed as ``x [A, L, C]`` with groups of ``group`` consecutive entries along L:
keys ``[b*h, tokens, d]`` (per channel over token groups), values ``[b*h*tokens, d, 1]`` (per
token over channel groups). The stats are ``[A, ceil(L/group), C]``, the layout's shape. The
float32 arithmetic is the reference's step for step (correctly rounded division, round half to
even, launched without FMA contraction), so the codes are bit-identical for the same input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_core.errors import BackendUnavailableError
from kvq_core.methods.intcodes import TOKENS, ZERO_INTEGER, IntGroups
from kvq_torch.common import Fields, TorchContext, hadamard_rotate
from kvq_torch.intcodes import token_norms
from kvq_triton import config, tiles
from kvq_triton.method import TritonMethod
from kvq_triton.packing import pack_rows
from kvq_triton.tiles import BATCH_SCALE, INT_CHANNELS, INT_TOKENS, NO_SCALE, Stored


@triton.jit
def rint(x):
    """Round half to even in float32 without libdevice: adding and removing 2**23 leaves an
    integer for |x| < 2**23 (rounded by the FPU's own rule); larger floats are integers already."""
    big = 8388608.0
    c = tl.where(x >= 0, big, -big)
    return tl.where(tl.abs(x) < big, (x + c) - c, x)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, A, L, C, n_groups,
                     GROUP: tl.constexpr, BITS: tl.constexpr, INTEGER_ZERO: tl.constexpr,
                     AB: tl.constexpr, GB: tl.constexpr, CB: tl.constexpr):
    """One program per (row block, group, channel block). The loops over a group's ``GB``-sized
    chunks have compile-time bounds (``GROUP``): a run-time bound is a tensor, which the
    interpreter of Triton < 3.9 cannot take as a loop bound on NumPy >= 2.5."""
    g = tl.program_id(0) % n_groups  # (row block, group) flattened on axis 0: no 65535 limit
    a = (tl.program_id(0) // n_groups) * AB + tl.arange(0, AB)[:, None, None]
    c = tl.program_id(1) * CB + tl.arange(0, CB)[None, None, :]
    lo = g * GROUP
    hi = tl.minimum(lo + GROUP, L)
    inside = (a < A) & (c < C)
    mn = tl.full((AB, 1, CB), float("inf"), tl.float32)
    mx = tl.full((AB, 1, CB), float("-inf"), tl.float32)
    for step in range(0, GROUP, GB):
        l = lo + step + tl.arange(0, GB)[None, :, None]
        ok = inside & (l < hi)
        x = tl.load(x_ptr + (a.to(tl.int64) * L + l) * C + c, mask=ok, other=0.0)
        mn = tl.minimum(mn, tl.expand_dims(tl.min(tl.where(ok, x, float("inf")), axis=1), 1))
        mx = tl.maximum(mx, tl.expand_dims(tl.max(tl.where(ok, x, float("-inf")), axis=1), 1))
    levels = (1 << BITS) - 1.0
    if INTEGER_ZERO:
        both_zero = (mn == 0.0) & (mx == 0.0)
        mn = tl.where(both_zero, -1.0, mn)
        mx = tl.where(both_zero, 1.0, mx)
    varying = mx > mn
    s = tl.where(varying, tl.math.div_rn(mx - mn, tl.full(mn.shape, levels, tl.float32)), 0.0)
    safe = tl.where(varying, s, 1.0)
    if INTEGER_ZERO:
        zq = tl.where(varying, rint(tl.math.div_rn(-mn, safe)), 0.0)
        offset = tl.where(varying, -zq * s, mn)
    else:
        zq = mn
        offset = mn
    stat = (a.to(tl.int64) * n_groups + g) * C + c
    tl.store(scale_ptr + stat, s.to(tl.float16), mask=inside)
    tl.store(offset_ptr + stat, offset.to(tl.float16), mask=inside)
    for step in range(0, GROUP, GB):
        l = lo + step + tl.arange(0, GB)[None, :, None]
        ok = inside & (l < hi)
        at = (a.to(tl.int64) * L + l) * C + c
        x = tl.load(x_ptr + at, mask=ok, other=0.0)
        if INTEGER_ZERO:
            q = rint(tl.math.div_rn(x, safe) + zq)
        else:
            q = rint(tl.math.div_rn(x - mn, safe))
        q = tl.where(varying & ok, tl.minimum(tl.maximum(q, 0.0), levels), 0.0)
        tl.store(codes_ptr + at, q.to(tl.uint8), mask=ok)


def _view(x: torch.Tensor, along_tokens: bool) -> tuple[int, int, int]:
    """(A, L, C) of a ``[b, h, t, d]`` block grouped along tokens (keys) or channels (values)."""
    b, h, t, d = x.shape
    return (b * h, t, d) if along_tokens else (b * h * t, d, 1)


def quantize(x: torch.Tensor, groups: IntGroups) -> dict[str, torch.Tensor]:
    """Fields ``codes`` (packed along head_dim), ``scale`` and ``offset`` (float16) of a float32
    block ``[b, h, t, d]`` coded over ``groups``: of ``groups.size`` tokens per channel, or of
    ``groups.size`` channels per token, with its zero-point (the kernel's ``INTEGER_ZERO``)."""
    along_tokens, bits, group = groups.axis == TOKENS, groups.bits, groups.size
    x = x.to(torch.float32).contiguous()
    b, h, t, d = x.shape
    A, L, C = _view(x, along_tokens)
    n_groups = triton.cdiv(L, group)
    stats = (b, h, n_groups, d) if along_tokens else (b, h, t, n_groups)
    scale = torch.empty(stats, dtype=torch.float16, device=x.device)
    offset = torch.empty(stats, dtype=torch.float16, device=x.device)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if along_tokens:
        ab, cb = 1, triton.next_power_of_2(C)
        gb = max(1, min(triton.next_power_of_2(group), config.tile() // cb))
    else:
        gb, cb = triton.next_power_of_2(group), 1
        ab = max(1, config.tile() // gb)
    grid = (triton.cdiv(A, ab) * n_groups, triton.cdiv(C, cb))
    _quantize_kernel[grid](x, codes, scale, offset, A, L, C, n_groups, GROUP=group, BITS=bits,
                           INTEGER_ZERO=groups.zero_point == ZERO_INTEGER, AB=ab, GB=gb, CB=cb, enable_fp_fusion=False)
    return {"codes": pack_rows(codes, bits), "scale": scale, "offset": offset}


class IntCodesTriton(TritonMethod):
    """An integer-code method on Triton (a spec with a ``recipe`` whose ``clip_ratio`` is 1)."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.recipe = spec.recipe
        if self.recipe.clip_ratio != 1.0:
            raise BackendUnavailableError(f"the Triton quantizer does not clip group ranges; not {self.recipe}")

    def _rotate(self, x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
        """``x @ H`` (H is its own inverse), or float32 x when the recipe does not rotate."""
        return hadamard_rotate(x, ctx.consts["hadamard"]) if self.recipe.rotates else x.to(torch.float32)

    to_codes = from_values = _rotate  # keys and values share the rotation, its own inverse

    def _stored(self, fields: Fields, groups: IntGroups, norm: torch.Tensor | None = None) -> Stored:
        """A block as the tile decoder reads it; with ``norm`` each token's logit (or row) is scaled by it."""
        kind = INT_TOKENS if groups.axis == TOKENS else INT_CHANNELS
        return Stored(kind, fields["codes"], groups.bits, fields["scale"], fields["offset"], group=groups.size,
                      token_scale=norm, scale_mode=NO_SCALE if norm is None else BATCH_SCALE)

    def stored_keys(self, fields: Fields, ctx: TorchContext) -> Stored:
        return self._stored(fields, self.recipe.keys, fields["norm"] if self.recipe.token_norm else None)

    def stored_values(self, fields: Fields, ctx: TorchContext) -> Stored:
        return self._stored(fields, self.recipe.values)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        kr = self._rotate(k, ctx)
        norm = token_norms(kr) if self.recipe.token_norm else None
        u = kr if norm is None else kr / norm[:, None, :, None]
        fields = quantize(u, self.recipe.keys)
        if norm is not None:
            fields["norm"] = norm
        return fields

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._rotate(tiles.decode(self.stored_keys(fields, ctx), ctx.shape), ctx)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return quantize(self._rotate(v, ctx), self.recipe.values)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._rotate(tiles.decode(self.stored_values(fields, ctx), ctx.shape), ctx)
