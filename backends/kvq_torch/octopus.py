"""Torch kernels of OCTOPUS (mirrors ``kvq_numpy/octopus.py``; the codec is described in
:mod:`kvq_core.methods.octopus`).

Vectorised over [batch, kv_heads, tokens, triplets] in float32 with the reference's arithmetic
order (norms through :func:`kvq_torch.rotation.norm`, three-term sums left to right), so the
codes match the NumPy backend bit for bit. Joint rounding scores the 3x3 index neighbourhood
as 9 candidates stacked on a new axis; ``argmax`` keeps the first maximum and the centre comes
first, the reference's tie rule. Keys stay in the rotated domain inside :meth:`OctopusTorch.attend`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvq_core.math.octahedral import JOINT_NEIGHBOURS
from kvq_core.methods.octopus import OctopusSpec
from kvq_torch.common import (
    Consts,
    Fields,
    TorchContext,
    TorchMethod,
    codebook_quantize,
    pack_codes,
    read_fields,
    softmax_attend,
    unpack_codes,
    window_attend,
)
from kvq_torch.rotation import (by_kv_head, from_kv_head, normalize_rotate, rotate_queries, rotation_rows, sqrt_rn,
                                unrotate, unrotate_output)


# --------------------------------------------------------------------------------------------
# octahedral map, encoder side (kvq_core.math.octahedral.oct_encode in float32)
# --------------------------------------------------------------------------------------------
def _sgn(x: torch.Tensor) -> torch.Tensor:
    """Sign-not-zero: +1 where x >= 0 (including -0.0), else -1."""
    return torch.where(x >= 0, 1.0, -1.0)


def sum3(x: torch.Tensor) -> torch.Tensor:
    """``(x0 + x1) + x2`` over a last axis of 3: NumPy's order for a 3-term sum."""
    return (x[..., 0] + x[..., 1]) + x[..., 2]


