"""What one :class:`~kvq_core.integrations.hf.layer.KVQLayer` step hands the model's attention.

Two ways to attend:

- ``attention="dequant"``: ``update`` returns full K/V (decoded blocks + window) to the
  model's own attention. Decoded history is cached per layer (``cache_decoded=True``,
  :mod:`kvq_core.integrations.hf.decoded`) so old blocks are decoded once; decoding is deterministic, so this
  is exact, but it holds a float copy of the history: :meth:`KVQCache.memory_report` lists
  those bytes separately.
- ``attention="codes"``: ``update`` returns only the window, tagged with the packed blocks (a
  :class:`CodesContext`); the ``"kvq"`` attention function (:mod:`kvq_core.integrations.hf.attention`) scores
  the blocks from their codes with ``Quantizer.attend`` and merges them with the window by
  log-sum-exp. Nothing is materialised. ``"auto"`` picks codes exactly when the model config's
  attention implementation is ``"kvq"`` (which :class:`~kvq_core.integrations.hf.cache.KVQCache` arranges).

A sliding-window layer whose window starts inside a token group reads the blocks after that group
from codes and the group's visible tokens decoded (:func:`edge_view`: one group per layer); in
dequant mode, or where the window starts inside the exact window, it hands its visible tokens over
decoded, so the K/V match the mask transformers builds. A sliding-flush step with ``chunks="decode"`` also carries the window's
packed tokens decoded (``flushed``), for queries ``residual`` or more tokens after them
(:mod:`kvq_core.integrations.hf.flush`).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kvq_core.integrations.hf.flush import blocks_before
from kvq_core.integrations.hf.window import plan_eviction
from kvq_core.packed import PackedKV
from kvq_core.tokens import slice_tokens

if TYPE_CHECKING:
    from kvq_core.integrations.hf.layer import KVQLayer

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class CodesContext:
    """What the ``"kvq"`` attention function needs besides the K/V it is handed.

    ``blocks``/``packed_length``: packed blocks not in the K/V (codes mode), scored from codes.
    ``history``: leading K/V tokens that are decoded history (dequant mode). ``flushed``: this
    step's sliding view: the window's first tokens decoded from their codes, for queries
    ``residual`` or more tokens after them (see :mod:`kvq_core.integrations.hf.flush`).
    ``leading``: how many of the ``history`` tokens lie before the packed blocks in position (a sliding
    window's edge group, :func:`edge_view`); the others lie after them.
    """

    layer: KVQLayer
    blocks: tuple[tuple[PackedKV, PackedKV], ...]
    packed_length: int
    history: int = 0
    flushed: Pair | None = None
    leading: int = 0


def attach_context(keys: torch.Tensor, ctx: CodesContext) -> None:
    """Tag ``keys`` (a view made for this step, never the layer's stored window) with ``ctx``, as
    its ``kvq_context`` attribute: the K/V travel through the model's attention module unchanged,
    so the tag reaches the "kvq" attention function with them (:func:`context_of`)."""
    keys.kvq_context = ctx  # type: ignore[attr-defined]


def context_of(key: torch.Tensor) -> CodesContext | None:
    """The :class:`CodesContext` a step attached to its keys (:func:`attach_context`); None for
    ordinary K/V."""
    return getattr(key, "kvq_context", None)


def step_view(layer: KVQLayer, block: tuple[PackedKV, PackedKV, int] | None, base: int, first: int) -> Pair:
    """The K/V ``layer.update`` returns, once its window holds this step's tokens: ``base`` is
    the window's first position, ``first`` the first position its queries see, ``block`` this
    step's flush (encoded, not yet stored). Codes mode marks the layer pending until attended."""
    # sliding: a query of this step may sit `residual` or more tokens after a window token
    decode_view = (layer.flush == "sliding" and layer.chunks == "decode" and layer.keys.shape[-2] > max(layer.residual, 1)
                   and base >= first)
    flushed = _window_codes(layer, block, base) if decode_view else None
    if layer.evicted < first <= base and flushed is None and layer.codes_mode:  # integers first: this runs every step
        # a sliding window starts inside a token group: the group's visible tokens decoded, the rest from codes
        blocks, edge = edge_view(layer, first)
        keys, values, h = layer.keys.view_as(layer.keys), layer.values.view_as(layer.values), 0
        if edge is not None:
            keys, values, h = torch.cat([edge[0], keys], dim=-2), torch.cat([edge[1], values], dim=-2), edge[0].shape[-2]
        attach_context(keys, CodesContext(layer, blocks, base - first - h, history=h, leading=h))
        layer.mark_pending()
    elif first > layer.evicted or base < first:
        # a sliding window starts inside a token-group block or inside the exact window: hand
        # the visible tokens over decoded, so K/V match the mask transformers builds
        keys, values = _visible(layer, base, first)
        if layer.codes_mode or flushed is not None:
            keys = keys.view_as(keys)
            attach_context(keys, CodesContext(layer, (), 0, history=max(base - first, 0), flushed=flushed))
            if layer.codes_mode:
                layer.mark_pending()
    elif layer.codes_mode:
        whole, part = _blocks_before(layer, base)
        keys, values = layer.keys.view_as(layer.keys), layer.values.view_as(layer.values)  # view_as: ~1 us, view(shape) ~4 us
        if part is not None:  # a block encoded ahead: its tokens before the window, decoded
            keys, values = torch.cat([part[0], keys], dim=-2), torch.cat([part[1], values], dim=-2)
        history = 0 if part is None else part[0].shape[-2]
        attach_context(keys, CodesContext(layer, tuple(layer.blocks[:whole]), base - history - layer.evicted,
                                          history=history, flushed=flushed))
        layer.mark_pending()
    else:
        keys, values = _visible(layer, base, first)
        if flushed is not None:
            keys = keys.view_as(keys)
            attach_context(keys, CodesContext(layer, (), 0, history=base - first, flushed=flushed))
    return keys, values


@dataclasses.dataclass(frozen=True)
class Edge:
    """The stored block a sliding window's edge falls in (kept by identity), from the whole groups
    eviction keeps (``cut``): its first group decoded and the rest of it from codes."""

    block: tuple[PackedKV, PackedKV]
    cut: int
    decoded: Pair
    rest: tuple[tuple[PackedKV, PackedKV], ...]  # the block after its first group (empty or one block)


def edge_view(layer: KVQLayer, first: int) -> tuple[tuple[tuple[PackedKV, PackedKV], ...], Pair | None]:
    """The blocks a query seeing tokens from ``first`` on reads from codes, and the visible tokens of
    the token group holding ``first`` decoded (None when ``first`` starts a group). Whole groups
    before ``first`` are left out, as eviction will drop them; the group the edge falls in is decoded
    once and kept (``KVQLayer.edge``) until its block changes, so a layer holds at most one decoded
    group, never a copy of its history."""
    plan = plan_eviction(layer.block_tokens, layer.evicted, first, layer._granule)
    later = tuple(layer.blocks[plan.drop_blocks + 1:])
    if first == plan.evicted or plan.drop_blocks == len(layer.blocks):
        head = layer.blocks[plan.drop_blocks:plan.drop_blocks + 1]
        if head and plan.cut:
            tokens = layer.block_tokens[plan.drop_blocks]
            head = [(slice_tokens(head[0][0], plan.cut, tokens), slice_tokens(head[0][1], plan.cut, tokens))]
        return (*head, *later), None
    block, edge = layer.blocks[plan.drop_blocks], layer.edge
    if edge is None or edge.block[0] is not block[0] or edge.block[1] is not block[1] or edge.cut != plan.cut:
        tokens = layer.block_tokens[plan.drop_blocks]
        group = min(plan.cut + layer._granule, tokens)
        decoded = layer.decode_pair(slice_tokens(block[0], plan.cut, group), slice_tokens(block[1], plan.cut, group))
        rest = () if group == tokens else ((slice_tokens(block[0], group, tokens), slice_tokens(block[1], group, tokens)),)
        edge = layer.edge = Edge(block, plan.cut, decoded, rest)
    skip = first - plan.evicted
    return (*edge.rest, *later), (edge.decoded[0][:, :, skip:], edge.decoded[1][:, :, skip:])


def _visible(layer: KVQLayer, base: int, first: int) -> Pair:
    """Decoded history from token ``first`` to ``base``, then the window from ``first`` on."""
    keys, values = layer.keys, layer.values
    if base < first:
        return keys[:, :, first - base:], values[:, :, first - base:]
    hist = layer.decoded_history()
    if hist is not None and base > first:
        lo, hi = first - layer.evicted, base - layer.evicted
        keys = torch.cat([hist[0][:, :, lo:hi], keys], dim=-2)
        values = torch.cat([hist[1][:, :, lo:hi], values], dim=-2)
    return keys, values


def _blocks_before(layer: KVQLayer, base: int) -> tuple[int, Pair | None]:
    """How many leading blocks lie wholly before token ``base``, and the decoded tokens before
    ``base`` of the next block (one a sliding stride encoded ahead), if any."""
    whole, part = blocks_before(layer.block_tokens, layer.evicted, base)
    if not part:
        layer.release_ahead()
        return whole, None
    k, v = layer.decode_ahead(whole)
    return whole, (k[:, :, :part], v[:, :, :part])


def _packed_from(layer: KVQLayer, base: int) -> Pair:
    """The packed tokens from ``base`` on, decoded: sliced from the decoded history where dequant mode
    keeps one, else decoded from the blocks that hold them, so codes mode builds no history copy."""
    lo = base - layer.evicted
    if not layer.codes_mode:
        hist = layer.decoded_history()
        return hist[0][:, :, lo:], hist[1][:, :, lo:]  # type: ignore[index]
    whole, part = blocks_before(layer.block_tokens, layer.evicted, base)
    decoded = [layer.decode_block(i) for i in range(whole, len(layer.blocks))]
    return torch.cat([k for k, _ in decoded], dim=-2)[:, :, part:], torch.cat([v for _, v in decoded], dim=-2)[:, :, part:]


def _window_codes(layer: KVQLayer, block: tuple[PackedKV, PackedKV, int] | None, base: int) -> Pair | None:
    """The window's packed tokens decoded (those encoded ahead by earlier steps, then this
    step's block), for a decode-view step: its queries read the older ones from codes."""
    parts = []
    if layer.packed_length > base:
        parts.append(_packed_from(layer, base))
    if block is not None:
        parts.append(layer.decode_pair(block[0], block[1]))
    if not parts:
        return None
    return torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-2)
