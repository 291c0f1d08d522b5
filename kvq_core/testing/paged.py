"""Random paged-attention cases (``kvq::attend_paged`` arguments) for tests and benchmarks.

:func:`paged_case` encodes each request's random K/V with a quantizer, writes the rows into pages
at shuffled (non-contiguous) block ids, optionally shares the first blocks of a request with the one
before it (a prefix-cache hit: same tokens, same blocks) and stores the pages token-major
(``[num_blocks, block_size, kv_heads, row_bytes]`` in memory, seen through the logical view), as
vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvq_core.paged import PageLayout


@dataclass
class PagedCase:
    """The arguments of ``kvq::attend_paged`` (torch tensors) and the spec they were made for."""

    spec: Any
    q: Any
    pages: Any
    block_table: Any
    code_lens: Any
    query_start_loc: Any
    tail_k: Any = None
    tail_v: Any = None
    tail_slot: Any = None
    tail_lens: Any = None

    def args(self) -> tuple[Any, ...]:
        """``(q, pages, block_table, code_lens, query_start_loc)``."""
        return self.q, self.pages, self.block_table, self.code_lens, self.query_start_loc

    def tails(self) -> tuple[Any, Any, Any, Any]:
        return self.tail_k, self.tail_v, self.tail_slot, self.tail_lens


def paged_case(quantizer: Any, *, block_size: int, kv_heads: int, q_heads: int, code_lens: list[int],
               q_lens: list[int], tail_lens: list[int] | None = None, share_prefix: int = 0, spare_blocks: int = 2,
               token_major: bool = True, seed: int = 0, device: str = "cpu") -> PagedCase:
    """A case of ``len(code_lens)`` requests: request ``r`` has ``code_lens[r]`` coded tokens,
    ``q_lens[r]`` query tokens and ``tail_lens[r]`` exact tail tokens (tails in shuffled slots).

    ``share_prefix`` blocks of every request (that has them) are the same physical blocks, with the
    same tokens, as the request before it. ``quantizer`` is a torch-backend Quantizer (its spec's
    head_dim is the case's)."""
    import torch

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = quantizer.spec
    d = spec.head_dim
    layout = PageLayout(spec, block_size, kv_heads)
    nreq = len(code_lens)
    max_blocks = max(1, max(-(-n // block_size) for n in code_lens))
    num_blocks = nreq * max_blocks + spare_blocks
    ids = rng.permutation(num_blocks)
    table = np.zeros((nreq, max_blocks), np.int64)
    used = 0
    prev_k = prev_v = None
    physical = torch.zeros(num_blocks, block_size, kv_heads, layout.row_bytes, dtype=torch.uint8)
    pages = physical.permute(0, 2, 1, 3)
    for r, n in enumerate(code_lens):
        k = torch.randn(1, kv_heads, max(n, 1), d, generator=gen)
        v = torch.randn(1, kv_heads, max(n, 1), d, generator=gen)
        shared = min(share_prefix, n // block_size, (code_lens[r - 1] // block_size) if r else 0)
        if shared:
            k[:, :, :shared * block_size] = prev_k[:, :, :shared * block_size]
            v[:, :, :shared * block_size] = prev_v[:, :, :shared * block_size]
            table[r, :shared] = table[r - 1, :shared]
        fresh = max_blocks - shared
        table[r, shared:] = ids[used:used + fresh]
        used += fresh
        prev_k, prev_v = k, v
        if n == 0:
            continue
        rows = layout.pack(quantizer.encode_keys(k).fields, quantizer.encode_values(v).fields)[0]  # [h, n, row]
        for b in range(shared, -(-n // block_size)):
            t0, t1 = b * block_size, min(n, (b + 1) * block_size)
            pages[int(table[r, b]), :, : t1 - t0] = rows[:, t0:t1]
    if not token_major:
        pages = pages.contiguous()
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = torch.randn(int(qsl[-1]), q_heads, d, generator=gen)
    case = PagedCase(spec, q.to(device), pages.to(device), torch.tensor(table, dtype=torch.int32, device=device),
                     torch.tensor(code_lens, dtype=torch.int32, device=device),
                     torch.tensor(qsl, device=device))
    if tail_lens is not None:
        max_tail = max(1, max(tail_lens))
        slots = rng.permutation(nreq + 1)[:nreq]
        case.tail_k = torch.randn(nreq + 1, kv_heads, max_tail, d, generator=gen).to(device)
        case.tail_v = torch.randn(nreq + 1, kv_heads, max_tail, d, generator=gen).to(device)
        case.tail_slot = torch.tensor(slots, dtype=torch.int32, device=device)
        case.tail_lens = torch.tensor(tail_lens, dtype=torch.int32, device=device)
    return case
