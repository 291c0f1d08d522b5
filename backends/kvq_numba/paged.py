"""``kvq::attend_paged`` on the Numba CPU kernels: OScaR and KIVI at 2 and 4 bits
(:func:`kvq_numba.cpu.attend_planes.jobs_kernel`) and OCTOPUS
(:func:`kvq_numba.cpu.attend_octopus.octopus_jobs_at`) read the pages through the block table, the same
kernels that serve contiguous blocks (the trivial page table). Other specs, and CUDA tensors (numba's
CUDA kernels have no paged variant), take the torch fallback (``kvq_torch.paged``, through the table).

Per call: queries are rotated once into the keys' domain, the work is planned (split-KV jobs per
request, kv head and tile of query rows, plus one job per tile for the exact tail), the CODES jobs'
partial outputs are brought back from the values' domain (the kernel class's ``domains``, as in
``KVQCache``'s fused window attend, :mod:`kvq_numba.cpu.window`), the TAIL jobs score the staged
exact tokens with the original queries straight from the staging buffer (by slot: no copy, no
rotation of the tail), and a log-sum-exp combine merges each tile's jobs. Nothing loops over
requests in Python. The plan depends only on the batch's lengths, so the layers of an engine step
share it (kept for the next call with equal lengths, compared by value); a small call runs on one
thread (:class:`kvq_numba.cpu.page_table.Plan`).

**Many query tokens** (a prefill chunk, a prefix-cache tail, recompute): a request with at least
:data:`DENSE_MIN_QUERY` query tokens is served by decoding its context to float32 K/V once (its
rows gathered through the block table, the codec's numba decode, the exact tail appended) and
causal attention over them on torch's CPU flash kernel, which returns the log-sum-exp too
(:func:`dense_causal`). The op's meaning is unchanged: decoded K/V are what the codes score
against. Measured crossover (``bench/paged_prefill.py``, ``bench/results/paged_prefill.md``;
SmolLM2's shape, 1 thread): the two paths are about even at 16 query tokens, decoding wins from 32
on (2-4x at 512 query tokens over 512-2048 context tokens) and loses below 8 (decoding a context
costs more than one pass of a few queries over its codes). Decode steps (``q_len = 1``) and
n-gram verification of a few drafts stay on the codes.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvq_core.constants import constants
from kvq_core.torch_ops.run import PAGED_FALLBACK, paged_kernel
from kvq_core.contract import KernelContext
from kvq_core.paged import GROUP, PageLayout, gather_rows
from kvq_core.registry import kernel_factory
from kvq_core.spec import MethodSpec
from kvq_numba import threads
from kvq_numba.cpu import attend_octopus as cpu_attend_octopus
from kvq_numba.cpu import attend_planes as cpu_attend_planes
from kvq_numba.cpu import page_table
from kvq_numba.arrays import as_float32
from kvq_numba.plugin import NAME, supports

#: fewest query tokens of a request that take the decode-then-flash path (module docstring)
DENSE_MIN_QUERY = 16


def flat_pages(pages: torch.Tensor) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The bytes ``pages`` spans, as one flat NumPy view, and its (block, head, token) strides (a
    contiguous copy first when its rows are not contiguous or a stride is negative). The view is
    writeable, as the contiguous blocks' buffers are (the kernels only read it): a read-only array is
    another Numba type, and every kernel would compile a second time for the pages."""
    if pages.stride(3) != 1 or min(pages.stride()) < 0:
        pages = pages.contiguous()
    arr = pages.numpy()
    span = 1 + sum((n - 1) * s for n, s in zip(pages.shape, pages.stride()))
    flat = np.lib.stride_tricks.as_strided(arr, shape=(span,), strides=(1,))
    return flat, (pages.stride(0), pages.stride(1), pages.stride(2))


