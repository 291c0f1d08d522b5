"""One engine step's plan for a token-group codec (OScaR, KIVI): built once per step on the host.

OScaR's and KIVI's keys are quantized per channel over ``G``-token groups, so a group can be coded
only once its ``G`` tokens exist. A request's context is therefore its *coded* tokens (whole groups,
in vLLM's pages; ``block_size`` is a multiple of ``G``, so groups never straddle pages) followed by
its *open group*: up to ``G - 1`` tokens kept exact (the model's K and V) in a staging buffer the
plugin owns, one slot per open group (:class:`StagingPool`), until the group completes; then the
whole group is encoded at once and its rows written into the page.

A slot is keyed by its group: ``(block id, group start)``. The block holding an open group is
the request's own (vLLM shares only full blocks), so two live requests never share a key, and a
key outlives its request only as a stale entry nobody reads: every request's first step starts at a
group boundary (position 0, or a prefix-cache hit of whole blocks), where the group's slot is
written from the step's own tokens before anything reads it. A step that starts inside a group
reads the earlier tokens from that group's slot; a missing slot is an error, never a silent
guess. The slot of a group that completes is kept (least-recently-used eviction) and holds all
its tokens, so a speculative-decoding rollback into that group (rejected drafts rewritten at the
same positions) finds them. No vLLM import: tested on its own.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvq_core.errors import KVQError


class StagingPool:
    """Which staging slot holds which open group: ``(block id, group start) -> slot``, LRU order."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))

    def find(self, key: tuple[int, int]) -> int | None:
        """The slot of ``key``'s group (marked recently used), or None."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def take(self, key: tuple[int, int], busy: set[tuple[int, int]]) -> int:
        """A slot for ``key`` (its own if it has one), evicting the least recently used key not in ``busy``."""
        slot = self.find(key)
        if slot is not None:
            return slot
        if not self._free:
            victim = next((k for k in self._slots if k not in busy), None)
            if victim is None:
                raise KVQError(f"kvq-vllm: {self.num_slots} staging slots cannot hold this step's "
                               f"{len(busy) + 1} open key groups")
            self._free.append(self._slots.pop(victim))
        slot = self._free.pop()
        self._slots[key] = slot
        return slot


@dataclass
class GroupPlan:
    """What one step writes and attends (tensors on the engine's device).

    - ``code_lens``, ``tail_lens``, ``tail_slot`` int32 ``[num_reqs]``: coded tokens (whole groups),
      exact tokens in the open group and its staging slot, after this step's tokens;
    - ``stage_slot``, ``stage_pos`` int64: the ``i``-th staged token goes to staging slot
      ``stage_slot[i]`` at offset ``stage_pos[i]`` (every token of a group that has a slot); it is step
      token ``stage_src[i]``, or token ``i`` when ``stage_src`` is None (a decode step: every token is
      staged, in order; the staging copy then gathers nothing);
    - ``groups``: how many groups complete this step; their ``groups * G`` rows are assembled
      (row ``at`` from staging ``(from_slot, from_pos)`` or from step token ``step_src``) and written
      by ``kvq::write_paged`` at slots ``write_slot`` (``block * block_size + offset``), group by group.
    """

    code_lens: torch.Tensor
    tail_lens: torch.Tensor
    tail_slot: torch.Tensor
    stage_slot: torch.Tensor
    stage_pos: torch.Tensor
    stage_src: torch.Tensor | None
    groups: int
    from_at: torch.Tensor
    from_slot: torch.Tensor
    from_pos: torch.Tensor
    step_at: torch.Tensor
    step_src: torch.Tensor
    write_slot: torch.Tensor


def plan_step(pool: StagingPool, group: int, block_size: int, query_start_loc: np.ndarray, seq_lens: np.ndarray,
              block_table: np.ndarray, device: torch.device | str = "cpu") -> GroupPlan:
    """The plan of one step from its host-side batch description (module docstring).

    ``query_start_loc [num_reqs + 1]``, ``seq_lens [num_reqs]`` (context after the step's tokens)
    and ``block_table [num_reqs, max_blocks]`` are NumPy integer arrays."""
    g = group
    lists: dict[str, list[np.ndarray]] = {k: [] for k in (
        "stage_slot", "stage_pos", "stage_src", "from_at", "from_slot", "from_pos", "step_at", "step_src",
        "write_slot")}
    reqs = len(seq_lens)
    code_lens = np.zeros(reqs, np.int32)
    tail_lens = np.zeros(reqs, np.int32)
    tail_slot = np.zeros(reqs, np.int32)
    busy: set[tuple[int, int]] = set()
    groups = 0

    def add(name: str, values: np.ndarray | int, like: np.ndarray) -> None:
        lists[name].append(np.broadcast_to(np.asarray(values, np.int64), like.shape))

    for r in range(reqs):
        end, first_tok = int(seq_lens[r]), int(query_start_loc[r])
        start = end - (int(query_start_loc[r + 1]) - first_tok)  # position of the step's first token
        if start == end:
            continue
        coded = end // g * g
        for gs in range(start // g * g, end, g):  # every group this step's tokens fall into
            key = (int(block_table[r, gs // block_size]), gs)
            new = np.arange(max(gs, start), min(gs + g, end))  # this step's positions in the group
            src = first_tok + new - start
            if gs < start:
                slot = pool.find(key)
                if slot is None:
                    raise KVQError(f"kvq-vllm: request {r} continues key group {gs}..{gs + g} (block {key[0]}) from "
                                   f"position {start}, but no staging slot holds its first {start - gs} tokens")
            elif gs + g > end:
                slot = pool.take(key, busy)  # the group opens in this step: its slot is written first
            else:
                slot = None  # opens and completes within this step: nothing to keep
            busy.add(key)
            if slot is not None:
                add("stage_slot", slot, new), add("stage_pos", new - gs, new), add("stage_src", src, new)
            if gs + g <= end:  # completes: assemble its rows, encode, write them into the page
                at = groups * g
                if gs < start:
                    old = np.arange(gs, start)
                    add("from_at", at + old - gs, old), add("from_slot", slot, old), add("from_pos", old - gs, old)
                add("step_at", at + new - gs, new), add("step_src", src, new)
                pos = np.arange(gs, gs + g)
                add("write_slot", block_table[r, pos // block_size] * block_size + pos % block_size, pos)
                groups += 1
            else:
                tail_slot[r], tail_lens[r] = slot, end - coded
        code_lens[r] = coded

    host = {name: np.concatenate(parts) if parts else np.zeros(0, np.int64) for name, parts in lists.items()}
    as_dev: dict[str, torch.Tensor | None] = {name: torch.from_numpy(a).to(device) for name, a in host.items()}
    if np.array_equal(host["stage_src"], np.arange(host["stage_src"].size)):
        as_dev["stage_src"] = None  # every token staged, in order (stage_tokens gathers nothing)
    i32 = {n: torch.from_numpy(a).to(device) for n, a in (("code_lens", code_lens), ("tail_lens", tail_lens),
                                                          ("tail_slot", tail_slot))}
    return GroupPlan(groups=groups, **i32, **as_dev)


def stage_tokens(plan: GroupPlan, tail: torch.Tensor, x: torch.Tensor) -> None:
    """Copy the step's tokens ``x [n_tokens, kv_heads, d]`` of groups with a slot into ``tail [slots, kv_heads, G, d]``
    (the same dtype: the model's).

    One ``index_put_`` on the ``[slots, G, kv_heads, d]`` view of ``tail`` (and one ``index_select`` of
    ``x`` unless every token is staged in order): it runs in every layer of every step, where
    advanced-indexing assignment cost twice as much (Python indexing, a gather, a scatter)."""
    staged = plan.stage_slot.shape[0]
    if plan.stage_src is not None:
        x = x.index_select(0, plan.stage_src)
    elif x.shape[0] != staged:
        x = x[:staged]
    tail.transpose(1, 2).index_put_((plan.stage_slot, plan.stage_pos), x)


def group_rows(plan: GroupPlan, tail: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The exact tokens of every group completing this step, group after group, ``[groups * G,
    kv_heads, d]`` (the tokens of ``kvq::write_paged``), from the staging ``tail`` (tokens of earlier
    steps) and ``x`` (this step's)."""
    g, heads, d = tail.shape[2], tail.shape[1], tail.shape[3]
    rows = x.new_empty(plan.groups * g, heads, d)
    rows.index_copy_(0, plan.from_at, tail.transpose(1, 2)[plan.from_slot, plan.from_pos])
    rows.index_copy_(0, plan.step_at, x.index_select(0, plan.step_src))
    return rows
