"""One transformers cache layer storing K/V as kvq packed blocks: :class:`KVQLayer`.

Storage per layer (append-only):

- ``blocks``: a list of (packed keys, packed values), each a :class:`kvq_core.PackedKV` made by
  the layer's quantizer; never re-quantized;
- a full-precision *window* (``layer.keys`` / ``layer.values``) of the most recent tokens.

Each ``update`` appends the new tokens to the window, hands the model this step's K/V
(:mod:`kvq_core.integrations.hf.view`: decoded history or codes), then packs what the flush policy says
(:mod:`kvq_core.integrations.hf.flush`).

Sliding-window layers (``sliding_window=W``, e.g. Mistral, the local layers of Gemma 2/3) are
stored the same way, and after each step drop what no later query can see, everything before
the last W - 1 tokens (:mod:`kvq_core.integrations.hf.window`): ``update`` hands the model exactly the K/V a
transformers ``DynamicSlidingWindowLayer`` would (its mask sizes included), the recent exact
window staying exact. A per-token layout is cut at the window edge; a token-group block that
straddles it stays until all its tokens are out, and meanwhile its visible tokens are handed
over decoded (also in codes mode).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from kvq_core import compile_ahead
from kvq_core.api import Quantizer, get_quantizer
from kvq_core.errors import InputError, KVQError
from kvq_core.integrations.hf.batch import batch_size, select_batch
from kvq_core.integrations.hf.decoded import DecodedHistory
from kvq_core.integrations.hf.flush import FLUSH_MODES, encode_range, join_range, plan_crop, window_drop
from kvq_core.integrations.hf.view import step_view
from kvq_core.integrations.hf.window import plan_eviction, view_start
from kvq_core.packed import PackedKV
from kvq_core.spec import MethodSpec
from kvq_core.tokens import concat_tokens, slice_tokens, token_granule, token_separable
from kvq_core.window_plan import WindowPlan

ATTENTION_MODES = ("auto", "dequant", "codes")
CHUNK_MODES = ("exact", "decode")
WINDOW_BITS = 16  # exact tokens are counted as a float16/bfloat16 deployment stores them
#: most leading window tokens a step drops as a view of the window it attended (a sliding flush's step drops
#: its new tokens' count); more are copied out, so a prefill's window does not stay held behind a few tokens
VIEW_DROP = 8


def to_torch(x: Any, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A backend array (NumPy or torch) as a torch tensor on ``device`` in ``dtype``."""
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    if (dtype is None or t.dtype is dtype) and (device is None or t.device == device):
        return t  # a decode step's attention output, as it came (``to`` costs ~1 us even then)
    return t.to(device=device if device is not None else t.device, dtype=dtype if dtype is not None else t.dtype)


def all_finite(x: torch.Tensor, quantizer: Quantizer | None) -> bool:
    """No NaN or Inf in ``x``: a CPU tensor through the quantizer's array adapter (numba's is one compiled
    pass, ~1.5 us for a decode step's K/V, against ~20 us for ``torch.isfinite(x).all()`` on one thread),
    else, or before the layer has a quantizer, through torch on the tensor's device."""
    if quantizer is not None and x.device.type == "cpu":
        return bool(quantizer.arrays.all_finite(x))
    return bool(torch.isfinite(x).all())