class PagedNumba:
    """Paged attention of one spec on the Numba CPU kernels (module docstring)."""

    def __init__(self, spec: MethodSpec) -> None:
        self.spec, self.spec_json = spec, spec.to_json()
        self.impl = kernel_factory(NAME, spec.method)(spec)
        ok, _ = supports(spec, "cpu")
        if spec.method == "octopus":
            self.fast = ok
        else:
            self.fast = ok and cpu_attend_planes.fits(spec.bits, spec.head_dim, self.impl.value_group)
        self._layouts: dict[tuple[int, int], PageLayout] = {}
        self._setups: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._last: tuple[Any, tuple[page_table.Plan, np.ndarray, np.ndarray]] | None = None

    def _layout(self, block_size: int, kv_heads: int) -> PageLayout:
        key = (block_size, kv_heads)
        if key not in self._layouts:
            self._layouts[key] = PageLayout(self.spec, block_size, kv_heads)
        return self._layouts[key]

    def _desc(self, layout: PageLayout, kind: str, name: str, strides: tuple[int, int, int]) -> tuple[int, ...]:
        s = layout.slot(kind, name)
        return (layout.block_size, *strides, s.start, s.width, layout.group if s.stripe == GROUP else 1)

    def _setup(self, layer: int, head_offset: int, block_size: int, kv_heads: int,
               strides: tuple[int, int, int]) -> tuple[Any, ...]:
        """``(to_keys, back, make_jobs, align)`` of a layer's pages (the kernel class's
        ``domains`` and the CODES kernel), built once per (layer, head offset, page shape and
        strides): a decode step's Python is the minimum."""
        key = (layer, head_offset, block_size, kv_heads, *strides)
        hit = self._setups.get(key)
        if hit is None:
            layout = self._layout(block_size, kv_heads)
            hit = (*self.impl.domains(constants(self.spec, kv_heads, layer, head_offset)),
                   *self._jobs(layout, layer, head_offset, strides))
            self._setups[key] = hit
        return hit

    def _plan(self, query_start_loc: torch.Tensor, code_lens: torch.Tensor, tail_lens: torch.Tensor | None,
              tail_slot: torch.Tensor | None, g: int, kv_heads: int,
              align: int) -> tuple[page_table.Plan, np.ndarray, np.ndarray]:
        """``(plan of the requests the codes serve, dense request indices, query_start_loc as int64)`` of a
        call. Kept for the next call with equal lengths (compared by value, so never stale): a serving
        engine's layers share one per step."""
        key = (query_start_loc.numpy().tobytes(), code_lens.numpy().tobytes(), g, kv_heads, align, threads.count(),
               None if tail_lens is None else (tail_lens.numpy().tobytes(), tail_slot.numpy().tobytes()))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        qsl = query_start_loc.numpy().astype(np.int64)
        q_lens = np.diff(qsl)
        code = code_lens.numpy().astype(np.int64)
        tail_n = tail_lens.numpy().astype(np.int64) if tail_lens is not None else np.zeros_like(code)
        slots = tail_slot.numpy().astype(np.int64) if tail_slot is not None else None
        dense = q_lens >= DENSE_MIN_QUERY
        plan = page_table.Plan(qsl[:-1] * g, np.where(dense, 0, q_lens), code, tail_n, code + tail_n - q_lens, g,
                              kv_heads, self.spec.head_dim, align, slots)
        hit = (plan, np.flatnonzero(dense), qsl)
        self._last = (key, hit)
        return hit

    def _jobs(self, layout: PageLayout, layer: int, head_offset: int, strides: tuple[int, int, int]) -> Any:
        """``(make_jobs, align)``: ``make_jobs(flat, scale)`` is the method's CODES kernel over pages whose
        bytes are ``flat``."""
        if self.spec.method == "octopus":
            fp16 = self.spec.values == "fp16"
            desc = np.zeros((5, page_table.DESC), np.int64)
            desc[cpu_attend_octopus.F_KC] = self._desc(layout, "keys", "codes", strides)
            desc[cpu_attend_octopus.F_KN] = self._desc(layout, "keys", "norm", strides)
            if fp16:
                desc[cpu_attend_octopus.F_VH] = self._desc(layout, "values", "data", strides)
            else:
                desc[cpu_attend_octopus.F_VC] = self._desc(layout, "values", "codes", strides)
                desc[cpu_attend_octopus.F_VN] = self._desc(layout, "values", "norm", strides)
            bits, table = self.impl._books(constants(self.spec, layout.kv_heads, layer, head_offset))

            def octopus(flat, scale):  # noqa: ANN001, ANN202
                def jobs_fn(q, jobs, first, row_lo, g, tab, chunks, pm, pl, pacc):  # noqa: ANN001, ANN202
                    cpu_attend_octopus.octopus_jobs_at(q, jobs, first, row_lo, g, tab, chunks, flat, flat, flat, flat,
                                                       flat, desc, fp16, bits, table, scale, pm, pl, pacc,
                                                       cpu_attend_octopus.WIDE)
                return jobs_fn
            return octopus, cpu_attend_octopus.BLOCK
        impl = self.impl
        desc = np.zeros((7, page_table.DESC), np.int64)
        for index, kind, name in ((cpu_attend_planes.F_KC, "keys", "codes"), (cpu_attend_planes.F_KS, "keys", "scale"),
                                  (cpu_attend_planes.F_KO, "keys", "offset"), (cpu_attend_planes.F_VC, "values", "codes"),
                                  (cpu_attend_planes.F_VS, "values", "scale"), (cpu_attend_planes.F_VO, "values", "offset")):
            desc[index] = self._desc(layout, kind, name, strides)
        if impl.token_scaling:
            desc[cpu_attend_planes.F_KN] = self._desc(layout, "keys", "norm", strides)

        def planes(flat, scale):  # noqa: ANN001, ANN202
            kernel = cpu_attend_planes.jobs_kernel(cpu_attend_planes.WIDE)

            def jobs_fn(q, jobs, first, row_lo, g, tab, chunks, pm, pl, pacc):  # noqa: ANN001, ANN202
                kernel(q, jobs, first, row_lo, g, tab, chunks, flat, flat, flat, flat, flat, flat, flat, desc,
                       impl.token_scaling, impl.bits, impl.key_group, impl.value_group, scale, pm, pl, pacc)
            return jobs_fn
        return planes, int(cpu_attend_planes.block_tokens(impl.key_group))

    # -- the op ---------------------------------------------------------------------------------
    def attend_paged(self, layer: int, q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
                     code_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                     tail_k: torch.Tensor | None, tail_v: torch.Tensor | None, tail_slot: torch.Tensor | None,
                     tail_lens: torch.Tensor | None, head_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if q.device.type != "cpu" or not self.fast:
            return paged_kernel(PAGED_FALLBACK, self.spec_json).attend_paged(
                layer, q, pages, block_table, code_lens, query_start_loc, scale, tail_k, tail_v, tail_slot, tail_lens,
                head_offset)
        n, hq, d = q.shape
        if n == 0:
            return q.new_zeros((0, hq, d), dtype=torch.float32), q.new_zeros((0, hq), dtype=torch.float32)
        hk, bs = pages.shape[1], pages.shape[2]
        g = hq // hk
        flat, strides = flat_pages(pages)
        to_keys, back, make_jobs, align = self._setup(layer, head_offset, bs, hk, strides)
        plan, dense, qsl = self._plan(query_start_loc, code_lens, tail_lens, tail_slot, g, hk, align)
        if len(dense) == len(plan.q_lens):
            out = torch.empty((n, hq, d), dtype=torch.float32)
            lse = torch.empty((n, hq), dtype=torch.float32)
        else:
            qh = np.ascontiguousarray(q.detach().to(torch.float32).numpy().reshape(n, hk, g, d).transpose(1, 0, 2, 3))
            qh = qh.reshape(hk, n * g, d)
            tails = None if tail_k is None else (as_float32(tail_k), as_float32(tail_v))
            o, s = page_table.run(qh, to_keys(qh[None])[0], plan, block_table.numpy().astype(np.int64),
                                 make_jobs(flat, np.float32(scale)), back, tails, np.float32(scale))
            out = torch.from_numpy(np.ascontiguousarray(o.reshape(hk, n, g, d).transpose(1, 0, 2, 3)).reshape(n, hq, d))
            lse = torch.from_numpy(np.ascontiguousarray(s.reshape(hk, n, g).transpose(1, 0, 2)).reshape(n, hq))
        for r in dense:
            lo, hi = int(qsl[r]), int(qsl[r + 1])
            tail = None
            if plan.tail_lens[r]:
                slot, t = int(plan.slots[r]), int(plan.tail_lens[r])
                tail = (tail_k[slot, :, :t], tail_v[slot, :, :t])
            k, v = self._decoded(layer, head_offset, pages, block_table[r], int(plan.code_lens[r]), tail)
            out[lo:hi], lse[lo:hi] = dense_causal(q[lo:hi], k, v, scale)
        return out, lse

    def _decoded(self, layer: int, head_offset: int, pages: torch.Tensor, block_ids: torch.Tensor, coded: int,
                 tail: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 K, V ``[kv_heads, coded + tail, d]`` of one request: its coded rows gathered through
        its block-table row and decoded by the numba kernels, then its exact tail."""
        hk, d = pages.shape[1], self.spec.head_dim
        parts_k, parts_v = [], []
        if coded:
            layout = self._layout(pages.shape[2], hk)
            kf, vf = layout.unpack(gather_rows(pages, block_ids, coded))
            ctx = KernelContext(self.spec, layer, (1, hk, coded, d), constants(self.spec, hk, layer, head_offset))
            parts_k.append(torch.from_numpy(np.asarray(self.impl.decode_keys(_numpy(kf), ctx)))[0])
            parts_v.append(torch.from_numpy(np.asarray(self.impl.decode_values(_numpy(vf), ctx)))[0])
        if tail is not None:
            parts_k.append(tail[0].to(torch.float32))
            parts_v.append(tail[1].to(torch.float32))
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out float32 [q_len, q_heads, d], lse float32 [q_len, q_heads])`` of queries ``q [q_len, q_heads, d]``
    at the last ``q_len`` positions of ``k, v`` float32 ``[kv_heads, T, d]``, each seeing every position
    up to its own (GQA). Two flash calls merged by log-sum-exp: the earlier ``T - q_len`` positions,
    seen by every query, and the query's own positions, causal (torch's flash kernel aligns its
    causal mask top-left, to positions ``T - q_len`` on)."""
    ql, hq, d = q.shape
    hk, t = k.shape[0], k.shape[1]
    qh = q.to(torch.float32).permute(1, 0, 2).unsqueeze(0)  # [1, hq, ql, d]
    kh = k.repeat_interleave(hq // hk, dim=0).unsqueeze(0)
    vh = v.repeat_interleave(hq // hk, dim=0).unsqueeze(0)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(qh, kh[:, :, t - ql:], vh[:, :, t - ql:], is_causal=True, scale=scale)
    if t > ql:
        before, lse0 = flash(qh, kh[:, :, :t - ql], vh[:, :, :t - ql], scale=scale)
        top = torch.maximum(lse, lse0)
        w, w0 = torch.exp(lse - top), torch.exp(lse0 - top)
        total = w + w0
        out = (out * w[..., None] + before * w0[..., None]) / total[..., None]
        lse = top + torch.log(total)
    return out[0].permute(1, 0, 2), lse[0].permute(1, 0)


def _numpy(fields: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: f.numpy() for name, f in fields.items()}


