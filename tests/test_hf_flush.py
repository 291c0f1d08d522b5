"""The flush policy of a KVQLayer as plain integers (:mod:`kvq_core.integrations.hf.flush`): which tokens each
step packs, what the window keeps, which blocks join, how a crop cuts. No torch here: an integer
model of the layer's update runs the same functions the layer calls."""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_core.errors import KVQError
from kvq_core.integrations.hf.flush import (DEFAULT_STRIDE, JOIN_RATIO, blocks_before, default_stride, encode_range, join_range,
                                           plan_crop, window_drop)

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Model:
    """A KVQLayer's flush state in integers, stepped as ``KVQLayer.update`` steps it."""

    flush: str
    residual: int
    stride: int = 1
    cumulative: int = 0
    window: int = 0
    packed_length: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)

    def step(self, new: int) -> tuple[int, int]:
        """Add ``new`` tokens; return the positions ``[start, stop)`` this step encoded."""
        base = self.cumulative - self.window
        self.window += new
        start, stop = encode_range(self.flush, self.residual, self.stride, self.window, base, self.packed_length)
        self.cumulative += new
        if stop > start:
            self.blocks.append(stop - start)
            self.packed_length += stop - start
        self.window -= window_drop(self.flush, self.residual, self.window, stop - start)
        if self.flush == "sliding":
            lo, hi = join_range(self.blocks, self.packed_length, self.cumulative - self.window)
            if hi - lo > 1:
                self.blocks[lo:hi] = [sum(self.blocks[lo:hi])]
        return base + start, base + stop

    @property
    def settled(self) -> list[int]:
        """Lengths of the blocks holding no window token (the ones the join rule may join)."""
        end, out = 0, []
        for t in self.blocks:
            end += t
            if end <= self.cumulative - self.window:
                out.append(t)
        return out


@given(prefill=st.integers(0, 500), residual=st.integers(1, 64))
def test_block_flush_after_prefill_packs_whole_multiples_of_residual(prefill: int, residual: int) -> None:
    assert encode_range("block", residual, 1, prefill, 0, 0) == (0, prefill - prefill % residual)
    m = Model("block", residual)
    m.step(prefill)
    assert (m.packed_length, m.window) == (prefill - prefill % residual, prefill % residual)


@pytest.mark.parametrize("flush", ["block", "sliding"])
@pytest.mark.parametrize("stride", [1, 4])
def test_residual_zero_packs_everything(flush: str, stride: int) -> None:
    if flush == "block" and stride > 1:
        return  # stride belongs to the sliding flush
    m = Model(flush, 0, stride)
    for new in (7, 1, 1, 3, 1):
        m.step(new)
        assert (m.window, m.packed_length) == (0, m.cumulative)
    assert encode_range(flush, 0, stride, 5, 20, 20) == (0, 5)


def test_sliding_keeps_residual_minus_one_exact_tokens() -> None:
    m = Model("sliding", 4)
    assert m.step(10) == (0, 7) and (m.window, m.packed_length) == (3, 7)
    for _ in range(5):
        start, stop = m.step(1)
        assert stop - start == 1 and (m.window, m.packed_length) == (3, m.cumulative - 3)
    assert window_drop("sliding", 4, 4, 1) == 1 and window_drop("sliding", 4, 2, 0) == 0
    assert window_drop("block", 4, 9, 8) == 8  # a block flush drops exactly what it encoded


def test_default_stride_only_where_codes_are_read_ahead_of_need() -> None:
    """A stride only where a sliding flush keeps an exact window whose tokens later leave it for their codes."""
    assert DEFAULT_STRIDE == 8
    assert default_stride("sliding", 32, None) == DEFAULT_STRIDE
    assert default_stride("sliding", 32, 33) == DEFAULT_STRIDE  # the window's oldest token is read from codes
    assert default_stride("sliding", 32, 32) == 1  # the exact window covers the sliding window: no code is read
    assert default_stride("sliding", 0, None) == 1  # everything packed each step: nothing to encode ahead
    assert default_stride("block", 128, None) == 1


