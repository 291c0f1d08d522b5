"""Shared torch helpers for every method's kernels: the torch mirrors of the NumPy reference helpers.

Everything here is a pure function of tensors (no NumPy, no data-dependent Python control flow),
so it runs eagerly on any device, inside the ``kvq::`` custom ops, and under
``torch.compile(dynamic=True)`` / ``torch.export``. Arithmetic follows the reference op for op in
float32, so codes match the NumPy backend bit for bit except where a float32 reduction order
differs (then only at genuine rounding ties, see :mod:`kvq_core.testing`).

Contents:

- :class:`TorchMethod`: the base of a method's kernels on every ``torch_ops`` backend (kvq's
  ``torch``, ``torch-compiled`` and ``triton``, and plugins' kernels; the one class plugin authors
  subclass, see docs/plugins.md); what they receive, the
  :class:`~kvq_core.torch_ops.torch_kernels.TorchContext`, and the per-device constant cache live
  in :mod:`kvq_core.torch_ops`;
- :func:`pack_codes` / :func:`unpack_codes`: the bit rule of :mod:`kvq_core.layout`;
- :func:`fwht`: the butterfly of :func:`kvq_core.math.hadamard.fwht`, stage for stage;
- :func:`hadamard_rotate`: the same rotation as a matmul by the core's <= 128-wide factor plus
  butterfly stages (compile-friendly);
- :func:`tree_sum`: an order-fixed float32 sum (eager and inductor add in the same order);
- :func:`sqrt32`: a correctly rounded float32 square root (eager ``torch.sqrt`` is not);
- :func:`asym_quantize` / :func:`asym_dequantize`: the asymmetric min/max group quantizer of
  ``kvq_numpy/intquant.py`` and ``kvq_numpy/intcodes.py``;
- :func:`group_tokens` / :func:`ungroup_tokens` / :func:`group_channels`;
- :func:`codebook_quantize`: nearest centroid as ``np.searchsorted(thresholds, x, side="right")``;
- :func:`softmax_attend`: attention with GQA and a per-token logit scale, returning (out, lse).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvq_core.torch_ops.torch_kernels import Consts, Fields, TorchContext
from kvq_core.layout import packed_row_bytes
from kvq_core.math.hadamard import hadamard_block
from kvq_core.spec import MethodSpec


# --------------------------------------------------------------------------------------------
# method base class
# --------------------------------------------------------------------------------------------
class TorchMethod:
    """Base of a method's kernels on a ``torch_ops`` backend (one subclass per method and backend,
    listed in the backend's kernel table or registered by a plugin with ``kvq_register_kernels``).

    Subclasses implement the functions of :class:`kvq_core.contract.MethodKernels` on torch
    tensors with a :class:`~kvq_core.torch_ops.torch_kernels.TorchContext` (tensor constants on the
    data's device) in place of the NumPy one:

    - ``encode_keys(k, ctx) -> dict`` of fields (any float dtype in; compute in float32),
    - ``decode_keys(fields, ctx) -> float32 [b, h, t, d]``,
    - ``encode_values`` / ``decode_values``: by default the key functions,
    - ``attend(q, kfields, vfields, ctx, scale) -> (out float32 [b, hq, lq, d], lse float32 [b, hq, lq])``:
      by default a softmax over the decoded K/V (override to score from the codes);
    - for a codec that clips, ``clips(kind)`` and ``ste_grad`` (``kvq::fake_quant``'s gradient).

    Field dtypes and shapes must be exactly the spec's layout (uint8 code rows, float16/float32
    side fields); read sizes from the tensors or from ``ctx.shape``. Pure functions of tensors:
    no NumPy, no ``.item()``/Python branches on tensor *values* (that breaks compile and export);
    return fresh tensors.
    """

    def __init__(self, spec: MethodSpec) -> None:
        self.spec = spec

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        raise NotImplementedError

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        raise NotImplementedError

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return self.encode_keys(v, ctx)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self.decode_keys(fields, ctx)

    def attend(
        self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_attend(q.float(), self.decode_keys(kfields, ctx), self.decode_values(vfields, ctx), scale)

    def attend_window(self, q: torch.Tensor, blocks: Sequence[tuple[Fields, Fields, int]], window_k: torch.Tensor,
                      window_v: torch.Tensor, ctx: TorchContext, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over packed ``blocks`` (``(kfields, vfields, tokens)`` in token order) then the exact
        window, whose last ``q_len`` tokens are the queries' own, in one softmax: the reference of the
        fused decode step (:meth:`kvq_core.Quantizer.attend_window`). By default over the decoded blocks."""
        b, hk, _, d = ctx.shape
        ks, vs = [], []
        for kfields, vfields, tokens in blocks:
            part = ctx._replace(shape=(b, hk, tokens, d))
            ks.append(self.decode_keys(kfields, part))
            vs.append(self.decode_values(vfields, part))
        return window_attend(q, torch.cat([*ks, window_k.float()], 2), torch.cat([*vs, window_v.float()], 2), scale)

    def clips(self, kind: str) -> bool:
        """Whether encoding ``kind`` clips: some inputs lie outside the range the codes can
        represent, beyond rounding. False (the default): ``kvq::fake_quant``'s straight-through
        gradient is the identity; True: it is :meth:`ste_grad`."""
        return False

    def ste_grad(self, x: torch.Tensor, grad: torch.Tensor, ctx: TorchContext, kind: str) -> torch.Tensor:
        """The straight-through gradient at ``x`` of a codec that clips (:meth:`clips`): ``grad``
        with the clipped components zeroed, in the domain where the codec clips. It must be linear
        in ``grad`` and symmetric (its own adjoint), which ``kvq::fake_quant_grad``'s own
        gradient relies on."""
        raise NotImplementedError(f"{type(self).__name__} clips {kind} but has no ste_grad")


# --------------------------------------------------------------------------------------------
# bit packing (kvq_core.layout's rule)
# --------------------------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes ``(..., count)`` (any integer dtype, values < 2**bits) into uint8 rows.

    Code ``i`` takes stream bits ``[i*bits, (i+1)*bits)``, LSB first; stream bit ``j`` is bit
    ``j % 8`` of byte ``j // 8``; rows are zero-padded to whole bytes (kvq_core.layout).
    """
    lead = codes.shape[:-1]
    count = codes.shape[-1]
    nbytes = packed_row_bytes(count, bits)
    if 8 % bits == 0:  # whole codes per byte: OR shifted slices, all in uint8
        per = 8 // bits
        c = codes.to(torch.uint8)
        pad = nbytes * per - count
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.reshape(*lead, nbytes, per)
        out = c[..., 0]
        for j in range(1, per):
            out = out | (c[..., j] << (j * bits))
        return out.contiguous() if per > 1 else out.clone()
    c = codes.to(torch.int64)
    shifts = torch.arange(bits, dtype=torch.int64, device=codes.device)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(*lead, count * bits)
    pad = nbytes * 8 - count * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    stream = stream.reshape(*lead, nbytes, 8)
    out = stream[..., 0]
    for j in range(1, 8):
        out = out | (stream[..., j] << j)
    return out.contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 rows to codes ``(..., count)`` of ``dtype``.

    For ``bits <= 8`` a ``torch.uint8`` result is cheapest (codes stay one byte each).
    """
    lead = packed.shape[:-1]
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        c = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        c = c.reshape(*lead, packed.shape[-1] * per)
        if c.shape[-1] != count:
            c = c[..., :count]
        return c.to(dtype)
    return read_fields(packed, 0, bits, count, dtype)


def read_fields(packed: torch.Tensor, start: int, bits: int, count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``count`` codes of ``bits`` bits (at most 56) from stream bit ``start`` on, as ``dtype`` ``(..., count)``:
    each code's bytes gathered (one ``index_select``) and read as one little-endian word (:func:`pack_codes`'
    stream order), in int32 where a code's bytes fit in 24 bits."""
    first = [(start + bits * i) // 8 for i in range(count)]
    shift = [(start + bits * i) % 8 for i in range(count)]
    span = (max(shift) + bits + 7) // 8 if count else 1  # bytes a code touches, at most
    last = int(packed.shape[-1]) - 1  # a code that touches fewer reads a clamped byte its mask drops
    index = torch.tensor([min(f + j, last) for f in first for j in range(span)], dtype=torch.int64, device=packed.device)
    wide = torch.int32 if span <= 3 else torch.int64
    raw = packed.index_select(-1, index).reshape(*packed.shape[:-1], count, span).to(wide)
    word = raw[..., 0]
    for j in range(1, span):
        word = word | (raw[..., j] << (8 * j))
    codes = (word >> torch.tensor(shift, dtype=wide, device=packed.device)) & ((1 << bits) - 1)
    return codes if codes.dtype == dtype else codes.to(dtype)


# --------------------------------------------------------------------------------------------
# float32 math mirrored from the reference
# --------------------------------------------------------------------------------------------
def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform on the last axis, float32 (``x @ H_d``; block
    diagonal ``I (x) H_B`` when d is not a power of two, see :mod:`kvq_core.math.hadamard`).

    The same butterfly stages in the same order as :func:`kvq_core.math.hadamard.fwht`, so the
    float32 result is bit-identical to the reference (and between eager and inductor).
    """
    x = x.to(torch.float32)
    d = x.shape[-1]
    block = hadamard_block(int(d))
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < block:
        y = y.reshape(-1, d // (2 * h), 2, h)
        top, bottom = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((top + bottom, top - bottom), dim=2)
        h *= 2
    return y.reshape(*lead, d) * _inv_sqrt(block)


#: float32(1 / sqrt(d)) as Python floats for d = 2**0 .. 2**16 (the reference multiplies by this
#: float32 scalar); a table lookup is traceable by torch.compile where a tensor round-trip is not.
_INV_SQRT = {1 << i: float(torch.tensor(1.0 / math.sqrt(1 << i), dtype=torch.float32)) for i in range(17)}


def _inv_sqrt(d: int) -> float:
    return _INV_SQRT[d]


def hadamard_rotate(x: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    """``x @ H_d`` given the core's dense factor ``H_m`` (``hadamard``, float32, m <= 128:
    :func:`kvq_core.math.hadamard.dense_hadamard_block`): ``H_m`` on each run of m coordinates as
    one matmul, then the butterfly stages of half-width m .. B/2, never a d x d matrix.

    Computed as ``(x @ sign(H_m)) * float32(1/sqrt(B))``: the +-1 products are exact, so wherever
    the partial sums are exactly representable (constant, integer or zero inputs) the result is
    bit-identical to the reference butterfly (:func:`fwht`), which also scales last; otherwise it
    differs by float32 rounding only. Unlike a full butterfly it stays one BLAS call under
    torch.compile at d <= 128 (inductor would inline the stages into every consumer) and gives
    the same bits eager and compiled.
    """
    x = x.to(torch.float32)
    d, m = int(x.shape[-1]), int(hadamard.shape[-1])
    block = hadamard_block(d)
    lead = x.shape[:-1]
    y = x.reshape(*lead, d // m, m) @ torch.sign(hadamard)
    h = m
    if h < block:
        y = y.reshape(-1, d)
        while h < block:
            y = y.reshape(-1, d // (2 * h), 2, h)
            top, bottom = y[:, :, 0, :], y[:, :, 1, :]
            y = torch.stack((top + bottom, top - bottom), dim=2)
            h *= 2
    return y.reshape(*lead, d) * _inv_sqrt(block)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by pairwise halving (zero-padded to a power of two), in x's dtype.

    Only elementwise adds in a fixed order: eager and inductor give the same bits, whatever
    their reduction kernels would do. Use it where a sum feeds a rounding decision.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = 1 << max(int(n) - 1, 0).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while p > 1:
        p //= 2
        x = x[..., :p] + x[..., p:]
    return x[..., 0]


def group_tokens(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[b, h, t, d]`` -> ``[b, h, ceil(t/group), group, d]``, padding by repeating the last token.

    Repeating a real token leaves a partial group's min and max those of its real tokens. Under
    torch.compile the padding is a gather with clamped indices (no branch on ``t % group``, which
    would specialise the graph on the remainder).
    """
    b, h, t, d = x.shape
    if not torch.compiler.is_compiling():
        pad = -t % group
        if pad:
            x = torch.cat([x, x[:, :, -1:, :].expand(b, h, pad, d)], dim=2)
        return x.reshape(b, h, -1, group, d)
    n = (t + group - 1) // group
    idx = torch.clamp(torch.arange(n * group, device=x.device), max=t - 1)
    return x.index_select(2, idx).reshape(b, h, n, group, d)


def ungroup_tokens(x: torch.Tensor, tokens: Any) -> torch.Tensor:
    """Inverse of :func:`group_tokens`: drop the padding tokens."""
    b, h, g, size, d = x.shape
    return x.reshape(b, h, g * size, d)[:, :, :tokens]


def group_channels(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[..., d]`` -> ``[..., d/group, group]`` (group divides d)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def group_range(x: torch.Tensor, dim: int, clip_ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The range ``(mn, mx)`` (kept dims) that :func:`asym_quantize` codes per slice along ``dim``:
    the slice's min and max, or with ``clip_ratio`` < 1 ``rho * min(mn, 0)``, ``rho * max(mx, 0)``."""
    x = x.to(torch.float32)
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    if clip_ratio != 1.0:
        ratio = float(torch.tensor(clip_ratio, dtype=torch.float32))
        mn = ratio * torch.clamp(mn, max=0.0)
        mx = ratio * torch.clamp(mx, min=0.0)
    return mn, mx


def asym_quantize(
    x: torch.Tensor, bits: int, dim: int, zero_point: str = "integer", clip_ratio: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization, one (scale, offset) per slice along ``dim`` (a group).

    The float32 arithmetic of ``kvq_numpy.intquant.quantize``, step for step. With
    ``L = 2**bits - 1`` and ``mn, mx`` the group's min and max (``clip_ratio`` < 1: ``rho *
    min(mn, 0)``, ``rho * max(mx, 0)``), ``s = (mx - mn) / L``;

    - ``zero_point="integer"`` (OScaR, QuaRot): an all-zero group uses [-1, 1];
      ``zq = rint(-mn / s)``, ``q = clip(rint(x / s + zq), 0, L)``, ``offset = -zq * s``;
    - ``zero_point="min"`` (KIVI): ``q = clip(rint((x - mn) / s), 0, L)``, ``offset = mn``.

    A constant group stores ``s = 0, q = 0, offset = mn``. Returns codes (uint8, shaped like
    ``x``) and float16 ``scale``/``offset`` with ``dim`` removed.
    """
    x = x.to(torch.float32)
    levels = float(2**bits - 1)
    mn, mx = group_range(x, dim, clip_ratio)
    if zero_point == "integer":
        all_zero = (mn == 0) & (mx == 0)
        mn = torch.where(all_zero, -1.0, mn)
        mx = torch.where(all_zero, 1.0, mx)
    varying = mx > mn
    s = torch.where(varying, (mx - mn) / levels, 0.0)
    safe_s = torch.where(varying, s, 1.0)
    if zero_point == "integer":
        zq = torch.where(varying, torch.round(-mn / safe_s), 0.0)
        q = torch.round(x / safe_s + zq)
        offset = torch.where(varying, -zq * s, mn)
    else:
        q = torch.round((x - mn) / safe_s)
        offset = mn
    codes = torch.where(varying, torch.clamp(q, 0.0, levels), 0.0)
    return codes.to(torch.uint8), s.squeeze(dim).to(torch.float16), offset.squeeze(dim).to(torch.float16)


def asym_dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dim: int) -> torch.Tensor:
    """``codes * scale + offset`` in float32, the stats broadcast along ``dim`` (their group axis)."""
    s = scale.to(torch.float32).unsqueeze(dim)
    o = offset.to(torch.float32).unsqueeze(dim)
    return codes.to(torch.float32) * s + o


def codebook_quantize(x: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Nearest-centroid index ``i`` with ``t[i-1] <= x < t[i]``: ``np.searchsorted(t, x, side="right")``."""
    return torch.bucketize(x.contiguous(), thresholds, right=True)


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (as NumPy and inductor compute it).

    Eager ``torch.sqrt`` on CPU float32 uses a vectorised approximation that is off by one ulp
    for ~0.6% of inputs; through float64 the result rounds to the exact float32 square root, so
    eager, inductor and the reference agree bit for bit.
    """
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------
def softmax_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    token_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [b, hq, lq, d]`` over ``k, v [b, hk, t, d]`` (hq = g * hk), float32.

    ``token_scale`` (broadcastable to ``[b, hk, t]``) multiplies each token's logit before the
    softmax scale. Returns ``out [b, hq, lq, d]`` and ``lse [b, hq, lq]`` (natural log).
    """
    b, hq, lq, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    qg = q.to(torch.float32).reshape(b, hk, (hq // hk) * lq, d)
    logits = torch.matmul(qg, k.to(torch.float32).transpose(-1, -2))
    if token_scale is not None:
        logits = logits * token_scale.to(torch.float32).expand(b, hk, t).unsqueeze(2)
    return softmax_combine(logits * scale, v.to(torch.float32), (b, hq, lq, d))


def window_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_attend` where the last ``q_len`` of the ``t`` tokens are the queries' own:
    query ``i`` sees tokens ``< t - q_len + i + 1`` (the causal mask of a decode or chunked step)."""
    b, hq, lq, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    logits = torch.matmul(q.to(torch.float32).reshape(b, hk, (hq // hk) * lq, d), k.transpose(-1, -2)) * scale
    row = torch.arange(lq, device=q.device).repeat(hq // hk)  # grouped rows are (head in group, query)
    hidden = torch.arange(t, device=q.device)[None, :] > (t - lq + row)[:, None]
    return softmax_combine(logits.masked_fill(hidden, float("-inf")), v, (b, hq, lq, d))


def softmax_combine(
    logits: torch.Tensor, v: torch.Tensor, out_shape: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last axis of scaled ``logits [b, hk, g*lq, t]`` applied to ``v [b, hk, t, d]``."""
    b, hq, lq, d = out_shape
    m = logits.amax(dim=-1, keepdim=True)
    p = torch.exp(logits - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p / denom, v)
    lse = (m + torch.log(denom)).squeeze(-1)
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)
