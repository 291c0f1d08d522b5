"""A layer's packed blocks checked and converted once, for many fused window calls.

:meth:`kvq_core.Quantizer.plan_window` checks a list of (packed keys, packed values) blocks
against the quantizer (spec, layer, kind, layout, shapes) and converts their fields to the
backend's arrays; :meth:`kvq_core.Quantizer.attend_window` takes the plan in place of the list
and then checks only the query and the window. A cache layer's blocks change only when it
flushes, so its decode steps reuse one plan (plan once, run many; FlashInfer's split), and the
kernel keeps what it derives from the blocks in the plan's :class:`~kvq_core.contract.KernelBlocks`
``memo``. Reuse is by identity: a plan holds its blocks, and it is current only while each of
them still holds the fields it was checked with (:meth:`kvq_core.PackedKV.is_validated`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvq_core.contract import KernelBlocks
from kvq_core.packed import PackedKV


@dataclasses.dataclass(frozen=True, eq=False)
class WindowPlan:
    """Blocks checked by ``owner`` (a :class:`kvq_core.Quantizer`) for ``layer``: ``pairs`` as
    given, ``blocks`` their fields in the backend's arrays with token counts (what kernels take),
    ``shape`` ``(batch, kv_heads, tokens of all blocks, head_dim)`` (None without blocks), and
    ``state`` the quantizer's (spec, kernels) they were checked with."""

    owner: Any
    layer: int
    state: Any
    pairs: tuple[tuple[PackedKV, PackedKV], ...]
    blocks: KernelBlocks
    shape: tuple[int, int, int, int] | None

    def holds(self, pairs: Sequence[tuple[PackedKV, PackedKV]]) -> bool:
        """Whether ``pairs`` are this plan's blocks, the same objects in the same order."""
        mine = self.pairs
        if len(pairs) != len(mine):
            return False
        for (pk, pv), (mk, mv) in zip(pairs, mine):
            if pk is not mk or pv is not mv:
                return False
        return True

    def current(self, owner: Any, layer: int) -> bool:
        """Whether ``owner`` may run this plan for ``layer`` without checking its blocks again: it
        made it, with the state it has now, and no block's fields were swapped since."""
        if owner is not self.owner or layer != self.layer or self.state is not owner._bound:
            return False
        for pk, pv in self.pairs:
            if not (pk.is_validated() and pv.is_validated()):
                return False
        return True
