"""Paged KV: a kvq codec's packed fields as one byte row per (token, kv head), and paged attention.

A serving engine (vLLM) allocates ``uint8`` pages ``[num_blocks, kv_heads, block_size, row_bytes]``
(any strides: vLLM's physical order is token-major) and names a request's context by a block
table row. :class:`PageLayout` says where each packed field lies in a row:

- **per-token fields** (codes, per-token norms and scales: OCTOPUS, TurboQuant, TurboQuant-prod,
  QuaRot, PolarQuant, QJL, fp16, and the values of OScaR and KIVI) take their bytes per token and
  head, in layout order, keys first, then values;
- **per-group fields** (OScaR's and KIVI's key ``scale`` and ``offset``: one fp16 row of ``d``
  channels per ``key_group`` tokens) are *striped*: the group's bytes are cut into
  ``ceil(bytes / key_group)``-byte pieces, piece ``j`` in row ``j`` of the group. ``block_size``
  must be a multiple of the group, so groups never straddle pages; a group's rows are written
  together once the group is complete (the engine keeps the open group exact meanwhile);
- **fields shared by the kv heads** (OScaR's fp32 token norm) are striped over the token's
  ``kv_heads`` rows, ``ceil(4 / kv_heads)`` bytes each (padding included in ``row_bytes``).

``row_bytes`` counts every stored byte (padding too): it is what the engine sizes pages by.
:meth:`PageLayout.pack` / :meth:`PageLayout.unpack` convert between PackedKV-shaped fields
``[b, h, t, ...]`` and rows ``uint8 [b, h, t, row_bytes]`` (NumPy arrays or torch tensors; torch is
never imported here).

**Paged attention** (``torch.ops.kvq.attend_paged``, schema in :mod:`kvq_core.torch_ops.ops`), one
call per layer and step for the whole batch::

    kvq::attend_paged(str backend, str spec_json, int layer, Tensor q, Tensor pages, Tensor block_table,
                      Tensor code_lens, Tensor query_start_loc, float scale, Tensor? tail_k, Tensor? tail_v,
                      Tensor? tail_slot, Tensor? tail_lens, int head_offset=0) -> (Tensor out, Tensor lse)

- ``q`` float ``[n_tokens, q_heads, d]``: every request's query tokens, concatenated; request ``r``
  owns tokens ``query_start_loc[r] : query_start_loc[r + 1]`` (int32 ``[num_reqs + 1]``);
- ``pages`` uint8 ``[num_blocks, kv_heads, block_size, row_bytes]`` (last axis contiguous);
  ``block_table`` int32 ``[num_reqs, max_blocks]``; ``code_lens`` int32 ``[num_reqs]``: the first
  ``code_lens[r]`` tokens of request ``r`` are read from its pages (a multiple of the key group for
  OScaR and KIVI; entries of ``block_table`` past them are never read);
- ``tail_k`` / ``tail_v`` float ``[num_slots, kv_heads, max_tail, d]`` (optional, both or neither),
  ``tail_slot`` / ``tail_lens`` int32 ``[num_reqs]``: ``tail_lens[r]`` exact tokens following the
  coded ones (OScaR's open group, KVQCache's full-precision window), in slot ``tail_slot[r]``;
- query token ``i`` of request ``r`` (``q_len`` tokens) sits at position
  ``code_lens[r] + tail_lens[r] - q_len + i`` and attends causally to every position up to its own
  (decode: ``q_len = 1``; chunked prefill, a prefix-cache tail, recompute, spec-decode verification:
  ``q_len > 1``); GQA: query head ``j`` reads kv head ``j // (q_heads // kv_heads)``;
- ``head_offset``: the global index of the pages' first kv head (a tensor-parallel rank's), whose
  per-head constants the codes were written with (``kvq::encode``'s ``head_offset``);
- returns ``out`` float32 ``[n_tokens, q_heads, d]`` and ``lse`` float32 ``[n_tokens, q_heads]``
  (log-sum-exp of the scaled logits, to merge with attention over other tokens).

A backend may decode a request's context to K/V where that is measured faster, attending the same
values: numba on CPU does so for requests of at least ``kvq_numba.paged.DENSE_MIN_QUERY`` (16)
query tokens (``bench/results/paged_prefill.md``: even at 16, 2-4x faster at 512 query tokens,
slower below 8), and scores from the codes otherwise.

**Paged write** (``torch.ops.kvq.write_paged``), one call per layer and step, in place::

    kvq::write_paged(str backend, str spec_json, int layer, Tensor key, Tensor value, Tensor(a!) pages,
                     Tensor slot_mapping, int head_offset=0) -> ()

- ``key`` / ``value`` float ``[n_tokens, kv_heads, d]``, ``slot_mapping`` int ``[n_tokens]``: token ``i``'s
  row goes to page ``slot // block_size``, row ``slot % block_size``; a slot ``< 0`` is padding and
  writes nothing;
- per-token codecs encode the ``n`` tokens as one block; token-group codecs (OScaR, KIVI) take whole
  groups: tokens ``jG .. (j+1)G`` are group ``j``, encoded together, their slots one group of a page
  (:func:`step_blocks`; the engine keeps an open group exact until it completes);
- the rows are those of :meth:`PageLayout.pack` of ``kvq::encode``'s fields: the torch backend's
  version (``kvq_torch.paged_write``) does exactly that and is the reference; numba's encodes with
  its CPU kernels and writes the row bytes straight into the pages.

No kernel reads a device tensor's value on the host (no synchronisation); what the arguments
promise (lengths within the table, positions >= 0) is the caller's contract, checked here by the
reference only. :func:`attend_paged_reference` is the readable truth every backend is tested
against: per request, gather its rows, unpack them into PackedKV blocks, the NumPy backend's
``attend(..., return_lse=True)`` per causal prefix, merged with exact softmax over the tail.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import numpy as np

from kvq_core.errors import InputError, LayoutError, SpecError
from kvq_core.layout import Kind
from kvq_core.packed import PackedKV
from kvq_core.spec import MethodSpec

#: how a field's bytes map onto rows
TOKEN, GROUP, HEADS = "token", "group", "heads"


@dataclasses.dataclass(frozen=True)
class Slot:
    """One packed field's bytes ``[start, stop)`` in a row.

    ``tail`` is the field's shape after its lead axes (``(b, h, t)`` for per-token fields,
    ``(b, h, groups)`` for per-group ones, ``(b, t)`` for fields shared by the heads);
    ``stripe`` is :data:`TOKEN`, :data:`GROUP` or :data:`HEADS`; ``nbytes`` is the field's bytes per
    token-head (TOKEN), per group-head (GROUP) or per token (HEADS), before striping.
    """

    kind: Kind
    name: str
    dtype: str
    tail: tuple[int, ...]
    stripe: str
    nbytes: int
    start: int
    stop: int

    @property
    def width(self) -> int:
        """Bytes of this field in every row."""
        return self.stop - self.start


def _key_group(spec: MethodSpec, kind: Kind) -> int:
    """Tokens sharing a statistic in ``kind``'s layout (1 for per-token layouts)."""
    from kvq_core.tokens import token_granule

    found = token_granule(spec, kind)
    if found is None:
        raise SpecError(spec.method, "method", spec.method,
                        f"a codec whose {kind} are stored per token or per token group; its layout fits no page row")
    return found[0]


