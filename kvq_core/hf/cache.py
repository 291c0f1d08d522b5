"""A transformers ``Cache`` that stores K/V as kvq packed blocks: :class:`KVQCache`, :class:`KVQLayer`.

Storage per layer (append-only):

- ``blocks``: a list of (packed keys, packed values), each a :class:`kvq_core.PackedKV` made by
  the layer's quantizer; never re-quantized;
- a full-precision *window* (``layer.keys`` / ``layer.values``) of the most recent tokens.

Flush policies (when exact tokens are packed: ``flush="block"`` / ``"sliding"``, ``stride``,
``chunks``) are described, and decided in plain integers, in :mod:`kvq_core.hf.flush`.

Sliding-window layers (``sliding_window=W``, e.g. Mistral, the local layers of Gemma 2/3) are
stored the same way, and after each step drop what no later query can see, everything before
the last W - 1 tokens (:mod:`kvq_core.hf.window`): ``update`` hands the model exactly the K/V a
transformers ``DynamicSlidingWindowLayer`` would (its mask sizes included), the recent exact
window staying exact. A per-token layout is cut at the window edge; a token-group block that
straddles it stays until all its tokens are out, and meanwhile its visible tokens are handed
over decoded (also in codes mode).

Two ways to attend:

- ``attention="dequant"``: ``update`` returns full K/V (decoded blocks + window) to the
  model's own attention. Decoded history is cached per layer (``cache_decoded=True``) so old
  blocks are decoded once; decoding is deterministic, so this is exact, but it holds a float
  copy of the history: :meth:`KVQCache.memory_report` lists those bytes separately.
- ``attention="codes"``: ``update`` returns only the window, tagged with the packed blocks;
  the ``"kvq"`` attention function (:mod:`kvq_core.hf.attention`) scores the blocks from their
  codes with ``Quantizer.attend`` and merges them with the window by log-sum-exp. Nothing is
  materialised. ``"auto"`` picks codes exactly when the model config's attention
  implementation is ``"kvq"``.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicLayer, get_layer_types_and_kwargs

from kvq_core.api import Quantizer, get_quantizer
from kvq_core.errors import InputError, KVQError
from kvq_core.hf.decoded import DecodedHistory
from kvq_core.hf.flush import FLUSH_MODES, blocks_before, encode_range, join_range, plan_crop, window_drop
from kvq_core.hf.window import plan_eviction, view_start
from kvq_core.layout import PackedKV, concat_tokens, slice_tokens, token_separable
from kvq_core.registry import make_spec
from kvq_core.spec import MethodSpec

ATTENTION_MODES = ("auto", "dequant", "codes")
CHUNK_MODES = ("exact", "decode")
WINDOW_BITS = 16  # exact tokens are counted as a float16/bfloat16 deployment stores them


def to_torch(x: Any, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A backend array (NumPy or torch) as a torch tensor on ``device`` in ``dtype``."""
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.to(device=device if device is not None else t.device, dtype=dtype if dtype is not None else t.dtype)


def _take_batch(x: Any, index: torch.Tensor) -> Any:
    """Rows ``index`` of the leading (batch) axis of a backend array, in the same array type."""
    if isinstance(x, torch.Tensor):
        return x.index_select(0, index.to(x.device))
    return np.take(np.asarray(x), index.cpu().numpy(), axis=0)


def _packed_take_batch(p: PackedKV, index: torch.Tensor) -> PackedKV:
    """A packed block with its batch rows selected (codes untouched: no re-quantization)."""
    layout = p.layout
    for name, field in layout.items():
        if not field.shape or field.shape[0] != p.shape[0]:
            raise KVQError(
                f"{p.spec.method} {p.kind} field {name!r} has shape {list(field.shape)} without a leading batch "
                f"axis of {p.shape[0]}; batch reordering needs one"
            )
    out = p.map_fields(lambda a: _take_batch(a, index))
    return dataclasses.replace(out, shape=(int(index.numel()), *p.shape[1:]))