def test_stride_encodes_stride_tokens_ahead_of_need() -> None:
    m = Model("sliding", 8, stride=4)
    assert m.step(20) == (0, 13)  # a prefill needs 13 packed, more than the stride
    assert m.step(1) == (13, 17)  # one token needed, four encoded: three ahead, still in the window
    assert (m.window, m.packed_length) == (7, 17)
    for _ in range(3):  # the three ahead age out of the window one by one: nothing to encode
        assert m.step(1) == (17, 17)
    assert m.step(1) == (17, 21)
    assert encode_range("sliding", 4, 5, 6, 10, 10) == (0, 5)  # one needed, five encoded
    assert encode_range("sliding", 4, 5, 4, 10, 10) == (0, 4)  # ... at most as far as the window goes


@given(
    flush=st.sampled_from(["block", "sliding"]),
    residual=st.integers(0, 12),
    stride=st.integers(1, 6),
    steps=st.lists(st.integers(1, 20), min_size=1, max_size=60),
)
@settings(max_examples=300, deadline=None)
def test_policy_invariants(flush: str, residual: int, stride: int, steps: list[int]) -> None:
    """Any mix of prefills and decode steps: every token is packed exactly once and in order,
    the window is what the policy keeps, and each settled block is over JOIN_RATIO times the next."""
    if flush == "block":
        stride = 1
    m = Model(flush, residual, stride)
    for new in steps:
        before = m.packed_length
        start, stop = m.step(new)
        assert start == before or start == stop  # each encode continues where the last one stopped
        assert stop <= m.cumulative and sum(m.blocks) == m.packed_length and all(m.blocks)
        base = m.cumulative - m.window
        assert m.packed_length >= base  # everything before the window is packed
        if flush == "block":
            assert m.packed_length == base and m.window < max(residual, 1)
        else:
            assert m.window == min(m.cumulative, max(residual - 1, 0))
            assert m.packed_length - base <= stride - 1  # encoded ahead of need: at most S - 1
            assert all(a > JOIN_RATIO * b for a, b in zip(m.settled, m.settled[1:]))  # geometric
            assert len(m.blocks) - len(m.settled) <= 1  # only the newest block may hold window tokens


@given(residual=st.integers(1, 40), stride=st.integers(1, 8), n=st.integers(1, 3000))
@settings(max_examples=100, deadline=None)
def test_single_token_steps_leave_logarithmically_many_blocks(residual: int, stride: int, n: int) -> None:
    m = Model("sliding", residual, stride)
    bound = math.floor(math.log(n, JOIN_RATIO) + 1e-9) + 1
    for _ in range(n):
        m.step(1)
        assert len(m.settled) <= bound
        assert len(m.blocks) <= bound + (stride > 1)  # plus the one a stride encoded ahead


def test_join_range() -> None:
    assert join_range([], 0, 0) == (0, 0)
    r = JOIN_RATIO
    assert join_range([4, 2, 1, 1], 8, 8) == (0, 4)  # 1+1, then 2, then 4: one block of 8
    assert join_range([r * r + 1, r + 1, 1], r * r + r + 3, r * r + r + 3) == (2, 3)  # each > r times the next
    assert join_range([r * r + r + 1, r, 1], r * r + 2 * r + 2, r * r + 2 * r + 2) == (1, 3)  # r <= r * 1: they join
    assert join_range([4, 1, 1], 6, 5) == (0, 2)  # the last block holds a window token: 1 joins 4
    assert join_range([4 * r, 1, 1], 4 * r + 2, 4 * r + 1) == (1, 2)  # ... not 4r
    assert join_range([1, 1, 4], 6, 2) == (0, 2)


def test_blocks_before() -> None:
    assert blocks_before([4, 4, 2], 0, 8) == (2, 0)  # a block boundary
    assert blocks_before([4, 4, 2], 0, 6) == (1, 2)
    assert blocks_before([4, 4, 2], 3, 3) == (0, 0)  # blocks start at the first stored position
    assert blocks_before([4, 4, 2], 0, 10) == (3, 0)