class PageLayout:
    """Where each packed field of ``spec`` lies in a page row of ``kv_heads`` heads and
    ``block_size`` tokens per page (module docstring). ``row_bytes`` is the row's size."""

    def __init__(self, spec: MethodSpec, block_size: int, kv_heads: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise SpecError(spec.method, "block_size", block_size, "an integer >= 1")
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
            raise SpecError(spec.method, "kv_heads", kv_heads, "an integer >= 1")
        self.spec, self.block_size, self.kv_heads = spec, block_size, kv_heads
        self.group = math.lcm(_key_group(spec, "keys"), _key_group(spec, "values"))
        if block_size % self.group:
            raise SpecError(spec.method, "block_size", block_size,
                            f"a multiple of the {spec.method} key group ({self.group} tokens), so that a group's "
                            "statistics never straddle pages")
        slots, offset = [], 0
        for kind in ("keys", "values"):
            for s in self._field_slots(kind, offset):
                slots.append(s)
                offset = s.stop
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.row_bytes: int = offset
        self.key_bytes: int = sum(s.width for s in slots if s.kind == "keys")

    def _field_slots(self, kind: Kind, offset: int) -> list[Slot]:
        make = self.spec.key_layout if kind == "keys" else self.spec.value_layout
        g, h = self.group, self.kv_heads
        one, two = dict(make(1, h, g)), dict(make(1, h, 2 * g))
        out = []
        for name, f in one.items():
            f2 = two[name]
            item = np.dtype(f.dtype).itemsize
            if f.shape[:3] == (1, h, g) and f2.shape[:3] == (1, h, 2 * g):
                stripe, tail = TOKEN, f.shape[3:]
                nbytes = math.prod(tail) * item
                width = nbytes
            elif g > 1 and f.shape[:3] == (1, h, 1) and f2.shape[:3] == (1, h, 2):
                stripe, tail = GROUP, f.shape[3:]
                nbytes = math.prod(tail) * item
                width = -(-nbytes // g)
            elif f.shape == (1, g) and f2.shape == (1, 2 * g):
                stripe, tail = HEADS, ()
                nbytes = item
                width = -(-nbytes // h)
            else:
                raise SpecError(self.spec.method, "method", self.spec.method,
                                f"a layout whose {kind} field {name!r} is per token, per token group or per token "
                                f"across heads; its shape {list(f.shape)} fits no page row")
            out.append(Slot(kind, name, f.dtype, tuple(tail), stripe, nbytes, offset, offset + width))
            offset += width
        return out

    def slot(self, kind: Kind, name: str) -> Slot:
        """The slot of ``kind``'s field ``name``."""
        for s in self.slots:
            if s.kind == kind and s.name == name:
                return s
        raise LayoutError(f"{self.spec.method} {kind} has no field {name!r}")

    def columns(self, kind: Kind) -> slice:
        """The byte columns of ``kind``'s fields in a row: keys ``[0, key_bytes)``, values after."""
        return slice(0, self.key_bytes) if kind == "keys" else slice(self.key_bytes, self.row_bytes)

    # -- rows <-> fields ------------------------------------------------------------------------
    def _check_tokens(self, tokens: int, what: str) -> None:
        if self.group > 1 and tokens % self.group:
            raise LayoutError(f"{what}: {tokens} tokens is not a whole number of {self.spec.method}'s "
                              f"{self.group}-token key groups")

    def pack_kind(self, kind: Kind, fields: dict[str, Any]) -> Any:
        """``uint8 [b, h, t, width]`` row bytes (``columns(kind)``) of ``kind``'s packed fields."""
        ops = _ops(next(iter(fields.values())))
        parts = []
        for s in self.slots:
            if s.kind != kind:
                continue
            raw = ops.as_bytes(fields[s.name], 3 if s.stripe != HEADS else 2)  # [b, h, t|groups, nbytes] / [b, t, 4]
            if s.stripe == TOKEN:
                parts.append(raw)
            elif s.stripe == GROUP:
                b, h, groups = raw.shape[:3]
                raw = ops.pad(raw, self.group * s.width)
                parts.append(raw.reshape(b, h, groups * self.group, s.width))
            else:
                b, t = raw.shape[:2]
                raw = ops.pad(raw, self.kv_heads * s.width).reshape(b, t, self.kv_heads, s.width)
                parts.append(ops.permute(raw, (0, 2, 1, 3)))
        rows = ops.cat(parts)
        self._check_tokens(rows.shape[2], "PageLayout.pack")
        if rows.shape[1] != self.kv_heads:
            raise LayoutError(f"PageLayout.pack: {rows.shape[1]} kv heads; the layout has {self.kv_heads}")
        return rows

    def pack(self, kfields: dict[str, Any], vfields: dict[str, Any]) -> Any:
        """``uint8 [b, h, t, row_bytes]`` rows of a block's key and value fields (``t`` whole key groups)."""
        k, v = self.pack_kind("keys", kfields), self.pack_kind("values", vfields)
        return _ops(k).cat([k, v])

    def unpack_kind(self, kind: Kind, rows: Any) -> dict[str, Any]:
        """``kind``'s fields (fresh arrays, the spec's layout) of rows ``uint8 [b, h, t, row_bytes]``
        (or just ``columns(kind)`` of them)."""
        ops = _ops(rows)
        b, h, t, width = rows.shape
        base = 0 if width == self.row_bytes or kind == "keys" else self.key_bytes
        self._check_tokens(t, "PageLayout.unpack")
        out = {}
        for s in self.slots:
            if s.kind != kind:
                continue
            raw = rows[..., s.start - base:s.stop - base]
            if s.stripe == TOKEN:
                out[s.name] = ops.from_bytes(raw, s.dtype, (b, h, t, *s.tail))
            elif s.stripe == GROUP:
                groups = t // self.group
                raw = ops.contiguous(raw).reshape(b, h, groups, self.group * s.width)[..., :s.nbytes]
                out[s.name] = ops.from_bytes(raw, s.dtype, (b, h, groups, *s.tail))
            else:
                raw = ops.contiguous(ops.permute(raw, (0, 2, 1, 3))).reshape(b, t, h * s.width)[..., :s.nbytes]
                out[s.name] = ops.from_bytes(raw, s.dtype, (b, t))
        return out

    def unpack(self, rows: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(key fields, value fields)`` of rows ``uint8 [b, h, t, row_bytes]``."""
        return self.unpack_kind("keys", rows), self.unpack_kind("values", rows)

    def blocks(self, rows: Any, layer: int = 0) -> tuple[PackedKV, PackedKV]:
        """Rows ``[b, h, t, row_bytes]`` as PackedKV key and value blocks (``layer`` recorded)."""
        kf, vf = self.unpack(rows)
        shape = (rows.shape[0], rows.shape[1], rows.shape[2], self.spec.head_dim)
        return (PackedKV(self.spec, "keys", shape, kf, layer), PackedKV(self.spec, "values", shape, vf, layer))


def gather_rows(pages: Any, block_ids: Any, tokens: int) -> Any:
    """The first ``tokens`` rows ``[1, h, tokens, row_bytes]`` of the request whose blocks are
    ``block_ids`` (a block-table row) in ``pages [num_blocks, h, block_size, row_bytes]``."""
    ops = _ops(pages)
    block_size = pages.shape[2]
    needed = -(-tokens // block_size)
    got = ops.take(pages, block_ids[:needed])  # [needed, h, bs, row]
    rows = ops.contiguous(ops.permute(got, (1, 0, 2, 3))).reshape(pages.shape[1], needed * block_size, pages.shape[3])
    return rows[None, :, :tokens]


def step_blocks(x: Any, group: int) -> Any:
    """A paged write's tokens ``x [n, kv_heads, d]`` (NumPy or torch) as the blocks they are encoded
    in, ``[B, kv_heads, T, d]`` (a view): one block of ``n`` tokens for a per-token codec
    (``group == 1``), one block per ``group`` tokens otherwise."""
    n, h, d = x.shape
    if n % group:
        raise InputError(f"kvq::write_paged: {n} tokens is not a whole number of {group}-token key groups")
    b = 1 if group == 1 else n // group
    return _ops(x).permute(x.reshape(b, n // b, h, d), (0, 2, 1, 3))


# -- the reference -------------------------------------------------------------------------------

def _slice_block(p: PackedKV, tokens: int, group: int) -> PackedKV:
    """The first ``tokens`` tokens of a block (its last group possibly partial: the stats stay the group's)."""
    fields = {}
    groups = -(-tokens // group)
    for name, f in p.layout.items():
        a = p.fields[name]
        if len(f.shape) == 2:
            fields[name] = a[:, :tokens]
        elif f.shape[2] == p.shape[2]:
            fields[name] = a[:, :, :tokens]
        else:
            fields[name] = a[:, :, :groups]
    return p.with_tokens(tokens, fields)


def _merge(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Softmax merge of ``(out [..., d], lse [...])`` pairs over disjoint token sets (float64)."""
    lses = np.stack([lse.astype(np.float64) for _, lse in parts])
    top = lses.max(axis=0)
    w = np.exp(lses - top)
    total = w.sum(axis=0)
    out = sum(wi[..., None] * o.astype(np.float64) for wi, (o, _) in zip(w, parts)) / total[..., None]
    return out, top + np.log(total)


def _exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention of ``q [hq, d]`` over ``k, v [hk, t, d]`` (float64, GQA)."""
    hk = k.shape[0]
    qg = q.astype(np.float64).reshape(hk, -1, q.shape[-1])
    z = np.einsum("hgd,htd->hgt", qg, k.astype(np.float64)) * scale
    m = z.max(axis=-1, keepdims=True)
    p = np.exp(z - m)
    s = p.sum(axis=-1, keepdims=True)
    out = np.einsum("hgt,htd->hgd", p / s, v.astype(np.float64))
    return out.reshape(q.shape), (m + np.log(s))[..., 0].reshape(q.shape[0])


def attend_paged_reference(spec: MethodSpec, layer: int, q: Any, pages: Any, block_table: Any, code_lens: Any,
                           query_start_loc: Any, scale: float, tail_k: Any = None, tail_v: Any = None,
                           tail_slot: Any = None, tail_lens: Any = None,
                           head_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``kvq::attend_paged``'s meaning (module docstring), computed on the host: per request its
    rows gathered and unpacked, the NumPy backend's ``attend(return_lse=True)`` over each causal
    prefix of the coded tokens (the constants of global kv heads ``head_offset`` on), merged with
    exact float64 softmax over the visible tail.
    Returns ``(out float32 [n_tokens, q_heads, d], lse float32 [n_tokens, q_heads])``."""
    from kvq_core.constants import constants
    from kvq_core.host_arrays import to_host
    from kvq_core.contract import KernelContext
    from kvq_core.registry import kernel_factory

    q, pages, table = to_host(q).astype(np.float32), to_host(pages), to_host(block_table).astype(np.int64)
    code_lens, qsl = to_host(code_lens).astype(np.int64), to_host(query_start_loc).astype(np.int64)
    n, hq, d = q.shape
    _, hk, block_size, _ = pages.shape
    layout = PageLayout(spec, block_size, hk)
    kernels = kernel_factory("numpy", spec.method)(spec)
    consts = constants(spec, hk, layer, head_offset)
    if tail_k is not None:
        tail_k, tail_v = to_host(tail_k).astype(np.float32), to_host(tail_v).astype(np.float32)
        tail_slot, tail_lens = to_host(tail_slot).astype(np.int64), to_host(tail_lens).astype(np.int64)
    out = np.zeros((n, hq, d), np.float32)
    lse = np.zeros((n, hq), np.float32)
    for r in range(len(code_lens)):
        start, stop = int(qsl[r]), int(qsl[r + 1])
        if stop == start:
            continue
        coded = int(code_lens[r])
        tail = int(tail_lens[r]) if tail_k is not None else 0
        if coded % layout.group:
            raise InputError(f"attend_paged: request {r} has {coded} coded tokens, not whole {layout.group}-token groups")
        first = coded + tail - (stop - start)
        if first < 0:
            raise InputError(f"attend_paged: request {r} has {stop - start} query tokens but {coded + tail} in context")
        pk = pv = None
        if coded:
            pk, pv = layout.blocks(gather_rows(pages, table[r], coded), layer)
        for i in range(stop - start):
            pos = first + i
            parts = []
            seen = min(coded, pos + 1)
            if seen:
                qi = q[start + i][None, :, None, :]
                bk, bv = _slice_block(pk, seen, layout.group), _slice_block(pv, seen, layout.group)
                o, s = kernels.attend(qi, bk.fields, bv.fields, KernelContext(spec, layer, bk.shape, consts), scale)
                parts.append((np.asarray(o)[0, :, 0], np.asarray(s)[0, :, 0]))
            exact = pos + 1 - coded
            if exact > 0:
                slot = int(tail_slot[r])
                parts.append(_exact(q[start + i], tail_k[slot, :, :exact], tail_v[slot, :, :exact], scale))
            o, s = _merge(parts)
            out[start + i], lse[start + i] = o, s
    return out, lse


# -- NumPy / torch array operations (torch is imported only when its tensors are handed in) --------

class _NumpyOps:
    @staticmethod
    def as_bytes(a: Any, lead: int) -> np.ndarray:
        a = np.ascontiguousarray(a)
        return a.view(np.uint8).reshape(*a.shape[:lead], -1)

    @staticmethod
    def from_bytes(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.ascontiguousarray(raw).view(np.dtype(dtype)).reshape(shape).copy()

    @staticmethod
    def pad(raw: np.ndarray, width: int) -> np.ndarray:
        extra = width - raw.shape[-1]
        return raw if not extra else np.concatenate([raw, np.zeros((*raw.shape[:-1], extra), np.uint8)], axis=-1)

    @staticmethod
    def permute(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        return a.transpose(axes)

    @staticmethod
    def contiguous(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a)

    @staticmethod
    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts, axis=-1)

    @staticmethod
    def take(a: np.ndarray, index: Any) -> np.ndarray:
        return a[np.asarray(index, dtype=np.int64)]


class _TorchOps:
    def __init__(self) -> None:
        self.torch = sys.modules["torch"]  # a torch tensor was handed in, so torch is loaded (not a dependency)

    def as_bytes(self, a: Any, lead: int) -> Any:
        a = a.contiguous()
        return a.view(self.torch.uint8).reshape(*a.shape[:lead], -1)

    def from_bytes(self, raw: Any, dtype: str, shape: tuple[int, ...]) -> Any:
        return raw.contiguous().view(getattr(self.torch, dtype)).reshape(shape).clone()

    def pad(self, raw: Any, width: int) -> Any:
        extra = width - raw.shape[-1]
        return raw if not extra else self.torch.nn.functional.pad(raw, (0, extra))

    def permute(self, a: Any, axes: tuple[int, ...]) -> Any:
        return a.permute(*axes)

    def contiguous(self, a: Any) -> Any:
        return a.contiguous()

    def cat(self, parts: list[Any]) -> Any:
        return self.torch.cat(parts, dim=-1)

    def take(self, a: Any, index: Any) -> Any:
        return a.index_select(0, index.to(self.torch.long))


def _ops(x: Any) -> Any:
    return _TorchOps() if type(x).__module__.startswith("torch") else _NumpyOps()
