"""The Numba kernels of the integer-code methods (OScaR, KIVI): keys coded per channel over token
groups, values per token over channel groups, optionally rotated (H) and token-normalised (OTS).

:class:`IntCodesNumba` reads the ingredients from the spec's
:class:`~kvq_core.methods.intcodes.IntCodeRecipe` and runs NumPy/CPU input on the ``@njit`` kernels
(:mod:`kvq_numba.cpu`); CUDA input goes to its twin :class:`kvq_numba.gpu.intcodes_cuda.IntCodesCuda`
(:mod:`kvq_numba.route`). Recipes of another shape (QuaRot's clipped per-token key groups) are not
served: ``plugin.supports`` keeps them out.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from kvq_core.errors import BackendUnavailableError
from kvq_core.contract import KernelContext
from kvq_core.methods.intcodes import CHANNELS, TOKENS, ZERO_INTEGER, IntCodeRecipe
from kvq_numba import rules, threads
from kvq_numba.arrays import as_float32
from kvq_numba.cpu import attend as cpu_attend
from kvq_numba.cpu import attend_planes as cpu_attend_planes
from kvq_numba.cpu import intquant as cpu_intquant
from kvq_numba.cpu import rotation as cpu_rotation
from kvq_numba.cpu import window as cpu_window
from kvq_numba.cpu.common import fwht_heads, half_bits, inv_sqrt
from kvq_numba.route import DeviceRouted
from kvq_numba.startup import prepare

Fields = dict[str, Any]
_NO_NORM = np.ones((1, 1), np.float32)
#: the blocks' memo key of what :meth:`IntCodesNumba._plan_planes` derives (the scale is not part of it)
_PLANES = "kvq_numba.planes"
#: the blocks' memo key of their job functions (one per scale: it is compiled into them)
_JOBS = "kvq_numba.planes_jobs"
#: Blocks shorter than this attend with the general kernel: the vector kernel's job plan costs ~40 us
#: a call (host-side planning and scratch), more than the general kernel's whole run on a short block;
#: from here on the two cost about the same on one thread, and the plan's token splits use the others.
PLANES_MIN_TOKENS = 1024


class IntCodesNumba(DeviceRouted):
    """Asymmetric min/max integer codes (kvq_numpy.intquant) with the recipe's rotation and OTS.

    The recipe's ingredients as the compiled kernels take them: ``bits``, ``key_group`` (tokens),
    ``value_group`` (channels), ``rotation``, ``token_scaling`` and ``zero_mode`` (rules.ZERO_*)."""

    CUDA_TWIN = "kvq_numba.gpu.intcodes_cuda:IntCodesCuda"

    def __init__(self, spec: Any) -> None:
        prepare()  # before the first kernel loads from the disk cache
        self.spec = spec
        recipe: IntCodeRecipe = spec.recipe
        keys, values = recipe.keys, recipe.values
        if (keys.axis, values.axis) != (TOKENS, CHANNELS) or keys.bits != values.bits \
                or keys.zero_point != values.zero_point or recipe.clip_ratio != 1.0:
            raise BackendUnavailableError(f"numba's int-codes kernels take keys grouped along tokens and values along "
                                          f"channels with one bit width and zero-point, unclipped; not {recipe}")
        self.bits, self.key_group, self.value_group = keys.bits, keys.size, values.size
        self.rotation, self.token_scaling = recipe.rotates, recipe.token_norm
        self.zero_mode = rules.ZERO_INTEGER if keys.zero_point == ZERO_INTEGER else rules.ZERO_MIN
        self.inv_sqrt_d = inv_sqrt(spec.head_dim)

    @functools.cached_property
    def _block_tokens(self) -> int:
        """Tokens per online-softmax block of the vector kernel: what a token split must be a multiple of."""
        return int(cpu_attend_planes.block_tokens(self.key_group))

    @functools.cached_property
    def _fits_planes(self) -> bool:
        """Whether code rows take the vector kernel (cpu_attend_planes: 2- and 4-bit rows of whole 8-byte chunks)."""
        return cpu_attend_planes.fits(self.bits, self.spec.head_dim, self.value_group)

    def _rotate(self, x: np.ndarray) -> np.ndarray:
        return cpu_rotation.rotate(x, self.inv_sqrt_d) if self.rotation else x

    @staticmethod
    def _fields(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> Fields:
        # float32 -> float16 rounding by NumPy, exactly as the reference stores them; an overflow
        # to Inf is reported by the core's check_stored_finite
        with np.errstate(over="ignore"):
            return {"codes": codes, "scale": scale.astype(np.float16), "offset": offset.astype(np.float16)}

    # -- host kernels (kvq_numba.route sends CUDA input to the twin): threads.run(work, cpu kernel) --
    def encode_keys_cpu(self, k: Any, ctx: KernelContext) -> Fields:
        return threads.run(math.prod(ctx.shape) * threads.ENCODE_WEIGHT, self._encode_keys, k)

    def _encode_keys(self, k: Any) -> Fields:
        kr = self._rotate(as_float32(k))
        norm = None
        if self.token_scaling:
            kr, norm = cpu_rotation.unit_keys(kr)
        fields = self._fields(*cpu_intquant.encode_token_groups(kr, self.bits, self.key_group, self.zero_mode))
        if norm is not None:
            fields["norm"] = norm
        return fields

    def decode_keys_cpu(self, fields: Fields, ctx: KernelContext) -> Any:
        return threads.run(math.prod(ctx.shape) * threads.DECODE_WEIGHT, self._decode_keys, fields)

    def _decode_keys(self, fields: Fields) -> np.ndarray:
        k = cpu_intquant.decode_token_groups(np.ascontiguousarray(fields["codes"]), half_bits(fields["scale"]),
                                             half_bits(fields["offset"]), self.bits, self.key_group, self.spec.head_dim)
        if self.token_scaling:
            cpu_rotation.scale_tokens(k, as_float32(fields["norm"]))
        return self._rotate(k)

    def encode_values_cpu(self, v: Any, ctx: KernelContext) -> Fields:
        return threads.run(math.prod(ctx.shape) * threads.ENCODE_WEIGHT, self._encode_values, v)

    def _encode_values(self, v: Any) -> Fields:
        vr = self._rotate(as_float32(v))
        return self._fields(*cpu_intquant.encode_channel_groups(vr, self.bits, self.value_group, self.zero_mode))

    def decode_values_cpu(self, fields: Fields, ctx: KernelContext) -> Any:
        return threads.run(math.prod(ctx.shape) * threads.DECODE_WEIGHT, self._decode_values, fields)

    def _decode_values(self, fields: Fields) -> np.ndarray:
        v = cpu_intquant.decode_channel_groups(np.ascontiguousarray(fields["codes"]), half_bits(fields["scale"]),
                                               half_bits(fields["offset"]), self.bits, self.value_group,
                                               self.spec.head_dim)
        return self._rotate(v)

    def attend_cpu(self, q: Any, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float) -> tuple[Any, Any]:
        """Scores from the codes in the rotated domain (``(Hq)·(Hk) = q·k``); one un-rotation of the output.
        2- and 4-bit rows of whole 8-byte chunks take the vector kernel (cpu_attend_planes), others the general one."""
        b, hq, lq, d = q.shape
        _, hk, t, _ = ctx.shape
        kernel, args = self.attend_args(as_float32(q).reshape(b, hk, (hq // hk) * lq, d), kfields, vfields, scale)
        out, lse = threads.run(b * hq * lq * t * d, kernel, *args)
        return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)

    def attend_args(self, qo: np.ndarray, kfields: Fields, vfields: Fields, scale: float) -> tuple[Any, tuple[Any, ...]]:
        """``(kernel, args)``: ``kernel(*args)`` attends queries ``qo`` [b, hk, rows, d] (C-contiguous float32,
        original domain) over the block, returning ``(out, lse)`` in the same shapes (also what ``kvq bench
        speed`` calls directly to time the Python around it). Blocks of at least :data:`PLANES_MIN_TOKENS`
        whose rows fit take the vector kernel between two rotations; shorter ones the general kernel, with
        the rotations inside its one compiled call."""
        args = self._block_args(kfields, vfields, scale)
        if self._fits_planes and kfields["codes"].shape[2] >= PLANES_MIN_TOKENS:
            return self._planes, (qo, *args)
        if self.rotation:
            return cpu_attend.attend_int_codes_rotated, (qo, self.inv_sqrt_d, *args)
        return cpu_attend.attend_int_codes, (qo, *args)

    def _planes(self, qo: np.ndarray, *args: Any) -> tuple[np.ndarray, np.ndarray]:
        out, lse = cpu_attend_planes.attend_planes(self._rotate(qo), *args)
        return self._rotate(out), lse

    def _block_args(self, kfields: Fields, vfields: Fields, scale: float) -> tuple[Any, ...]:
        """A block's fields and the method's ingredients, in the attend kernels' argument order (after the queries)."""
        norm = as_float32(kfields["norm"]) if self.token_scaling else _NO_NORM
        return (np.ascontiguousarray(kfields["codes"]), half_bits(kfields["scale"]), half_bits(kfields["offset"]),
                norm, self.token_scaling, np.ascontiguousarray(vfields["codes"]), half_bits(vfields["scale"]),
                half_bits(vfields["offset"]), self.bits, self.key_group, self.value_group, np.float32(scale))

    def domains(self, consts: Any) -> tuple[Any, Any]:
        """``(to_keys, back)`` of the jobs machinery (:mod:`kvq_numba.cpu.page_table`): ``to_keys`` maps queries
        ``[1, kv_heads, rows, d]`` into the keys' domain (H, or nothing); ``back(pacc, jobs)`` brings CODES
        jobs' partial outputs ``[jobs, ROWS * d]`` from the values' domain to the original one, in place
        (None: the same domain). ``consts`` is unused: the Hadamard has no per-layer constants."""
        if not self.rotation:
            return _same, None
        inv = self.inv_sqrt_d

        def back(pacc: np.ndarray, _jobs: np.ndarray) -> None:
            x = pacc.reshape(1, 1, -1, self.spec.head_dim)
            fwht_heads(x, x, inv)

        return self._rotate, back

    def fuses_window_cpu(self) -> bool:
        """:meth:`attend_window` runs (for host queries) over code rows the vector kernel takes (cpu_attend_planes.fits)."""
        return cpu_attend_planes.fits(self.bits, self.spec.head_dim, self.value_group)

    def attend_window(self, q: Any, blocks: list[tuple[Fields, Fields, int]], window_k: Any, window_v: Any,
                      ctx: KernelContext, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Packed blocks then an exact window in one plan and one combine: one or two blocks (a KVQCache
        layer at almost every decode step) in one compiled call (:func:`kvq_numba.cpu.attend_planes.window_kernel`),
        more through :func:`kvq_numba.cpu.window.run`."""
        b, hq, lq, d = q.shape
        work = b * hq * lq * (ctx.shape[2] + window_k.shape[2]) * d
        return threads.run(work, self._attend_window, q, blocks, window_k, window_v, ctx.shape[1], scale)

    def _plan_planes(self, blocks: list[tuple[Fields, Fields, int]], b: int, lq: int, g: int, hk: int) -> tuple[Any, ...]:
        """What :func:`kvq_numba.cpu.attend_planes.window_kernel`'s kernel takes from one or two blocks alone: their field
        buffers and descriptors, token counts, and the token split for ``b`` x ``lq`` x ``g`` query rows."""
        prepared = [cpu_attend_planes.contiguous_block(*self._block_args(kf, vf, 1.0)) for kf, vf, _ in blocks]
        prepared += prepared[:1] * (2 - len(prepared))  # an absent second block: 0 tokens, never read
        tokens = np.array([t for _, _, t in blocks] + [0] * (2 - len(blocks)), np.int64)
        split, chunks = cpu_window.split_plan(b, lq, g, hk, int(tokens.sum()), [self._block_tokens])
        return prepared, tokens, split, chunks

    def _attend_window(self, q: Any, blocks: list[tuple[Fields, Fields, int]], window_k: Any, window_v: Any,
                       hk: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
        b, hq, lq, d = q.shape
        g = hq // hk
        if 1 <= len(blocks) <= cpu_attend_planes.WINDOW_BLOCKS:  # a KVQCache layer's usual state: one compiled call
            memo = getattr(blocks, "memo", {})  # a WindowPlan's blocks keep it over decode steps
            planned = memo.get((_PLANES, b, lq, g))
            if planned is None:
                planned = memo[(_PLANES, b, lq, g)] = self._plan_planes(blocks, b, lq, g, hk)
            prepared, tokens, split, chunks = planned
            return cpu_attend_planes.window_kernel(cpu_attend_planes.WIDE)(
                as_float32(q), as_float32(window_k), as_float32(window_v), self.rotation, self.inv_sqrt_d,
                (prepared[0][0], prepared[1][0]), (prepared[0][1], prepared[1][1]), tokens,
                self.token_scaling, self.bits, self.key_group, self.value_group, np.float32(scale), split, chunks)
        to_keys, back = self.domains(None)
        qo = cpu_window.grouped_queries(as_float32(q), hk)
        qc = to_keys(qo[None])[0]
        memo = getattr(blocks, "memo", {})
        jobs = memo.get((_JOBS, scale))
        if jobs is None:
            jobs = memo[(_JOBS, scale)] = [(*cpu_attend_planes.contiguous_jobs(*self._block_args(kf, vf, scale)), t)
                                           for kf, vf, t in blocks]
        out, lse = cpu_window.run(qo, qc, b, lq, g, jobs, (as_float32(window_k), as_float32(window_v)), back, scale)
        return cpu_window.ungrouped(out, b, lq, g), cpu_window.ungrouped(lse, b, lq, g)



def _same(x: np.ndarray) -> np.ndarray:
    return x