def oct_encode(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xi, eta) of triplets ``[..., 3]``; the zero vector is treated as (0, 0, 1) and maps to (0, 0)."""
    l1 = sum3(t.abs()).unsqueeze(-1)
    zero = l1 == 0
    up = torch.tensor([0.0, 0.0, 1.0], dtype=t.dtype, device=t.device)
    p = torch.where(zero, up, t) / torch.where(zero, 1.0, l1)
    px, py, pz = p[..., 0], p[..., 1], p[..., 2]
    lower = pz < 0
    xi = torch.where(lower, _sgn(px) * (1 - py.abs()), px)
    eta = torch.where(lower, _sgn(py) * (1 - px.abs()), py)
    return xi, eta


# --------------------------------------------------------------------------------------------
# the codec
# --------------------------------------------------------------------------------------------
def triplets(v: torch.Tensor, n_triplets: int) -> torch.Tensor:
    """The first ``3 * n_triplets`` coordinates of ``[..., d]`` as ``[..., n_triplets, 3]``,
    zero-padding a short tail (spec 1.3); coordinates beyond them are the scalar tail's."""
    pad = 3 * n_triplets - v.shape[-1]
    if pad > 0:
        v = torch.nn.functional.pad(v, (0, pad))
    return v[..., : 3 * n_triplets].reshape(*v.shape[:-1], n_triplets, 3)


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an index tensor of any shape, as ``index_select`` (on CPU several
    times faster than advanced indexing)."""
    return table.index_select(0, index.reshape(-1)).reshape(*index.shape, *table.shape[1:])


def direction_index(t: torch.Tensor, consts: Consts) -> torch.Tensor:
    """Nearest-centroid direction of each triplet as one index ``i_xi * K_eta + i_eta``, the row
    of the decoded-direction table (scale-invariant in t)."""
    xi, eta = oct_encode(t)
    i_xi, i_eta = codebook_quantize(xi, consts["xi_thresholds"]), codebook_quantize(eta, consts["eta_thresholds"])
    return i_xi * consts["eta_codebook"].shape[0] + i_eta


def neighbour_table(k_xi: int, k_eta: int, device: torch.device) -> torch.Tensor:
    """``[k_xi * k_eta, 9]``: for each direction index, those of its 3x3 index neighbourhood
    (clamped to the codebooks, centre first: the reference's candidate order)."""
    offsets = torch.tensor(JOINT_NEIGHBOURS, device=device)
    i_xi = torch.arange(k_xi, device=device).repeat_interleave(k_eta).unsqueeze(-1)
    i_eta = torch.arange(k_eta, device=device).repeat(k_xi).unsqueeze(-1)
    c_xi = torch.clamp(i_xi + offsets[:, 0], 0, k_xi - 1)
    c_eta = torch.clamp(i_eta + offsets[:, 1], 0, k_eta - 1)
    return c_xi * k_eta + c_eta


def round_plain(t: torch.Tensor, consts: Consts) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent nearest-centroid rounding of the direction and of rho = ||t||."""
    rho = sqrt_rn(sum3(t * t))
    return direction_index(t, consts), codebook_quantize(rho, consts["rho_thresholds"])


def round_joint(t: torch.Tensor, consts: Consts) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec 1.8: the 3x3 index neighbour maximising s = <t, n_hat> (first maximum), then Q_rho(s)."""
    table = neighbour_table(consts["xi_codebook"].shape[0], consts["eta_codebook"].shape[0], t.device)
    candidates = lookup(table, direction_index(t, consts))  # [..., 9]
    s = sum3(t.unsqueeze(-2) * lookup(consts["directions"], candidates))  # [..., 9]
    best = torch.argmax(s, dim=-1, keepdim=True)
    direction, s = candidates.gather(-1, best).squeeze(-1), s.gather(-1, best).squeeze(-1)
    return direction, codebook_quantize(torch.clamp(s, min=0.0), consts["rho_thresholds"])


def join(spec: OctopusSpec, direction: torch.Tensor, i_rho: torch.Tensor) -> torch.Tensor:
    """One code per triplet: xi in the high bits, then eta, then rho (direction = xi, eta bits)."""
    return (direction << spec.rho_bits) | i_rho


def encode(x: torch.Tensor, spec: OctopusSpec, consts: Consts) -> Fields:
    """Fields ``codes`` and ``norm`` of a block [b, h, t, d]; a zero vector gets gamma 0."""
    gamma, v = normalize_rotate(x, consts)
    t = triplets(v, spec.n_triplets)
    rounding = round_joint if spec.rounding == "joint" else round_plain
    codes = join(spec, *rounding(t, consts))
    if not spec.n_tail:
        return {"codes": pack_codes(codes, spec.triplet_bits), "norm": gamma}
    tail = codebook_quantize(v[..., 3 * spec.n_triplets :], consts["tail_thresholds"])
    stream = torch.cat((to_bits(codes, spec.triplet_bits), to_bits(tail, spec.bits)), dim=-1)
    return {"codes": pack_codes(stream, 1), "norm": gamma}


def to_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Codes ``(..., n)`` as their bits ``(..., n * width)``, least significant first."""
    shifts = torch.arange(width, dtype=torch.int64, device=codes.device)
    return ((codes.to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], -1)


def unpack(fields: Fields, spec: OctopusSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The triplet codes and the scalar tail's codes (None without a scalar tail), int32."""
    if not spec.n_tail:
        return unpack_codes(fields["codes"], spec.triplet_bits, spec.n_triplets, torch.int32), None
    head = spec.n_triplets * spec.triplet_bits
    return (read_fields(fields["codes"], 0, spec.triplet_bits, spec.n_triplets, torch.int32),
            read_fields(fields["codes"], head, spec.bits, spec.n_tail, torch.int32))


def triplet_table(consts: Consts) -> torch.Tensor:
    """``[2**triplet_bits, 3]``: the decoded triplet rho_hat * n_hat of every code, row = the code
    (:func:`join`'s order: direction index, then rho index), so decoding is one lookup per triplet."""
    return (consts["directions"].unsqueeze(1) * consts["rho_codebook"].unsqueeze(-1)).reshape(-1, 3)


def decode_rotated(fields: Fields, spec: OctopusSpec, consts: Consts) -> torch.Tensor:
    """The decoded unit vectors in the rotated domain, R u_hat, [b, h, t, d] (gamma not applied)."""
    codes, tail = unpack(fields, spec)
    t_hat = lookup(triplet_table(consts), codes)
    v_hat = t_hat.reshape(*t_hat.shape[:-2], -1)[..., : spec.head_dim]
    if tail is None:
        return v_hat
    return torch.cat((v_hat, lookup(consts["tail_codebook"], tail)), dim=-1)


def decode(fields: Fields, spec: OctopusSpec, consts: Consts) -> torch.Tensor:
    """gamma * R^T v_hat in the original domain, float32 [b, h, t, d]."""
    return fields["norm"].unsqueeze(-1) * unrotate(decode_rotated(fields, spec, consts), consts)


class OctopusTorch(TorchMethod):
    """Encode/decode with :func:`encode`/:func:`decode`; attend scores from the rotated codes."""

    spec: OctopusSpec

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return encode(k, self.spec, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return decode(fields, self.spec, ctx.consts)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        if self.spec.values == "fp16":
            return {"data": v.to(torch.float32).to(torch.float16)}
        return encode(v, self.spec, ctx.consts)

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        if self.spec.values == "fp16":
            return fields["data"].to(torch.float32)
        return decode(fields, self.spec, ctx.consts)

    def attend(
        self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score gamma_j <R q, v_hat_j> without un-rotating keys; un-rotate the output once."""
        kv_heads = kfields["norm"].shape[1]
        q_rot = rotate_queries(q, ctx.consts, kv_heads)
        k_rot = decode_rotated(kfields, self.spec, ctx.consts)
        if self.spec.values == "fp16":
            return softmax_attend(q_rot, k_rot, vfields["data"], scale, token_scale=kfields["norm"])
        v_rot = scaled(vfields, self.spec, ctx.consts)
        out_rot, lse = softmax_attend(q_rot, k_rot, v_rot, scale, token_scale=kfields["norm"])
        return unrotate_output(out_rot, ctx.consts, kv_heads), lse

    def attend_window(self, q: torch.Tensor, blocks: Sequence[tuple[Fields, Fields, int]], window_k: torch.Tensor,
                      window_v: torch.Tensor, ctx: TorchContext, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks and the exact window in one softmax, in the rotated domain (as :meth:`attend`): the
        blocks' codes (keys and values together: one layout) are joined and decoded at once, never
        un-rotated; the window is rotated in and the output back once, each a product with R's matrix
        (:func:`rotation_rows`): a decode step's operands are a few rows, where each op's overhead counts."""
        kv_heads, w, d = window_k.shape[1], window_k.shape[2], window_k.shape[3]
        rows = rotation_rows(ctx.consts, d, window_k.device)
        keys, values = [k for k, _, _ in blocks], [v for _, v, _ in blocks]
        if self.spec.values == "fp16":
            k = torch.cat((scaled(joined(keys), self.spec, ctx.consts), torch.matmul(window_k.to(torch.float32), rows)), 2)
            v = torch.cat((joined(values)["data"].to(torch.float32), window_v.to(torch.float32)), 2)
        else:
            t = sum(f["norm"].shape[2] for f in keys)
            both = scaled(joined(keys + values), self.spec, ctx.consts)
            window = torch.matmul(torch.cat((window_k, window_v), 2).to(torch.float32), rows)
            k = torch.cat((both[:, :, :t], window[:, :, :w]), 2)
            v = torch.cat((both[:, :, t:], window[:, :, w:]), 2)
        q_rot = from_kv_head(torch.matmul(by_kv_head(q.to(torch.float32), kv_heads), rows), tuple(q.shape))
        out, lse = window_attend(q_rot, k, v, scale)
        if self.spec.values != "fp16":
            out = from_kv_head(torch.matmul(by_kv_head(out, kv_heads), rows.transpose(-1, -2)), tuple(out.shape))
        return out, lse


def scaled(fields: Fields, spec: OctopusSpec, consts: Consts) -> torch.Tensor:
    """gamma * R u_hat: decoded vectors in the rotated domain, norms applied."""
    return fields["norm"].unsqueeze(-1) * decode_rotated(fields, spec, consts)


def joined(fields: Sequence[Fields]) -> Fields:
    """Blocks' fields as one block's, joined on the token axis (one decode for all of them)."""
    if len(fields) == 1:
        return fields[0]
    return {name: torch.cat([f[name] for f in fields], 2) for name in fields[0]}
