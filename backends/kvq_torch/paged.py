"""``kvq::attend_paged`` in plain torch, for every method: the fallback of any backend without its own
paged kernel (CUDA methods the Triton kernel does not take, numba's CUDA side).

Vectorised over the batch (no per-request loop, no host read of a device tensor): every request's
pages are gathered at once (``[num_reqs, kv_heads, max_blocks * block_size]``), unpacked
(:class:`kvq_core.paged.PageLayout`) and decoded to float32 K/V by ``kvq::decode`` on the torch
backend, then each query token attends with its request's causal mask, tail included. It decodes
the context: the fast paths are the numba (CPU) and Triton (CUDA) kernels, which score from the codes.
"""
from __future__ import annotations

import torch

import kvq_core.torch_ops.ops  # noqa: F401  (defines the kvq:: ops)
from kvq_core.torch_ops.torch_kernels import field_names
from kvq_core.paged import PageLayout
from kvq_core.spec import MethodSpec

#: decoded K elements one chunk of query tokens may gather (bounds the fallback's memory)
CHUNK_ELEMENTS = 1 << 24


def query_positions(query_start_loc: torch.Tensor, code_lens: torch.Tensor, tail_lens: torch.Tensor,
                    n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request, position)`` int64 ``[n_tokens]`` of every query token (tokens past the last
    request, padding, count as the last request's)."""
    qsl = query_start_loc.long()
    tok = torch.arange(n_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True).clamp_(max=qsl.shape[0] - 2)
    qlen = qsl[1:] - qsl[:-1]
    pos = code_lens.long()[req] + tail_lens.long()[req] - qlen[req] + (tok - qsl[req])
    return req, pos


class PagedTorch:
    """The fallback paged attention of one spec (decode with ``backend``'s ``kvq::decode``)."""

    def __init__(self, spec: MethodSpec, backend: str = "torch") -> None:
        self.spec, self.spec_json, self.backend = spec, spec.to_json(), backend
        self.names = {kind: field_names(spec, kind) for kind in ("keys", "values")}
        self._layouts: dict[tuple[int, int], PageLayout] = {}

    def _layout(self, block_size: int, kv_heads: int) -> PageLayout:
        key = (block_size, kv_heads)
        if key not in self._layouts:
            self._layouts[key] = PageLayout(self.spec, block_size, kv_heads)
        return self._layouts[key]

    def _decoded(self, layer: int, pages: torch.Tensor, block_table: torch.Tensor, code_lens: torch.Tensor,
                 head_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V float32 ``[num_reqs, kv_heads, max_blocks * block_size, d]`` (zero past ``code_lens``) and
        the valid-token mask ``[num_reqs, T]``."""
        nb, hk, bs, rb = pages.shape
        nreq, mb = block_table.shape
        t = mb * bs
        ids = block_table.reshape(-1).long().clamp(0, nb - 1)
        rows = pages.index_select(0, ids).reshape(nreq, mb, hk, bs, rb).permute(0, 2, 1, 3, 4).reshape(nreq, hk, t, rb)
        kf, vf = self._layout(bs, hk).unpack(rows)
        shape = [nreq, hk, t, self.spec.head_dim]
        k = torch.ops.kvq.decode(self.backend, self.spec_json, layer, "keys", [kf[n] for n in self.names["keys"]],
                                 shape, head_offset)
        v = torch.ops.kvq.decode(self.backend, self.spec_json, layer, "values",
                                 [vf[n] for n in self.names["values"]], shape, head_offset)
        valid = torch.arange(t, device=pages.device)[None, :] < code_lens.long()[:, None]
        keep = valid[:, None, :, None]
        return torch.where(keep, k, 0.0), torch.where(keep, v, 0.0), valid

    def attend_paged(self, layer: int, q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
                     code_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                     tail_k: torch.Tensor | None, tail_v: torch.Tensor | None, tail_slot: torch.Tensor | None,
                     tail_lens: torch.Tensor | None, head_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        n, hq, d = q.shape
        hk = pages.shape[1]
        g = hq // hk
        code = code_lens.long()
        tails = tail_lens.long() if tail_lens is not None else torch.zeros_like(code)
        req, pos = query_positions(query_start_loc, code, tails, n)
        k, v, valid = self._decoded(layer, pages, block_table, code, head_offset)
        t = k.shape[2]
        mt = tail_k.shape[2] if tail_k is not None else 0
        if tail_k is not None:
            tk, tv = tail_k.float(), tail_v.float()
            slot = tail_slot.long()
            tpos = torch.arange(mt, device=q.device)
        qg = q.float().reshape(n, hk, g, d)
        out = torch.empty(n, hk, g, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(n, hk, g, dtype=torch.float32, device=q.device)
        chunk = max(1, CHUNK_ELEMENTS // max(1, hk * (t + mt) * d))
        cpos = torch.arange(t, device=q.device)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            r, p = req[c0:c1], pos[c0:c1]
            keys, vals = k[r], v[r]  # [C, hk, T, d]
            mask = valid[r] & (cpos[None, :] <= p[:, None])  # [C, T]
            if tail_k is not None:
                keys = torch.cat([keys, tk[slot[r]]], dim=2)
                vals = torch.cat([vals, torch.where((tpos[None, :] < tails[r][:, None])[:, None, :, None],
                                                    tv[slot[r]], 0.0)], dim=2)
                tmask = (tpos[None, :] < tails[r][:, None]) & (code[r][:, None] + tpos[None, :] <= p[:, None])
                mask = torch.cat([mask, tmask], dim=1)
            z = torch.einsum("ckgd,cktd->ckgt", qg[c0:c1], keys) * scale
            z = z.masked_fill(~mask[:, None, None, :], float("-inf"))
            s = torch.logsumexp(z, dim=-1)
            safe = torch.where(torch.isfinite(s), s, 0.0)
            out[c0:c1] = torch.einsum("ckgt,cktd->ckgd", torch.exp(z - safe[..., None]), vals)
            lse[c0:c1] = s
        return out.reshape(n, hq, d), lse.reshape(n, hq)
