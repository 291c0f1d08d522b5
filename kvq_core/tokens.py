"""Joining and splitting packed blocks along tokens (codes copied, never re-quantized): which
layouts allow it (:func:`token_separable`, :func:`token_granule`) and the join and split
themselves (:func:`concat_tokens`, :func:`slice_tokens`)."""
from __future__ import annotations

import functools
import math
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_core.errors import LayoutError
from kvq_core.host_arrays import to_host
from kvq_core.layout import Kind
from kvq_core.packed import PackedKV

if TYPE_CHECKING:  # pragma: no cover
    from kvq_core.spec import MethodSpec


def token_separable(spec: "MethodSpec", kind: Kind) -> bool:
    """True when ``kind``'s layout is per token: every field is ``(batch, kv_heads, tokens, ...)``
    with nothing else depending on the token count, so blocks join and split along tokens exactly."""
    make = spec.key_layout if kind == "keys" else spec.value_layout
    one, many = dict(make(2, 3, 1)), dict(make(2, 3, 67))
    if one.keys() != many.keys():
        return False
    for name, f in one.items():
        g = many[name]
        if len(f.shape) < 3 or f.shape[:3] != (2, 3, 1) or g.shape != (2, 3, 67, *f.shape[3:]):
            return False
    return True


#: largest token granule :func:`token_granule` looks for
MAX_GRANULE = 1024


@functools.lru_cache(maxsize=256)
def token_granule(spec: "MethodSpec", kind: Kind) -> tuple[int, Mapping[str, int]] | None:
    """``(G, axes)``: blocks of ``kind`` whose token counts are multiples of ``G`` (the last block
    of a join may have any count) join and split along tokens exactly, each field along its token
    axis ``axes[name]``; None when no ``G <= MAX_GRANULE`` does (or a field has no token axis).

    ``G`` is 1 for per-token layouts (:func:`token_separable`) and the token-group size for
    layouts with statistics per token group (OScaR and KIVI keys: 32 tokens by default): per field,
    the largest token count its extent still covers with one group (found by bisection), and the
    least common multiple of those, checked to grow linearly (``size(k G) = k size(G)``). Cached
    per (spec, kind): the bisection lays out ~30 blocks, and a sliding flush joins blocks every step.
    """
    make = spec.key_layout if kind == "keys" else spec.value_layout
    one, many = dict(make(2, 3, 1)), dict(make(2, 3, MAX_GRANULE + 1))
    if one.keys() != many.keys():
        return None
    axes = {}
    for name, f in one.items():
        moved = [i for i, (x, y) in enumerate(zip(f.shape, many[name].shape)) if x != y]
        if len(moved) != 1 or len(f.shape) != len(many[name].shape):
            return None
        axes[name] = moved[0]

    def extent(tokens: int) -> dict[str, int]:
        return {name: f.shape[axes[name]] for name, f in dict(make(2, 3, tokens)).items()}

    granule = 1
    first, second = extent(1), extent(2)
    for name, e1 in first.items():
        if second[name] == 2 * e1:
            continue  # per token
        lo, hi = 1, MAX_GRANULE  # largest count whose extent is still one group's
        if extent(hi)[name] == e1:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if extent(mid)[name] == e1 else (lo, mid)
        granule = math.lcm(granule, lo)
    base = extent(granule)
    if granule > MAX_GRANULE or any(extent(k * granule)[n] != k * base[n] for k in (2, 3) for n in base):
        return None
    return granule, types.MappingProxyType(axes)


def _granule_of(p: PackedKV, what: str) -> tuple[int, dict[str, int]]:
    found = token_granule(p.spec, p.kind)
    if found is None:
        raise LayoutError(
            f"{what}: {p.spec.method} {p.kind} share statistics across tokens in a way that does not split "
            "along tokens, so blocks cannot be joined or split without re-quantization"
        )
    return found


def concat_tokens(parts: "list[PackedKV]", arrays: Any = None) -> PackedKV:
    """Blocks joined along tokens (codes copied, never re-quantized).

    ``arrays`` is the backend's array adapter; one with ``concat(xs, axis)`` joins in place of a
    NumPy round trip. Raises LayoutError when the blocks differ in spec, kind, layer, dtype or
    batch/heads/head_dim, when the layout does not split along tokens, or when a block before the
    last is not a whole number of the layout's token groups (:func:`token_granule`).
    """
    if not parts:
        raise LayoutError("concat_tokens needs at least one packed block")
    first = parts[0]
    granule, axes = _granule_of(first, "concat_tokens")
    for p in parts[1:]:
        same = (p.spec, p.kind, p.layer, p.dtype) == (first.spec, first.kind, first.layer, first.dtype)
        if not same or p.shape[:2] != first.shape[:2] or p.shape[3] != first.shape[3]:
            raise LayoutError(
                f"concat_tokens: block {p.spec.describe()} {p.kind} {list(p.shape)} does not match "
                f"{first.spec.describe()} {first.kind} {list(first.shape)}"
            )
    for p in parts[:-1]:
        if p.shape[2] % granule:
            raise LayoutError(f"concat_tokens: a block of {p.shape[2]} tokens before the last is not a whole number "
                              f"of {first.spec.method}'s {granule}-token groups")
    join = getattr(arrays, "concat", None)
    fields = {}
    for name in first.fields:
        xs = [p.fields[name] for p in parts]
        ax = axes[name]
        fields[name] = join(xs, ax) if join else np.concatenate([to_host(x) for x in xs], axis=ax)
    tokens = sum(p.shape[2] for p in parts)
    out = first.with_tokens(tokens, fields)
    if not inherit_validation(out, parts):
        out.check_structure()
    return out


def inherit_validation(out: PackedKV, parts: "list[PackedKV]") -> bool:
    """A block made by moving codes of ``parts`` stores their values, so when every part has passed
    :meth:`PackedKV.validate` it counts as validated too once its structure checks (no second
    scan of the values on the cache's join, slice and batch-selection paths). Returns whether it did."""
    if all(p.is_validated() for p in parts):
        out.check_structure()
        out.mark_checked()
        return True
    return False


def slice_tokens(p: PackedKV, start: int, stop: int) -> PackedKV:
    """Tokens ``[start, stop)`` of a block (a view where the backend allows); with token groups
    (:func:`token_granule`) ``start`` and ``stop`` must fall on group boundaries (or ``stop`` at
    the end)."""
    granule, axes = _granule_of(p, "slice_tokens")
    t = p.shape[2]
    if not 0 <= start < stop <= t:
        raise LayoutError(f"slice_tokens: [{start}, {stop}) is not a non-empty range of {t} tokens")
    if start % granule or (stop % granule and stop != t):
        raise LayoutError(f"slice_tokens: [{start}, {stop}) cuts inside {p.spec.method}'s {granule}-token groups")
    make = p.spec.key_layout if p.kind == "keys" else p.spec.value_layout
    lo = {name: f.shape[axes[name]] for name, f in dict(make(1, 1, start)).items()} if start else dict.fromkeys(axes, 0)
    hi = {name: f.shape[axes[name]] for name, f in dict(make(1, 1, stop)).items()}
    fields = {}
    for name, a in p.fields.items():
        index = [slice(None)] * a.ndim
        index[axes[name]] = slice(lo[name], hi[name])
        fields[name] = a[tuple(index)]
    out = p.with_tokens(stop - start, fields)
    inherit_validation(out, [p])
    return out