class KVQLayer(DynamicLayer):
    """One attention layer: packed blocks (append-only) plus a full-precision window.

    ``keys``/``values`` hold the window ``[batch, kv_heads, w, head_dim]``. ``key_spec`` and
    ``value_spec`` may differ (e.g. more bits for keys); attention from codes then decodes.
    ``rollback`` is the owning :class:`~kvq_core.integrations.hf.cache.KVQCache`'s undo of the current step,
    which :meth:`abort_step` calls (None for a layer used alone).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False  # a rollback across a flushed block cannot be undone exactly

    def __init__(
        self,
        key_spec: MethodSpec,
        value_spec: MethodSpec,
        *,
        layer_idx: int,
        backend: str = "auto",
        residual: int = 128,
        flush: str = "block",
        stride: int = 1,
        chunks: str = "exact",
        attention: str = "auto",
        cache_decoded: bool = True,
        config: Any = None,
        sliding_window: int | None = None,
        rollback: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise InputError(f"sliding_window={sliding_window!r}; expected None or an integer >= 1")
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise InputError(f"residual={residual!r}; expected an integer >= 0 (tokens kept in full precision)")
        if attention not in ATTENTION_MODES:
            raise InputError(f"attention={attention!r}; expected one of {ATTENTION_MODES}")
        if flush not in FLUSH_MODES:
            raise InputError(f"flush={flush!r}; expected one of {FLUSH_MODES}")
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise InputError(f"stride={stride!r}; expected an integer >= 1 (tokens a sliding flush encodes at once)")
        if stride > 1 and flush != "sliding":
            raise InputError(f"stride={stride} applies to flush='sliding'; got flush={flush!r}")
        if chunks not in CHUNK_MODES:
            raise InputError(f"chunks={chunks!r}; expected one of {CHUNK_MODES}")
        per_token = separable(key_spec, value_spec)
        if flush == "sliding" and not per_token:
            raise InputError(
                f"flush='sliding' needs per-token layouts; {key_spec.describe()} keys / {value_spec.describe()} "
                "values share statistics across tokens: use flush='block'"
            )
        self.key_spec, self.value_spec = key_spec, value_spec
        self._same_spec = key_spec == value_spec
        self._granule = joint_granule(key_spec, value_spec)  # blocks of whole G-token groups join/split
        self.layer_idx, self.backend, self.residual, self.flush = layer_idx, backend, residual, flush
        self.chunks, self.stride = chunks, stride
        self.attention, self.cache_decoded, self._config = attention, cache_decoded, config
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None  # transformers sizes sliding masks from such layers
        self.kq: Quantizer | None = None
        self.vq: Quantizer | None = None
        self._rollback = rollback
        self._clear()

    def _clear(self) -> None:
        self.blocks: list[tuple[PackedKV, PackedKV]] = []
        self.block_tokens: list[int] = []
        self.packed_length = 0  # tokens [0, packed_length) are packed or evicted
        self.evicted = 0  # tokens [0, evicted) are dropped (sliding-window layers)
        self.packed_bytes = 0
        self.cumulative_length = 0
        self._decoded = DecodedHistory()
        self._ahead: tuple[PackedKV, PackedKV, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.edge: Any = None  # a sliding window's edge group, decoded and kept by kvq_core.integrations.hf.view.edge_view
        self._plan: WindowPlan | None = None  # the blocks last attended, checked once (window_plan)
        self._pending_codes = False
        self.last_attention_bits = 0.0  # stored bits when the last step attended (window at WINDOW_BITS)
        self.last_attention_elements = 0

    def __repr__(self) -> str:
        spec = self.key_spec.describe() if self.key_spec == self.value_spec else f"K={self.key_spec.describe()}, V={self.value_spec.describe()}"
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        return (f"KVQLayer({spec}, residual={self.residual}, flush={self.flush!r}{window}, blocks={len(self.blocks)}, "
                f"tokens={self.cumulative_length})")

    # -- mode ---------------------------------------------------------------------------------
    @property
    def codes_mode(self) -> bool:
        if self.attention != "auto":
            return self.attention == "codes"
        return getattr(self._config, "_attn_implementation", None) == "kvq"

    @property
    def same_spec(self) -> bool:
        """Keys and values share one spec (one quantizer, the fused window call): decided once, as the
        specs never change (comparing two frozen specs field by field costs ~1 us a decode step)."""
        return self._same_spec

    # -- transformers layer contract ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        for what, x, spec in (("keys", key_states, self.key_spec), ("values", value_states, self.value_spec)):
            if x.shape[-1] != spec.head_dim:
                mla = mla_dims(self._config) if self._config is not None else None
                hint = "" if mla is None else (
                    f" (multi-head latent attention: kvq caches the latent, kv_lora_rank={mla[0]}, as keys and the rope "
                    f"part, qk_rope_head_dim={mla[1]}, as values, as DeepseekV3 does; this model caches something else)")
                raise InputError(f"layer {self.layer_idx}: {what} have head_dim {x.shape[-1]}; the spec says {spec.head_dim}{hint}")
        device = str(key_states.device)
        self.kq = get_quantizer(self.key_spec, self._backend_for(self.key_spec, key_states, device), layer=self.layer_idx,
                                device=device)
        self.vq = self.kq if self.same_spec else get_quantizer(
            self.value_spec, self._backend_for(self.value_spec, key_states, device), layer=self.layer_idx, device=device)

    def _backend_for(self, spec: MethodSpec, key_states: torch.Tensor, device: str) -> str:
        """The backend named, or for "auto" one whose first call does not wait for a compiler
        (:func:`kvq_core.compile_ahead.select_backend`)."""
        if self.backend != "auto":
            return self.backend
        kv_heads = key_states.shape[1]
        q_heads = getattr(self._config, "num_attention_heads", None) or kv_heads
        return compile_ahead.select_backend(spec, device, kv_heads, q_heads)

    def check_step(self, key_states: Any, value_states: Any) -> None:
        """Reject a step's K/V before anything is stored (window included): torch tensors of rank 4
        in a float dtype, head_dims of the specs, the batch and heads of what is stored, finite."""
        for what, x, spec in (("keys", key_states, self.key_spec), ("values", value_states, self.value_spec)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                shape = list(x.shape) if hasattr(x, "shape") else type(x).__name__
                raise InputError(f"layer {self.layer_idx}: {what} {shape}; expected a torch tensor [batch, kv_heads, tokens, head_dim]")
            if not x.is_floating_point():
                raise InputError(f"layer {self.layer_idx}: {what} have dtype {x.dtype}; expected a floating dtype")
            if x.shape[-1] != spec.head_dim:
                return  # named with its hint by lazy_initialization / check_kv
        stored = self.keys  # keys and values share batch and kv_heads
        if self.is_initialized and stored is not None and stored.dim() == 4:
            for what, x in (("keys", key_states), ("values", value_states)):
                if x.shape[:2] != stored.shape[:2]:
                    raise InputError(f"layer {self.layer_idx}: {what} have batch and kv_heads {list(x.shape[:2])}; "
                                     f"the cache holds {list(stored.shape[:2])}")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise InputError(f"layer {self.layer_idx}: keys {list(key_states.shape)} and values "
                             f"{list(value_states.shape)} differ in batch, kv_heads or tokens")
        for what, x, quantizer in (("keys", key_states, self.kq), ("values", value_states, self.vq)):
            if not all_finite(x, quantizer):
                raise InputError(f"layer {self.layer_idx}: {what} contain NaN or Inf; kvq rejects non-finite input "
                                 "before storing anything (window included)")

    def abort_step(self) -> None:
        """Undo this step everywhere (the owning :class:`~kvq_core.integrations.hf.cache.KVQCache` rolls back
        the layers it updated), e.g. when the attention function fails on this step's output."""
        if self._rollback is not None:
            self._rollback()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_step(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending_codes:
            raise KVQError(
                f"layer {self.layer_idx}: the previous step returned only the full-precision window for attention from "
                "codes, but the 'kvq' attention function never consumed it; load the model with "
                "attn_implementation='kvq' (kvq_core.integrations.hf.register()) or build the cache with attention='dequant'"
            )
        window_k = torch.cat([self.keys, key_states], dim=-2)
        window_v = torch.cat([self.values, value_states], dim=-2)
        base = self.cumulative_length - self.window_length  # tokens read from codes this step
        first = view_start(self.cumulative_length, self.sliding_window)  # first token this step's queries see
        block = self._encode_flush(window_k, window_v, base)  # first: rejected input leaves the layer unchanged
        self.keys, self.values = window_k, window_v
        self.cumulative_length += key_states.shape[-2]
        keys, values = step_view(self, block, base, first)
        b, h, w, _ = self.keys.shape
        per_token = self.keys.shape[-1] + self.values.shape[-1]  # K and V elements of one token and head
        self.last_attention_bits = 8.0 * self.packed_bytes + WINDOW_BITS * b * h * w * per_token
        self.last_attention_elements = b * h * (self.cumulative_length - self.evicted) * per_token
        if block is not None:
            self._commit(*block)
        self._settle(0 if block is None else block[2])
        if self.sliding_window is not None:
            self._evict(view_start(self.cumulative_length, self.sliding_window))
        return keys, values

    def _evict(self, target: int) -> None:
        """Drop stored tokens before position ``target`` that no later query can see (sliding
        window): whole blocks, the leading tokens of a per-token block, old window tokens."""
        plan = plan_eviction(self.block_tokens, self.evicted, target, self._granule)
        if plan.evicted == self.evicted:
            return
        blocks, tokens = self.blocks[plan.drop_blocks:], self.block_tokens[plan.drop_blocks:]
        freed = sum(pk.nbytes() + pv.nbytes() for pk, pv in self.blocks[:plan.drop_blocks])
        if plan.cut:
            pk, pv = blocks[0]
            blocks[0] = (slice_tokens(pk, plan.cut, tokens[0]), slice_tokens(pv, plan.cut, tokens[0]))
            tokens[0] -= plan.cut
            freed += pk.nbytes() + pv.nbytes() - blocks[0][0].nbytes() - blocks[0][1].nbytes()
        gone = plan.evicted - self.evicted
        self.blocks, self.block_tokens, self.evicted = blocks, tokens, plan.evicted
        self.packed_length = max(self.packed_length, plan.evicted)
        self.packed_bytes -= freed  # by difference: summing every block's layout each step is costly
        old_window = plan.evicted - (self.cumulative_length - self.window_length)
        if old_window > 0:
            self.keys, self.values = self.keys[:, :, old_window:].clone(), self.values[:, :, old_window:].clone()
        self._decoded.drop_front(gone, plan.evicted)

    def mark_pending(self) -> None:
        """Declare this step's output handed over for attention from codes
        (:func:`kvq_core.integrations.hf.view.step_view`): the next ``update`` raises unless the "kvq" attention
        function, or :meth:`mark_attended`, consumed it first."""
        self._pending_codes = True

    def mark_attended(self) -> None:
        """Declare the last ``update``'s output used: by the "kvq" attention function, or without
        it (e.g. K/V written by an external prefill), so codes mode does not report it unconsumed."""
        self._pending_codes = False

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the K/V the next ``update`` returns (as transformers' layers)."""
        first = view_start(self.cumulative_length, self.sliding_window)
        return self.cumulative_length - first + query_length, first

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self._clear()

    # -- storage ------------------------------------------------------------------------------
    @property
    def window_length(self) -> int:
        return 0 if self.keys is None or self.keys.dim() != 4 else self.keys.shape[-2]

    def _encode_flush(self, keys: torch.Tensor, values: torch.Tensor, base: int) -> tuple[PackedKV, PackedKV, int] | None:
        """The block to encode from window ``keys``/``values`` (its first token is token
        ``base``), or None (:func:`kvq_core.integrations.hf.flush.encode_range`). Changes nothing."""
        start, stop = encode_range(self.flush, self.residual, self.stride, keys.shape[-2], base, self.packed_length)
        if start == stop:
            return None
        pk = self.kq.encode_keys(keys[:, :, start:stop].contiguous())  # type: ignore[union-attr]
        pv = self.vq.encode_values(values[:, :, start:stop].contiguous())  # type: ignore[union-attr]
        return pk, pv, stop - start

    def _commit(self, pk: PackedKV, pv: PackedKV, m: int) -> None:
        """Append an encoded block of ``m`` tokens."""
        self.blocks.append((pk, pv))
        self.block_tokens.append(m)
        self.packed_length += m
        self.packed_bytes += pk.nbytes() + pv.nbytes()

    def _settle(self, encoded: int) -> None:
        """After a step's flush: drop the window tokens the policy no longer keeps exact, and
        under a sliding flush join the blocks :func:`kvq_core.integrations.hf.flush.join_range` names (codes
        copied, never re-quantized)."""
        drop = window_drop(self.flush, self.residual, self.window_length, encoded)
        if drop > 0:
            keys, values = self.keys[:, :, drop:], self.values[:, :, drop:]
            if drop > VIEW_DROP:  # else a view: the next step's cat copies the window anyway
                keys, values = keys.clone(), values.clone()
            self.keys, self.values = keys, values
        if not self._granule:
            return
        lo, hi = join_range(self.block_tokens, self.packed_length, self.cumulative_length - self.window_length)
        if hi - lo > 1 and all(t % self._granule == 0 for t in self.block_tokens[lo:hi - 1]):
            joined = (concat_tokens([pk for pk, _ in self.blocks[lo:hi]], self.kq.arrays),  # type: ignore[union-attr]
                      concat_tokens([pv for _, pv in self.blocks[lo:hi]], self.vq.arrays))  # type: ignore[union-attr]
            ahead = self._ahead
            if ahead is not None and any(pk is ahead[0] for pk, _ in self.blocks[lo:hi]):
                self.release_ahead()  # the block encoded ahead was passed and joined: its decoded copy goes
            self.blocks[lo:hi] = [joined]
            self.block_tokens[lo:hi] = [sum(self.block_tokens[lo:hi])]

    def window_plan(self, blocks: list[tuple[PackedKV, PackedKV]]) -> WindowPlan:
        """``blocks`` checked for the fused window call (:meth:`kvq_core.Quantizer.plan_window`), once
        while they stay the same objects: every decode step between two flushes reuses the plan. A plan
        is kept only while the layer holds all its blocks (:meth:`_forget_stale_plan`)."""
        plan = self._plan
        if plan is None or not plan.holds(blocks):
            plan = self.kq.plan_window(blocks)  # type: ignore[union-attr]
        if plan.holds(self.blocks):  # the usual step: the plan is of the layer's blocks, all of them
            self._plan = plan
            return plan
        live = {id(pk) for pk, _ in self.blocks}  # this step's flush may have joined some of them already
        live |= set() if self.edge is None else {id(pk) for pk, _ in self.edge.rest}  # a sliding window's edge
        self._plan = plan if all(id(pk) in live for pk, _ in blocks) else None  # then: used once, not kept
        return plan

    def _forget_stale_plan(self) -> None:
        """Drop the window plan once a block it holds has left the layer between steps (cropped, or replaced
        by a batch selection): it would keep that block's memory alive until the next step. (A step's own
        flush, join or eviction is seen by :meth:`window_plan`, after the step's attention used the plan.)"""
        plan = self._plan
        if plan is not None:
            held = {id(pk) for pk, _ in self.blocks}
            if any(id(pk) not in held for pk, _ in plan.pairs):
                self._plan = None

    def decode_block(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``i`` decoded (see :meth:`decode_pair`)."""
        return self.decode_pair(*self.blocks[i])

    def decode_ahead(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``i`` decoded, the last one asked for kept: a block a sliding stride encoded
        ahead is read decoded at every step until the window has passed it (codes mode), and
        decoding is deterministic, so it is decoded once. Kept by identity: a join, crop, restore
        or batch selection makes new blocks, which miss."""
        pk, pv = self.blocks[i]
        hit = self._ahead
        if hit is None or hit[0] is not pk or hit[1] is not pv:
            hit = self._ahead = (pk, pv, self.decode_pair(pk, pv))
        return hit[2]

    def release_ahead(self) -> None:
        """Free the decoded block :meth:`decode_ahead` kept: the window has passed it (called by each codes-mode
        step that reads no block encoded ahead), so a layer holds it only while it is read."""
        self._ahead = None

    def decode_pair(self, pk: PackedKV, pv: PackedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed (keys, values) block decoded to torch, in the window's device and dtype."""
        like = self.keys
        k = to_torch(self.kq.decode_keys(pk), like.device, like.dtype)  # type: ignore[union-attr]
        v = to_torch(self.vq.decode_values(pv), like.device, like.dtype)  # type: ignore[union-attr]
        return k, v

    def decoded_history(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All stored packed blocks decoded to ``[batch, kv_heads, packed_length - evicted, head_dim]`` (None if none)."""
        if not self.blocks:
            return None
        if not self.cache_decoded:
            parts = [self.decode_block(i) for i in range(len(self.blocks))]
            return torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-2)
        return self._decoded.extend(self.block_tokens, self.evicted, self.packed_length, self.decode_block)

    def select_decoded(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` of the decoded history copy (:func:`kvq_core.integrations.hf.batch.select_batch`)."""
        self._decoded.select(index)

    def drop_decoded(self) -> None:
        """Free the decoded copies (rebuilt on demand)."""
        self._decoded.clear()
        self.release_ahead()
        self.edge = None

    def snapshot(self) -> dict[str, Any]:
        """The layer's state, to undo the next ``update`` with :meth:`restore`. Holds references
        (updates rebind tensors, never write into them), not the decoded-history copy."""
        state = vars(self).copy()  # a C-level copy: ~3x faster than filtering in a comprehension
        del state["_decoded"]
        state["blocks"], state["block_tokens"] = list(self.blocks), list(self.block_tokens)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Back to a :meth:`snapshot`; the decoded history is rebuilt on demand."""
        vars(self).update(state)
        self.drop_decoded()

    def window_bytes(self) -> int:
        """Bytes the exact window holds, in the model's dtype: its tensors' storage (a view after a step's drop
        holds the dropped tokens until the next step's copy)."""
        if self.keys is None or self.keys.dim() != 4:
            return 0
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()

    def history_copy_bytes(self) -> int:
        """Bytes of the decoded history copy alone (:mod:`kvq_core.integrations.hf.decoded`)."""
        return self._decoded.nbytes()

    def decoded_bytes(self) -> int:
        """Bytes of decoded copies: the history (dequant mode), a block encoded ahead (codes
        mode, :meth:`decode_ahead`) and a sliding window's edge group (codes mode); not part of the stored cache."""
        held = [] if self._ahead is None else list(self._ahead[2])
        held += [] if self.edge is None else list(self.edge.decoded)
        return self._decoded.nbytes() + sum(t.numel() * t.element_size() for t in held)

    # -- batch and beam operations (:mod:`kvq_core.integrations.hf.batch`: codes moved, never re-quantized) --
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: batch row i becomes the old row ``beam_idx[i]``."""
        if self.is_initialized and self.cumulative_length:
            select_batch(self, beam_idx)
            self._forget_stale_plan()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (integers or a boolean mask)."""
        if self.is_initialized and self.cumulative_length:
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            select_batch(self, torch.as_tensor(indices))
            self._forget_stale_plan()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (beam search expansion)."""
        if self.is_initialized and self.cumulative_length:
            select_batch(self, torch.arange(batch_size(self)).repeat_interleave(repeats))
            self._forget_stale_plan()

    # -- crop (:func:`kvq_core.integrations.hf.flush.plan_crop`) ----------------------------------------------
    def check_crop(self, tokens_to_remove: int) -> tuple[int, int]:
        """Raise if ``crop(tokens_to_remove)`` is impossible; else return how many whole blocks it
        keeps and how many leading tokens of the next block (:func:`kvq_core.integrations.hf.flush.plan_crop`)."""
        return plan_crop(self.block_tokens, tokens_to_remove, cumulative=self.cumulative_length,
                         packed_length=self.packed_length, evicted=self.evicted, window=self.window_length,
                         granule=self._granule, layer=self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens from the end: from the window, then whole blocks.

        A cut inside a packed block keeps the block's leading tokens when the layout is per
        token; otherwise it raises (the block's statistics cover all its tokens; dropping some
        would need re-quantization).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as DynamicLayer")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        keep_blocks, keep_tokens = self.check_crop(tokens_to_remove)
        from_window = min(n, self.window_length)
        blocks, tokens = self.blocks[:keep_blocks], self.block_tokens[:keep_blocks]
        if keep_tokens:
            pk, pv = self.blocks[keep_blocks]
            blocks.append((slice_tokens(pk, 0, keep_tokens), slice_tokens(pv, 0, keep_tokens)))
            tokens.append(keep_tokens)
        if from_window:
            w = self.window_length - from_window
            self.keys, self.values = self.keys[:, :, :w].clone(), self.values[:, :, :w].clone()
        if tokens != self.block_tokens:
            self.blocks, self.block_tokens = blocks, tokens
            self.packed_length = sum(tokens)
            self.packed_bytes = sum(pk.nbytes() + pv.nbytes() for pk, pv in blocks)
            self._decoded.truncate(self.packed_length)
            self._forget_stale_plan()
        self.cumulative_length -= n


def separable(key_spec: MethodSpec, value_spec: MethodSpec) -> bool:
    """True when both layouts are per token, so packed blocks join and split along tokens."""
    return token_separable(key_spec, "keys") and token_separable(value_spec, "values")


def joint_granule(key_spec: MethodSpec, value_spec: MethodSpec) -> int:
    """Token count G such that blocks of whole G-token groups join and split exactly, keys and
    values alike (:func:`kvq_core.tokens.token_granule`; 1 for per-token layouts); 0 if none."""
    found = [token_granule(key_spec, "keys"), token_granule(value_spec, "values")]
    return 0 if None in found else math.lcm(*(g for g, _ in found))


def mla_dims(config: Any) -> tuple[int, int] | None:
    """(latent dim, rope dim) of a multi-head latent attention model (DeepseekV3 style), whose
    layers pass the compressed latent to the cache as "keys" and the shared rope part as
    "values", or None for ordinary attention."""
    rank = getattr(config, "kv_lora_rank", None)
    if rank is None:
        return None
    return int(rank), int(config.qk_rope_head_dim)