class KVQLayer(DynamicLayer):
    """One attention layer: packed blocks (append-only) plus a full-precision window.

    ``keys``/``values`` hold the window ``[batch, kv_heads, w, head_dim]``. ``key_spec`` and
    ``value_spec`` may differ (e.g. more bits for keys); attention from codes then decodes.
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
        self._per_token = per_token  # computed once: it builds layouts (~40 us), and _evict runs every step
        self.layer_idx, self.backend, self.residual, self.flush = layer_idx, backend, residual, flush
        self.chunks, self.stride = chunks, stride
        self.attention, self.cache_decoded, self._config = attention, cache_decoded, config
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None  # transformers sizes sliding masks from such layers
        self.kq: Quantizer | None = None
        self.vq: Quantizer | None = None
        self._clear()

    def _clear(self) -> None:
        self.blocks: list[tuple[PackedKV, PackedKV]] = []
        self.block_tokens: list[int] = []
        self.packed_length = 0  # tokens [0, packed_length) are packed or evicted
        self.evicted = 0  # tokens [0, evicted) are dropped (sliding-window layers)
        self.packed_bytes = 0
        self.cumulative_length = 0
        self._decoded = DecodedHistory()
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
        return self.key_spec == self.value_spec

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
        self.kq = get_quantizer(self.key_spec, self.backend, layer=self.layer_idx, device=device)
        self.vq = self.kq if self.same_spec else get_quantizer(self.value_spec, self.backend, layer=self.layer_idx, device=device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending_codes:
            raise KVQError(
                f"layer {self.layer_idx}: the previous step returned only the full-precision window for attention from "
                "codes, but the 'kvq' attention function never consumed it; load the model with "
                "attn_implementation='kvq' (kvq_core.hf.register()) or build the cache with attention='dequant'"
            )
        window_k = torch.cat([self.keys, key_states], dim=-2)
        window_v = torch.cat([self.values, value_states], dim=-2)
        base = self.cumulative_length - self.window_length  # tokens read from codes this step
        first = view_start(self.cumulative_length, self.sliding_window)  # first token this step's queries see
        block = self._encode_flush(window_k, window_v, base)  # first: rejected input leaves the layer unchanged
        self.keys, self.values = window_k, window_v
        self.cumulative_length += key_states.shape[-2]
        # sliding: a query of this step may sit `residual` or more tokens after a window token
        decode_view = (self.flush == "sliding" and self.chunks == "decode" and window_k.shape[-2] > max(self.residual, 1)
                       and base >= first)
        flushed = self._window_codes(block, base) if decode_view else None
        if first > self.evicted or base < first:
            # a sliding window starts inside a token-group block or inside the exact window: hand
            # the visible tokens over decoded, so K/V match the mask transformers builds
            keys, values = self._visible(base, first)
            if self.codes_mode or flushed is not None:
                keys = keys.view(keys.shape)
                keys._kvq_context = CodesContext(self, (), 0, history=max(base - first, 0), flushed=flushed)  # type: ignore[attr-defined]
                self._pending_codes = self.codes_mode
        elif self.codes_mode:
            whole, part = self._blocks_before(base)
            keys, values = self.keys.view(self.keys.shape), self.values.view(self.values.shape)
            if part is not None:  # a block encoded ahead: its tokens before the window, decoded
                keys, values = torch.cat([part[0], keys], dim=-2), torch.cat([part[1], values], dim=-2)
            history = 0 if part is None else part[0].shape[-2]
            keys._kvq_context = CodesContext(self, tuple(self.blocks[:whole]), base - history - self.evicted,  # type: ignore[attr-defined]
                                             history=history, flushed=flushed)
            self._pending_codes = True
        else:
            keys, values = self._visible(base, first)
            if flushed is not None:
                keys = keys.view(keys.shape)
                keys._kvq_context = CodesContext(self, (), 0, history=base - first, flushed=flushed)  # type: ignore[attr-defined]
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

    def _visible(self, base: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded history from token ``first`` to ``base``, then the window from ``first`` on."""
        keys, values = self.keys, self.values
        if base < first:
            return keys[:, :, first - base:], values[:, :, first - base:]
        hist = self.decoded_history()
        if hist is not None and base > first:
            lo, hi = first - self.evicted, base - self.evicted
            keys = torch.cat([hist[0][:, :, lo:hi], keys], dim=-2)
            values = torch.cat([hist[1][:, :, lo:hi], values], dim=-2)
        return keys, values

    def _evict(self, target: int) -> None:
        """Drop stored tokens before position ``target`` that no later query can see (sliding
        window): whole blocks, the leading tokens of a per-token block, old window tokens."""
        plan = plan_eviction(self.block_tokens, self.evicted, target, self._per_token)
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

    def mark_attended(self) -> None:
        """Declare the last ``update``'s output used without the "kvq" attention function
        (e.g. K/V written by an external prefill), so codes mode does not report it unconsumed."""
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
        ``base``), or None (:func:`kvq_core.hf.flush.encode_range`). Changes nothing."""
        start, stop = encode_range(self.flush, self.residual, self.stride, keys.shape[-2], base, self.packed_length)
        if start == stop:
            return None
        pk = self.kq.encode_keys(keys[:, :, start:stop].contiguous())  # type: ignore[union-attr]
        pv = self.vq.encode_values(values[:, :, start:stop].contiguous())  # type: ignore[union-attr]
        return pk, pv, stop - start

    def _blocks_before(self, base: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None]:
        """How many leading blocks lie wholly before token ``base``, and the decoded tokens
        before ``base`` of the next block (one a sliding stride encoded ahead), if any."""
        whole, part = blocks_before(self.block_tokens, self.evicted, base)
        if not part:
            return whole, None
        k, v = self.decode_block(whole)
        return whole, (k[:, :, :part], v[:, :, :part])

    def _window_codes(self, block: tuple[PackedKV, PackedKV, int] | None, base: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The window's packed tokens decoded (those encoded ahead by earlier steps, then this
        step's block), for a decode-view step: its queries read the older ones from codes."""
        parts = []
        if self.packed_length > base:
            hist = self.decoded_history()
            parts.append((hist[0][:, :, base - self.evicted:], hist[1][:, :, base - self.evicted:]))  # type: ignore[index]
        if block is not None:
            parts.append(self.decode_pair(block[0], block[1]))
        if not parts:
            return None
        return torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-2)

    def _commit(self, pk: PackedKV, pv: PackedKV, m: int) -> None:
        """Append an encoded block of ``m`` tokens."""
        self.blocks.append((pk, pv))
        self.block_tokens.append(m)
        self.packed_length += m
        self.packed_bytes += pk.nbytes() + pv.nbytes()

    def _settle(self, encoded: int) -> None:
        """After a step's flush: drop the window tokens the policy no longer keeps exact, and
        under a sliding flush join the blocks :func:`kvq_core.hf.flush.join_range` names (codes
        copied, never re-quantized)."""
        drop = window_drop(self.flush, self.residual, self.window_length, encoded)
        if drop > 0:
            self.keys = self.keys[:, :, drop:].clone()
            self.values = self.values[:, :, drop:].clone()
        if self.flush != "sliding":
            return
        lo, hi = join_range(self.block_tokens, self.packed_length, self.cumulative_length - self.window_length)
        if hi - lo > 1:
            joined = (concat_tokens([pk for pk, _ in self.blocks[lo:hi]], self.kq.arrays),  # type: ignore[union-attr]
                      concat_tokens([pv for _, pv in self.blocks[lo:hi]], self.vq.arrays))  # type: ignore[union-attr]
            self.blocks[lo:hi] = [joined]
            self.block_tokens[lo:hi] = [sum(self.block_tokens[lo:hi])]

    def decode_block(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_pair(*self.blocks[i])

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

    def drop_decoded(self) -> None:
        """Free the decoded-history copy (it is rebuilt on demand)."""
        self._decoded.clear()

    def snapshot(self) -> dict[str, Any]:
        """The layer's state, to undo the next ``update`` with :meth:`restore`. Holds references
        (updates rebind tensors, never write into them), not the decoded-history copy."""
        state = {k: v for k, v in vars(self).items() if k != "_decoded"}
        state["blocks"], state["block_tokens"] = list(self.blocks), list(self.block_tokens)
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Back to a :meth:`snapshot`; the decoded history is rebuilt on demand."""
        vars(self).update(state)
        self.drop_decoded()

    def window_bytes(self) -> int:
        if self.window_length == 0:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def decoded_bytes(self) -> int:
        return self._decoded.nbytes()

    # -- batch and beam operations (codes are moved, never re-quantized) ---------------------
    def _map_batch(self, index: torch.Tensor) -> None:
        index = index.to(torch.long)
        self.blocks = [(_packed_take_batch(pk, index), _packed_take_batch(pv, index)) for pk, pv in self.blocks]
        if self.window_length or (self.keys is not None and self.keys.dim() == 4):
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
            self.values = self.values.index_select(0, index.to(self.values.device))
        self._decoded.select(index)
        self.packed_bytes = sum(pk.nbytes() + pv.nbytes() for pk, pv in self.blocks)

    def _batch(self) -> int:
        if self.blocks:
            return self.blocks[0][0].shape[0]
        return self.keys.shape[0] if self.keys is not None and self.keys.dim() == 4 else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized and self.cumulative_length:
            self._map_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self.cumulative_length:
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            self._map_batch(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self.cumulative_length:
            self._map_batch(torch.arange(self._batch()).repeat_interleave(repeats))

    def check_crop(self, tokens_to_remove: int) -> tuple[int, int]:
        """Raise if ``crop(tokens_to_remove)`` is impossible; else return how many whole blocks it
        keeps and how many leading tokens of the next block (:func:`kvq_core.hf.flush.plan_crop`)."""
        return plan_crop(self.block_tokens, tokens_to_remove, cumulative=self.cumulative_length,
                         packed_length=self.packed_length, evicted=self.evicted, window=self.window_length,
                         per_token=self._per_token, layer=self.layer_idx)

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
        self.cumulative_length -= n


@dataclasses.dataclass(frozen=True)
class CodesContext:
    """What the ``"kvq"`` attention function needs besides the K/V it is handed.

    ``blocks``/``packed_length``: packed blocks not in the K/V (codes mode), scored from codes.
    ``history``: leading K/V tokens that are decoded history (dequant mode). ``flushed``: this
    step's sliding view: the window's first tokens decoded from their codes, for queries
    ``residual`` or more tokens after them (see the module doc).
    """

    layer: KVQLayer
    blocks: tuple[tuple[PackedKV, PackedKV], ...]
    packed_length: int
    history: int = 0
    flushed: tuple[torch.Tensor, torch.Tensor] | None = None


def separable(key_spec: MethodSpec, value_spec: MethodSpec) -> bool:
    """True when both layouts are per token, so packed blocks join and split along tokens."""
    return token_separable(key_spec, "keys") and token_separable(value_spec, "values")


def _head_dim(config: Any) -> int:
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else int(config.hidden_size // config.num_attention_heads)


def mla_dims(config: Any) -> tuple[int, int] | None:
    """(latent dim, rope dim) of a multi-head latent attention model (DeepseekV3 style), whose
    layers pass the compressed latent to the cache as "keys" and the shared rope part as
    "values", or None for ordinary attention."""
    rank = getattr(config, "kv_lora_rank", None)
    if rank is None:
        return None
    return int(rank), int(config.qk_rope_head_dim)


#: Layer types whose K/V kvq stores (the others keep their transformers layer, exact).
QUANTIZED_TYPES = ("full_attention", "sliding_attention")
SLIDING_MODES = ("quantize", "exact")


def _resolve_layers(spec_layers: Iterable[int] | None, n: int, what: str) -> set[int]:
    out = set()
    for i in spec_layers or ():
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= i < n:
            raise InputError(f"{what}: layer {i!r} is not an index into {n} layers")
        out.add(int(i) % n)
    return out


class KVQCache(Cache):
    """A transformers ``Cache`` storing K/V with a kvq method, built from a model config.

    ``KVQCache(config, method="oscar", backend="auto", residual=None, bits=2)``

    Args:
        config: the model's ``PretrainedConfig`` (its text config is used). Full-attention and
            sliding-window layers are quantized; other layer types (chunked, linear attention, ...)
            keep their transformers layer in full precision. Every layer kept exact is listed in
            :meth:`memory_report` (``exact_layers``) and named once in a warning. Multi-head latent
            attention (DeepseekV3) caches the latent and the rope part with the method's codec
            (two specs of their widths); the model expands them after the cache, so those layers
            attend by decoding (``attention="codes"`` is refused).
        method: a registered kvq method name (``kvq_core.list_methods()``).
        backend: a kvq backend name, or "auto" (picks torch when available for the device).
        residual: tokens kept in full precision (see module doc); default is the method spec's
            ``default_residual`` (OScaR/KIVI 128, OCTOPUS 32).
        flush: "block" or "sliding" (module doc); default is the spec's ``default_flush``
            ("sliding" for OCTOPUS, TurboQuant and PolarQuant, "block" otherwise), "block" when
            either layout shares statistics across tokens.
        stride: tokens a sliding flush encodes at once (module doc): 1 encodes one token per
            step; S > 1 encodes every S steps, holding up to S - 1 tokens twice. Attention is
            the same either way.
        chunks: "exact" or "decode": how a multi-token step of a sliding layer attends (module
            doc); settable later through the ``chunks`` property (e.g. after a prefill).
        sliding_layers: "quantize" (default) stores sliding-window layers (Mistral, Gemma 2/3
            local layers, ...) in kvq codes too: tokens leave at the window edge as in transformers'
            sliding layers, and the method's exact recent window stays exact; "exact" keeps them as
            transformers layers in full precision.
        fp_layers: layers kept entirely in full precision (``DynamicLayer``), e.g. ``(0, -1)``.
        fp_key_layers: layers whose keys are stored as float16 (method "fp16") and values quantized.
        value_method, value_params: a different codec for values; by default values use
            ``method`` and ``method_params`` updated with ``value_params`` (e.g. ``{"bits": 2}``
            with ``bits=3`` gives 3-bit keys and 2-bit values).
        layer_params: ``{layer: {param: value}}`` overrides for keys and values of one layer.
        attention: "auto" (codes when the config's attention implementation is "kvq"),
            "dequant" or "codes".
        cache_decoded: keep decoded history per layer in dequant mode (exact, faster, not smaller).
        **method_params: the method's spec parameters (e.g. ``bits=2``); ``head_dim`` comes from
            the config.
    """

    def __init__(
        self,
        config: Any,
        method: str = "oscar",
        backend: str = "auto",
        *,
        residual: int | None = None,
        flush: str | None = None,
        stride: int = 1,
        chunks: str = "exact",
        fp_layers: Iterable[int] = (),
        fp_key_layers: Iterable[int] = (),
        value_method: str | None = None,
        value_params: Mapping[str, Any] | None = None,
        layer_params: Mapping[int, Mapping[str, Any]] | None = None,
        attention: str = "auto",
        cache_decoded: bool = True,
        sliding_layers: str = "quantize",
        **method_params: Any,
    ) -> None:
        from kvq_core.hf.attention import register

        register()  # so attn_implementation="kvq" works whenever a KVQCache exists
        if sliding_layers not in SLIDING_MODES:
            raise InputError(f"sliding_layers={sliding_layers!r}; expected one of {SLIDING_MODES}")
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.config = text_config
        self.method, self.backend = method, backend
        mla = mla_dims(text_config)
        if mla is not None and attention == "codes":
            raise InputError(
                f"attention='codes' is not possible for multi-head latent attention ({text_config.model_type}): the "
                "model expands the cached latent into K/V after the cache; use attention='dequant' or 'auto'"
            )
        head_dim, value_dim = mla if mla is not None else (_head_dim(text_config),) * 2
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        n = len(layer_types)
        self.fp_layers = _resolve_layers(fp_layers, n, "fp_layers")
        self.fp_key_layers = _resolve_layers(fp_key_layers, n, "fp_key_layers")
        layer_params = {int(k) % n: dict(v) for k, v in (layer_params or {}).items()}
        self.method_params = dict(method_params)
        layers: list[Any] = []
        self.exact_layers: dict[int, str] = {}  # layer -> why its K/V stay in full precision
        for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            quantize = kind in QUANTIZED_TYPES and not (kind == "sliding_attention" and sliding_layers == "exact")
            if not quantize or i in self.fp_layers:
                layers.append(DynamicLayer() if kind == "full_attention" else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
                if kind not in ("dummy",):
                    self.exact_layers[i] = "fp_layers" if i in self.fp_layers else (
                        "sliding_layers='exact'" if kind == "sliding_attention" else f"layer type {kind!r}")
                continue
            over = layer_params.get(i, {})
            key_params = {**method_params, **over, "head_dim": head_dim}
            key_spec = make_spec("fp16", head_dim=head_dim) if i in self.fp_key_layers else make_spec(method, **key_params)
            if value_method is None:
                value_spec = make_spec(method, **{**key_params, **(value_params or {}), "head_dim": value_dim})
            else:
                value_spec = make_spec(value_method, **{**(value_params or {}), **over, "head_dim": value_dim})
            base = value_spec if i in self.fp_key_layers else key_spec
            r = residual if residual is not None else type(base).default_residual
            f = flush
            if f is None:
                f = type(base).default_flush if separable(key_spec, value_spec) else "block"
            layers.append(
                KVQLayer(
                    key_spec, value_spec, layer_idx=i, backend=backend, residual=r, flush=f, stride=stride, chunks=chunks,
                    attention="dequant" if mla is not None else attention, cache_decoded=cache_decoded,
                    config=text_config, sliding_window=kwargs.get("sliding_window") if kind == "sliding_attention" else None,
                )
            )
        super().__init__(layers=layers)
        self.mla = mla is not None
        unchosen = {i: why for i, why in self.exact_layers.items() if why != "fp_layers"}
        if unchosen:
            listed = ", ".join(f"{i} ({why})" for i, why in sorted(unchosen.items()))
            warnings.warn(f"KVQCache({method!r}): {len(unchosen)} of {n} layers keep full-precision K/V: {listed}; "
                          "see memory_report()['exact_layers']", stacklevel=2)
        self._step: dict[int, dict[str, Any]] | None = None  # layer states at the start of this step

    def __repr__(self) -> str:
        return f"KVQCache(method={self.method!r}, backend={self.backend!r}, params={self.method_params}, layers={len(self.layers)})"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``Cache.update``, with one step (the layer updates of one forward, layer 0 first)
        all or nothing: when a layer rejects its input with a ``KVQError``, the layers already
        updated in this step are put back before the error propagates."""
        if layer_idx == 0 or self._step is None:
            self._step = {}
        self._step[layer_idx] = _snapshot(self.layers[layer_idx])
        try:
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except KVQError:
            for i, state in self._step.items():
                _restore(self.layers[i], state)
            self._step = None
            raise
        if layer_idx == len(self.layers) - 1:
            self._step = None
        return out

    @property
    def chunks(self) -> str:
        """How multi-token steps of sliding layers attend: "exact" or "decode" (module doc)."""
        modes = {layer.chunks for layer in self.kvq_layers}
        return modes.pop() if len(modes) == 1 else "exact"

    @chunks.setter
    def chunks(self, mode: str) -> None:
        if mode not in CHUNK_MODES:
            raise InputError(f"chunks={mode!r}; expected one of {CHUNK_MODES}")
        for layer in self.kvq_layers:
            layer.chunks = mode

    @property
    def kvq_layers(self) -> list[KVQLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVQLayer)]

    def drop_decoded(self) -> None:
        for layer in self.kvq_layers:
            layer.drop_decoded()

    def crop(self, tokens_to_remove: int) -> None:
        """As ``Cache.crop``, but checks every layer first so a refused crop changes nothing."""
        for layer in self.kvq_layers:
            layer.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    # -- accounting ---------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the cache holds now: packed blocks + exact windows + full-precision layers.

        The decoded-history copy kept for dequant-mode attention is *not* included; see
        :meth:`memory_report` (``decoded_bytes``).
        """
        r = self.memory_report()
        return r["packed_bytes"] + r["window_bytes"] + r["fp_layer_bytes"]

    def memory_report(self) -> dict[str, Any]:
        """Byte and bit accounting, per kind of storage.

        ``bits_per_element`` is stored bits over K/V elements at the last attention step, with
        exact tokens (windows, full-precision layers) counted at 16 bits, as a float16 model
        stores them. ``exact_layers`` maps each layer kept entirely in full precision to why
        (``fp_layers``, ``sliding_layers='exact'``, or a layer type kvq does not store); their
        bytes are ``fp_layer_bytes``. ``dynamic_cache_bytes`` is what a ``DynamicCache`` holding the same tokens
        in the model's dtype would hold.
        """
        packed = window = fp = dec = dyn = 0
        bits = elements = 0.0
        for layer in self.layers:
            if isinstance(layer, KVQLayer):
                packed += layer.packed_bytes
                window += layer.window_bytes()
                dec += layer.decoded_bytes()
                bits += layer.last_attention_bits
                elements += layer.last_attention_elements
                if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
                    b, h = layer.keys.shape[:2]
                    tokens = layer.cumulative_length  # a DynamicSlidingWindowLayer holds sliding_window - 1
                    if layer.sliding_window is not None:
                        tokens = min(tokens, layer.sliding_window - 1)
                    dyn += b * h * tokens * (layer.keys.shape[-1] + layer.values.shape[-1]) * layer.keys.element_size()
            elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                nb = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                fp += nb
                dyn += nb
                e = layer.keys.numel() + layer.values.numel()
                bits += WINDOW_BITS * e
                elements += e
        return {
            "packed_bytes": packed,
            "window_bytes": window,
            "fp_layer_bytes": fp,
            "decoded_bytes": dec,
            "total_bytes": packed + window + fp,
            "dynamic_cache_bytes": dyn,
            "bits_per_element": bits / elements if elements else math.nan,
            "exact_layers": dict(self.exact_layers),
        }

    def bits_per_element(self) -> float:
        """Stored bits per K/V element at the last attention step (exact tokens at 16 bits)."""
        return self.memory_report()["bits_per_element"]


def _snapshot(layer: Any) -> dict[str, Any]:
    """A layer's state before an update, for :func:`_restore`. transformers' layers rebind their
    tensors on update, so attribute references suffice; a plain ``DynamicLayer`` (append-only)
    keeps its history's length instead, so the step holds no second copy of it."""
    if isinstance(layer, KVQLayer):
        return layer.snapshot()
    state = dict(vars(layer))
    if type(layer) is DynamicLayer:
        for name in ("keys", "values"):
            if isinstance(state.get(name), torch.Tensor) and state[name].dim() == 4:
                state[name] = state[name].shape[-2]
    return state


def _restore(layer: Any, state: dict[str, Any]) -> None:
    """Undo the updates since :func:`_snapshot`."""
    if isinstance(layer, KVQLayer):
        layer.restore(state)
        return
    state = dict(state)
    for name in ("keys", "values"):
        if isinstance(state.get(name), int):
            state[name] = getattr(layer, name)[:, :, : state[name]]
    vars(layer).update(state)


def dynamic_cache_nbytes(cache: Cache) -> int:
    """Bytes a transformers cache holds in its layers' ``keys``/``values`` tensors."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