def _crop(blocks: list[int], n: int, *, window: int, granule: int, evicted: int = 0) -> tuple[int, int]:
    packed = sum(blocks) + evicted
    return plan_crop(blocks, -n, cumulative=packed + window, packed_length=packed, evicted=evicted, window=window,
                     granule=granule, layer=3)


def test_plan_crop() -> None:
    assert _crop([4, 4, 2], 3, window=3, granule=0) == (3, 0)  # the window only
    assert _crop([4, 4, 2], 5, window=3, granule=0) == (2, 0)  # the window and the last block
    assert _crop([4, 4, 2], 6, window=3, granule=1) == (1, 3)  # per token: the cut block keeps 3
    assert _crop([4, 4, 2], 7, window=3, granule=2) == (1, 2)  # token groups of 2: it keeps one whole group
    with pytest.raises(KVQError, match="cuts inside a packed block of 4 tokens; only the window \\(3 tokens\\) and whole blocks"):
        _crop([4, 4, 2], 6, window=3, granule=0)
    with pytest.raises(KVQError, match="only the window \\(3 tokens\\) and whole 2-token groups of a block"):
        _crop([4, 4, 2], 6, window=3, granule=2)
    with pytest.raises(ValueError, match="negative number"):
        plan_crop([4], 1, cumulative=4, packed_length=4, evicted=0, window=0, granule=1, layer=0)
    with pytest.raises(ValueError, match="cannot remove 14 tokens"):
        _crop([4, 4, 2], 14, window=3, granule=1)
    with pytest.raises(KVQError, match="layer 3 is a sliding-window layer"):
        _crop([4], 1, window=3, granule=1, evicted=5)
    assert _crop([4], 0, window=3, granule=1, evicted=5) == (1, 0)  # removing nothing is fine


@given(blocks=st.lists(st.integers(1, 9), max_size=8), window=st.integers(0, 9), granule=st.integers(0, 3),
       data=st.data())
def test_plan_crop_keeps_exactly_the_leading_tokens(blocks: list[int], window: int, granule: int,
                                                    data: st.DataObject) -> None:
    packed = sum(blocks)
    n = data.draw(st.integers(0, packed + window))
    keep = min(packed, packed + window - n)  # packed tokens that survive
    whole, part = _crop(blocks, n, window=window, granule=1)
    assert sum(blocks[:whole]) + part == keep and (part == 0 or part < blocks[whole])
    if part == 0 or (granule and part % granule == 0):  # a block boundary, or whole groups of the cut block
        assert _crop(blocks, n, window=window, granule=granule) == (whole, part)
    else:
        with pytest.raises(KVQError, match="cuts inside a packed block"):
            _crop(blocks, n, window=window, granule=granule)


BLOCKER = '''
import importlib.abc, sys, types
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, Block())
for name, sub in (("kvq_core", "kvq_core"), ("kvq_core.integrations.hf", "kvq_core/integrations/hf")):  # skip the packages' __init__
    pkg = types.ModuleType(name)
    pkg.__path__ = [sys.argv[1] + "/" + sub]
    sys.modules[name] = pkg
'''


@pytest.mark.slow  # slow tier: a fresh interpreter
@pytest.mark.parametrize("module", ["kvq_core.integrations.hf.flush", "kvq_core.integrations.hf.window"])
def test_plain_integer_modules_import_no_torch_or_numpy(module: str) -> None:
    """The policy modules load and run with torch, numpy and transformers unimportable."""
    code = BLOCKER + textwrap.dedent(f'''
        import importlib
        mod = importlib.import_module({module!r})
        if {module!r}.endswith("flush"):
            assert mod.encode_range("sliding", 4, 1, 10, 0, 0) == (0, 7)
        else:
            assert mod.view_start(10, 4) == 7
        print("OK", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy")))
    ''')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "OK []"
