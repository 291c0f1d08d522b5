"""Which stored tokens a sliding-window layer may drop: plain integer logic, no torch.

A sliding-window attention layer of window W only ever attends to its W - 1 most recent
tokens plus the new ones (transformers' ``DynamicSlidingWindowLayer``). A kvq layer stores the
tokens [evicted, cumulative) as packed blocks (oldest first) and a full-precision window; after
each step it drops what no later query can see, i.e. everything before ``cumulative - (W - 1)``.
Per-token layouts cut a block at that edge; token-group layouts (OScaR, KIVI keys) cut it after
its last whole group before the edge, and until the rest is out the mask hides its old tokens.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Eviction:
    """The outcome of :func:`plan_eviction`.

    ``drop_blocks`` leading blocks go whole; then ``cut`` leading tokens of the next block go
    (0: none); ``evicted`` is the new first stored position (absolute).
    """

    drop_blocks: int
    cut: int
    evicted: int


def view_start(cumulative: int, sliding_window: int | None) -> int:
    """First position a query after ``cumulative`` tokens may attend (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(cumulative - (sliding_window - 1), 0)


def plan_eviction(block_tokens: Sequence[int], evicted: int, target: int, granule: int) -> Eviction:
    """Drop stored tokens before position ``target``: whole blocks (``block_tokens`` from
    position ``evicted`` on), then the leading whole ``granule``-token groups of a block that
    straddles ``target`` (1: any tokens of a per-token layout; 0: none, the block stays whole).
    When every block goes, the new first position is ``target`` (window tokens before it go too)."""
    if target <= evicted:
        return Eviction(0, 0, evicted)
    start, drop = evicted, 0
    for tokens in block_tokens:
        if start + tokens > target:
            cut = (target - start) // granule * granule if granule and start < target else 0
            return Eviction(drop, cut, start + cut)
        start += tokens
        drop += 1
    return Eviction(drop, 0, target)
