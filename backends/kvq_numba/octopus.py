"""The Numba kernels of OCTOPUS: NumPy/CPU input runs :mod:`kvq_numba.cpu.octopus_codes` and the fused
:func:`kvq_numba.cpu.attend_octopus.attend_octopus`; CUDA input runs :mod:`kvq_numba.gpu.octopus_cuda`
(:mod:`kvq_numba.route`)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvq_core.contract import KernelContext
from kvq_core.methods.octopus import OctopusSpec
from kvq_numba import threads
from kvq_numba.arrays import as_float32
from kvq_numba.cpu import attend_octopus as cpu_attend_octopus
from kvq_numba.cpu import octopus_codes
from kvq_numba.cpu import window as cpu_window
from kvq_numba.cpu.common import fwht_heads, half_bits, inv_sqrt
from kvq_numba.route import DeviceRouted
from kvq_numba.startup import prepare

Fields = dict[str, Any]
#: placeholders for the value arguments attend_octopus does not read (fp16 values, or octopus values)
_NO_CODES = np.zeros((1, 1, 1, 1), np.uint8)
_NO_NORMS = np.zeros((1, 1, 1), np.float32)
_NO_HALVES = np.zeros((1, 1, 1, 1), np.uint16)
#: the blocks' memo key of their job functions (one per scale: it is compiled into them)
_JOBS = "kvq_numba.octopus_jobs"
#: the blocks' memo key of what the one-call window kernel takes from them
_WINDOW = "kvq_numba.octopus_window"


class OctopusNumba(DeviceRouted):
    """OCTOPUS encode/decode/attend; keys (and octopus-coded values) stay rotated inside attend."""

    CUDA_TWIN = "kvq_numba.gpu.octopus_cuda:OctopusCuda"

    def __init__(self, spec: OctopusSpec) -> None:
        prepare()  # before the first kernel loads from the disk cache
        self.spec = spec
        self.inv_sqrt_d = inv_sqrt(spec.head_dim)
        self._table: tuple[Any, np.ndarray] | None = None
        self._enc: tuple[Any, tuple[Any, ...]] | None = None
        #: values stored as float16 rows (original domain) rather than coded (rotated domain)
        self.values_fp16 = self._fp16_values(spec)

    @staticmethod
    def _fp16_values(spec: Any) -> bool:
        return spec.values == "fp16"

    def _books(self, consts: Any) -> tuple[Any, ...]:
        """Decode constants in kernel argument order (after the code arrays): the triplet code
        width and the code -> rho * direction table, built once per codebook."""
        dirs = consts["directions"]
        if self._table is None or self._table[0] is not dirs:
            s = self.spec
            table = octopus_codes.code_table(s.triplet_bits, s.eta_bits, s.rho_bits, consts["eta_codebook"].size,
                                           np.asarray(consts["rho_codebook"]), np.asarray(dirs))
            self._table = (dirs, table)
        return self.spec.triplet_bits, self._table[1]

    def _encode_args(self, consts: Any) -> tuple[Any, ...]:
        """Encode constants in kernel argument order (after the input), gathered once per layer's
        constants: a decode step encodes one token per layer, where seven lookups cost ~a tenth of the call."""
        signs = consts["signs"]
        if self._enc is None or self._enc[0] is not signs:
            s = self.spec
            self._enc = (signs, (np.ascontiguousarray(signs), self.inv_sqrt_d, consts["xi_thresholds"],
                                 consts["eta_thresholds"], consts["rho_thresholds"],
                                 np.ascontiguousarray(consts["directions"]), consts["xi_codebook"].size,
                                 consts["eta_codebook"].size, s.eta_bits, s.rho_bits, s.triplet_bits,
                                 s.rounding == "joint"))
        return self._enc[1]

    def _encode(self, x: Any, consts: Any) -> Fields:
        codes, gamma = octopus_codes.encode(as_float32(x), *self._encode_args(consts))
        return {"codes": codes, "norm": gamma}

    def _decode(self, fields: Fields, consts: Any) -> np.ndarray:
        return octopus_codes.decode(np.ascontiguousarray(fields["codes"]), as_float32(fields["norm"]),
                                  np.ascontiguousarray(consts["signs"]), self.inv_sqrt_d, *self._books(consts),
                                  self.spec.head_dim)

    # -- host kernels (kvq_numba.route sends CUDA input to the twin): threads.run(work, cpu kernel) --
    def encode_keys_cpu(self, k: Any, ctx: KernelContext) -> Fields:
        return threads.run(math.prod(ctx.shape) * threads.OCTOPUS_ENCODE_WEIGHT, self._encode, k, ctx.consts)

    def decode_keys_cpu(self, fields: Fields, ctx: KernelContext) -> Any:
        return threads.run(math.prod(ctx.shape) * threads.DECODE_WEIGHT, self._decode, fields, ctx.consts)

    def encode_values_cpu(self, v: Any, ctx: KernelContext) -> Fields:
        if self.values_fp16:
            return {"data": as_float32(v).astype(np.float16)}
        return threads.run(math.prod(ctx.shape) * threads.OCTOPUS_ENCODE_WEIGHT, self._encode, v, ctx.consts)

    def decode_values_cpu(self, fields: Fields, ctx: KernelContext) -> Any:
        if self.values_fp16:
            return np.asarray(fields["data"]).astype(np.float32)
        return threads.run(math.prod(ctx.shape) * threads.DECODE_WEIGHT, self._decode, fields, ctx.consts)

    def attend_cpu(self, q: Any, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float) -> tuple[Any, Any]:
        """Score ``gamma_j <R q, v_hat_j>`` from the codes; un-rotate the output once (octopus values)."""
        b, hq, lq, d = q.shape
        return threads.run(b * hq * lq * ctx.shape[2] * d, self._attend, q, kfields, vfields, ctx, scale)

    def _attend(self, q: Any, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float) -> tuple[Any, Any]:
        b, hq, lq, d = q.shape
        hk = ctx.shape[1]
        signs = np.ascontiguousarray(ctx.consts["signs"])
        qr = octopus_codes.signed_rotate(as_float32(q).reshape(b, hk, (hq // hk) * lq, d), signs, self.inv_sqrt_d)
        fp16 = self.values_fp16
        out, lse = cpu_attend_octopus.attend_octopus(qr, *self._block_args(kfields, vfields, ctx, scale))
        if not fp16:
            out = octopus_codes.signed_unrotate(out, signs, self.inv_sqrt_d)
        return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)

    def _block_args(self, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float) -> tuple[Any, ...]:
        """A block's fields and the decode constants, in the attend kernels' argument order (after the queries)."""
        return (*self._block_fields(kfields, vfields), *self._books(ctx.consts), np.float32(scale))

    def _block_fields(self, kfields: Fields, vfields: Fields) -> tuple[Any, ...]:
        """A block's five field arrays (placeholders where its values do not use one) and the fp16-values flag."""
        if self.values_fp16:
            return (np.ascontiguousarray(kfields["codes"]), as_float32(kfields["norm"]), _NO_CODES, _NO_NORMS,
                    half_bits(vfields["data"]), True)
        return (np.ascontiguousarray(kfields["codes"]), as_float32(kfields["norm"]), np.ascontiguousarray(vfields["codes"]),
                as_float32(vfields["norm"]), _NO_HALVES, False)

    def domains(self, consts: Any) -> tuple[Any, Any]:
        """``(to_keys, back)`` of the jobs machinery (:mod:`kvq_numba.cpu.page_table`) for one layer's
        ``consts``: ``to_keys`` maps queries ``[1, kv_heads, rows, d]`` to the keys' domain (signs, then
        H); ``back(pacc, jobs)`` brings CODES jobs' partial outputs ``[jobs, ROWS * d]`` from the values'
        domain to the original one in place (H, then the job's kv head's signs; None for fp16 values)."""
        signs = np.ascontiguousarray(consts["signs"]).astype(np.float32)
        inv, d = self.inv_sqrt_d, self.spec.head_dim

        def to_keys(x: np.ndarray) -> np.ndarray:
            return octopus_codes.signed_rotate(x, signs, inv)

        if self.values_fp16:
            return to_keys, None

        def back(pacc: np.ndarray, jobs: np.ndarray) -> None:
            x = pacc.reshape(1, 1, -1, d)
            fwht_heads(x, x, inv)
            pacc.reshape(-1, pacc.shape[1] // d, d)[...] *= signs[jobs[:, 1]][:, None, :]

        return to_keys, back

    def fuses_window_cpu(self) -> bool:
        """:meth:`attend_window` runs for every host query (NumPy, CPU tensors)."""
        return True

    def attend_window(self, q: Any, blocks: list[tuple[Fields, Fields, int]], window_k: Any, window_v: Any,
                      ctx: KernelContext, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Packed blocks then an exact window in one plan and one combine: up to three blocks (a sliding-flush layer
        at almost every decode step) in one compiled call (:func:`kvq_numba.cpu.attend_octopus.octopus_window`),
        more through :func:`kvq_numba.cpu.window.run`."""
        b, hq, lq, d = q.shape
        work = b * hq * lq * (ctx.shape[2] + window_k.shape[2]) * d
        return threads.run(work, self._attend_window, q, blocks, window_k, window_v, ctx, scale)

    def _plan_window(self, blocks: list[tuple[Fields, Fields, int]], ctx: KernelContext, b: int, lq: int,
                     g: int) -> tuple[Any, ...]:
        """What :func:`kvq_numba.cpu.attend_octopus.octopus_window` takes from up to ``WINDOW_BLOCKS`` blocks
        alone: their field buffers and descriptors (the first block's repeated in the absent places, never
        read), token counts, the layer's signs, and the token split for ``b`` x ``lq`` x ``g`` query rows."""
        memos = getattr(blocks, "block_memos", None) or [{} for _ in blocks]
        prepared = [self._prepared_block(kf, vf, memo) for (kf, vf, _), memo in zip(blocks, memos)]
        prepared += prepared[:1] * (cpu_attend_octopus.WINDOW_BLOCKS - len(prepared))
        tokens = np.array([t for _, _, t in blocks] + [0] * (cpu_attend_octopus.WINDOW_BLOCKS - len(blocks)), np.int64)
        split, chunks = cpu_window.split_plan(b, lq, g, ctx.shape[1], int(tokens.sum()), [cpu_attend_octopus.BLOCK])
        signs = np.ascontiguousarray(ctx.consts["signs"], np.float32)
        return (tuple(p[0] for p in prepared), tuple(p[1] for p in prepared), tokens, len(blocks), signs, split,
                chunks)

    def _prepared_block(self, kfields: Fields, vfields: Fields, memo: dict[Any, Any]) -> tuple[Any, Any]:
        """One block's field buffers and descriptor for :func:`~kvq_numba.cpu.attend_octopus.octopus_window`,
        kept in the (key block's) memo with the value arrays it read: a sliding flush's plan at each decode step
        prepares only its new block."""
        kept = memo.get(_WINDOW)
        values = tuple(vfields.values())
        if kept is None or len(kept[0]) != len(values) or any(a is not b for a, b in zip(kept[0], values)):
            kept = memo[_WINDOW] = (values, cpu_attend_octopus.contiguous_block(*self._block_fields(kfields, vfields)))
        return kept[1]

    def _attend_window(self, q: Any, blocks: list[tuple[Fields, Fields, int]], window_k: Any, window_v: Any,
                       ctx: KernelContext, scale: float) -> tuple[np.ndarray, np.ndarray]:
        b, hq, lq, d = q.shape
        hk = ctx.shape[1]
        g = hq // hk
        memo = getattr(blocks, "memo", {})  # a WindowPlan's blocks keep it over decode steps
        if 1 <= len(blocks) <= cpu_attend_octopus.WINDOW_BLOCKS:  # a sliding-flush layer's usual state: one call
            planned = memo.get((_WINDOW, b, lq, g))
            if planned is None:
                planned = memo[(_WINDOW, b, lq, g)] = self._plan_window(blocks, ctx, b, lq, g)
            bufs, desc, tokens, nseg, signs, split, chunks = planned
            bits, table = self._books(ctx.consts)
            return cpu_attend_octopus.octopus_window(
                as_float32(q), as_float32(window_k), as_float32(window_v), signs, self.inv_sqrt_d, bufs, desc, tokens,
                nseg, self.values_fp16, bits, table, np.float32(scale), split, chunks, cpu_attend_octopus.WIDE)
        to_keys, back = self.domains(ctx.consts)
        qo = cpu_window.grouped_queries(as_float32(q), hk)
        qc = to_keys(qo[None])[0]
        jobs = memo.get((_JOBS, scale))
        if jobs is None:
            jobs = memo[(_JOBS, scale)] = [(*cpu_attend_octopus.contiguous_jobs(*self._block_args(kf, vf, ctx, scale)), t)
                                           for kf, vf, t in blocks]
        out, lse = cpu_window.run(qo, qc, b, lq, g, jobs, (as_float32(window_k), as_float32(window_v)), back, scale)
        return cpu_window.ungrouped(out, b, lq, g), cpu_window.ungrouped(lse, b, lq, g)
