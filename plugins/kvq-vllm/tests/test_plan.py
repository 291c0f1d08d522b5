"""The token-group step plan alone (no vLLM): after every step, a request's coded positions (in the
pages) and its open group (in its staging slot) hold exactly its own latest keys, under chunked
prefill, batching, a speculative-decoding rollback, and a finished request's blocks and slot reused
by another. The "codec" here stores exact keys, so any misplaced or stale row shows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq_core.errors import KVQError
from kvq_vllm.plan import StagingPool, group_rows, plan_step, stage_tokens

G, BS, HEADS, D, BLOCKS = 4, 8, 2, 3, 16


def value(req: str, pos: int, version: int) -> torch.Tensor:
    """A token's K: distinct per request, position and version (a rewritten draft differs)."""
    seed = (hash(req) % 997) * 10_000 + pos * 10 + version
    return torch.full((HEADS, D), float(seed)) + torch.arange(HEADS * D, dtype=torch.float32).view(HEADS, D) / 100


class Engine:
    """Pages of exact keys, the staging tail and the pool; ``step`` runs one batch like the backend."""

    def __init__(self, slots: int = 8) -> None:
        self.pages = torch.zeros(BLOCKS, HEADS, BS, D)
        self.tail = torch.zeros(slots, HEADS, G, D)
        self.pool = StagingPool(slots)
        self.truth: dict[str, dict[int, torch.Tensor]] = {}

    def step(self, batch: list[tuple[str, list[int], int, int, int]]) -> None:
        """``batch``: (request, its blocks, first position, end, version) per request."""
        qsl, seq_lens, table, x = [0], [], np.zeros((len(batch), 4), np.int64), []
        for r, (req, blocks, start, end, version) in enumerate(batch):
            table[r, :len(blocks)] = blocks
            seq_lens.append(end)
            qsl.append(qsl[-1] + end - start)
            truth = self.truth.setdefault(req, {})
            for p in list(truth):
                if p >= start:
                    del truth[p]  # rewritten (a rollback) from here on
            for p in range(start, end):
                truth[p] = value(req, p, version)
                x.append(truth[p])
        plan = plan_step(self.pool, G, BS, np.array(qsl), np.array(seq_lens), table)
        keys = torch.stack(x)
        stage_tokens(plan, self.tail, keys)
        if plan.groups:
            slots = plan.write_slot
            self.pages[slots // BS, :, slots % BS] = group_rows(plan, self.tail, keys)
        for r, (req, blocks, _, end, _) in enumerate(batch):
            coded, tail = int(plan.code_lens[r]), int(plan.tail_lens[r])
            assert coded == end // G * G and coded + tail == end
            for p in range(end):
                got = (self.pages[blocks[p // BS], :, p % BS] if p < coded
                       else self.tail[int(plan.tail_slot[r]), :, p - coded])
                assert torch.equal(got, self.truth[req][p]), (req, p)


def test_chunked_prefill_decode_and_batching() -> None:
    e = Engine()
    e.step([("A", [3, 5], 0, 6, 0), ("B", [7, 2], 0, 3, 0)])  # A: group 0 coded, 2 open; B: 3 open
    e.step([("A", [3, 5], 6, 7, 0), ("B", [7, 2], 3, 9, 0)])  # B completes a staged group, codes a whole one
    e.step([("A", [3, 5], 7, 8, 0), ("B", [7, 2], 9, 12, 0)])  # both complete groups from their slots


def test_speculative_rollback_into_a_completed_group() -> None:
    e = Engine()
    e.step([("A", [3, 5], 0, 5, 0)])  # group [0, 4) coded, 4 staged
    e.step([("A", [3, 5], 5, 9, 0)])  # verification: group [4, 8) coded with drafts 6, 7; 8 opens a group
    # drafts from 6 on rejected: position 6 rewritten (version 1); group [4, 8) is open again
    e.step([("A", [3, 5], 6, 11, 1)])
    e.step([("A", [3, 5], 11, 12, 1)])


def test_a_finished_requests_blocks_and_slot_leave_nothing_to_the_next() -> None:
    e = Engine(slots=2)
    e.step([("A", [4], 0, 3, 0)])  # A stages 3 tokens in block 4's group 0
    e.step([("A", [4], 3, 6, 0)])
    # A finishes; B gets block 4 and starts at position 0 (as every request does, or at a cached block
    # boundary): group 0's slot is rewritten from B's tokens, and only B's tokens are read
    e.step([("B", [4], 0, 2, 0)])
    e.step([("B", [4], 2, 3, 0), ("C", [9], 0, 1, 0)])  # C needs a slot: A's stale group-4 entry is evicted


def test_a_group_continued_without_its_slot_is_an_error() -> None:
    e = Engine()
    with pytest.raises(KVQError, match="no staging slot"):
        e.step([("A", [3], 2, 3, 0)])  # starts inside a group no earlier step staged


def test_more_open_groups_than_slots_is_an_error() -> None:
    pool = StagingPool(1)
    with pytest.raises(KVQError, match="1 staging slots"):
        plan_step(pool, G, BS, np.array([0, 1, 2]), np.array([1, 1]), np.array([[1], [2]]))
