"""The one packed layout: named fields with dtypes and shapes, sub-byte codes in uint8 rows.

Bit order (the rule every backend follows): a code field holds ``count`` unsigned codes of
``bits`` bits per row (the last axis). The row is a little-endian bitstream: code ``i``
occupies stream bits ``[i*bits, (i+1)*bits)``, least significant bit first, and stream bit
``j`` is bit ``j % 8`` of byte ``j // 8``. Each row is padded with zero bits to whole bytes.
Those padding bits are stored, so they are counted in :func:`bits_per_element`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvq_core.errors import InputError, KVQError, LayoutError

if TYPE_CHECKING:  # pragma: no cover
    from kvq_core.spec import MethodSpec

Kind = Literal["keys", "values"]

_FLOAT_DTYPES = ("float16", "float32")
#: what a block's ``dtype`` (the dtype decoding returns) may name: the input dtypes kvq encodes
BLOCK_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class Field:
    """One stored array: its name, stored dtype and stored shape.

    For a code field ``bits`` and ``count`` give the codes per row; the stored array is
    ``uint8`` of shape ``(*lead, ceil(count * bits / 8))``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    bits: int | None = None
    count: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def is_codes(self) -> bool:
        return self.bits is not None


def codes_field(name: str, lead: tuple[int, ...], count: int, bits: int) -> Field:
    """A field of ``count`` codes of ``bits`` bits per row, rows indexed by ``lead``."""
    if not 1 <= bits <= 32:
        raise LayoutError(f"field {name}: bits={bits} is outside 1..32")
    return Field(name, "uint8", (*lead, packed_row_bytes(count, bits)), bits=bits, count=count)


def float_field(name: str, shape: tuple[int, ...], dtype: str = "float16") -> Field:
    """A field of plain floats (scales, zero-points, norms)."""
    if dtype not in _FLOAT_DTYPES:
        raise LayoutError(f"field {name}: dtype {dtype!r} is not one of {_FLOAT_DTYPES}")
    return Field(name, dtype, tuple(shape))


Layout = Mapping[str, Field]


def make_layout(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


def packed_row_bytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes ``(..., count)`` into uint8 rows ``(..., ceil(count*bits/8))``."""
    codes = np.asarray(codes)
    count = codes.shape[-1]
    c = codes.astype(np.uint64)
    stream = ((c[..., None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    stream = stream.reshape(*codes.shape[:-1], count * bits)
    pad = packed_row_bytes(count, bits) * 8 - count * bits
    if pad:
        stream = np.concatenate([stream, np.zeros((*codes.shape[:-1], pad), np.uint8)], axis=-1)
    return np.packbits(stream, axis=-1, bitorder="little")


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: uint8 rows to codes ``(..., count)`` as int64."""
    packed = np.asarray(packed, dtype=np.uint8)
    stream = np.unpackbits(packed, axis=-1, bitorder="little")[..., : count * bits]
    stream = stream.reshape(*packed.shape[:-1], count, bits).astype(np.int64)
    return (stream << np.arange(bits, dtype=np.int64)).sum(axis=-1)


def to_host(x: Any) -> np.ndarray:
    """NumPy view of a host or torch array (torch tensors are detached and moved to the CPU;
    bfloat16, which NumPy lacks, is widened exactly to float32)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def host_all_finite(a: np.ndarray) -> bool:
    """True when the host array ``a`` holds no NaN or Inf. float16 is tested on its exponent bits
    (NumPy's float16 ``isfinite`` is scalar code, slower than a compiled encode of the block)."""
    if a.dtype == np.float16:
        return not bool(np.any((np.ascontiguousarray(a).view(np.uint16) & 0x7C00) == 0x7C00))
    return bool(np.isfinite(a).all())


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: Any) -> str:
    """A NumPy or torch dtype's short name ("float16"); cached, since ``str`` of a NumPy dtype
    costs microseconds and every attend call validates each field."""
    return str(dtype).replace("torch.", "")


def _host_finite(x: Any) -> bool:
    return host_all_finite(to_host(x))


def _is_dim(s: Any) -> bool:
    """An integer size: int or NumPy integer (not bool), or a symbolic size under torch.compile."""
    return (isinstance(s, (int, np.integer)) and not isinstance(s, bool)) or type(s).__name__ == "SymInt"


@functools.lru_cache(maxsize=512)
def _cached_layout(spec: "MethodSpec", kind: str, batch: int, kv_heads: int, tokens: int) -> Mapping[str, Field]:
    make = spec.key_layout if kind == "keys" else spec.value_layout
    return types.MappingProxyType(dict(make(batch, kv_heads, tokens)))


def block_layout(spec: "MethodSpec", kind: str, batch: Any, kv_heads: Any, tokens: Any) -> Mapping[str, Field]:
    """The layout of a ``kind`` block (read-only), cached per (spec, kind, batch, kv_heads, tokens)
    for plain integer sizes (symbolic sizes under torch.compile are laid out afresh)."""
    if type(batch) is int and type(kv_heads) is int and type(tokens) is int:
        return _cached_layout(spec, kind, batch, kv_heads, tokens)
    make = spec.key_layout if kind == "keys" else spec.value_layout
    return dict(make(batch, kv_heads, tokens))


_spec_resolver: "Callable[[Mapping[str, Any]], MethodSpec] | None" = None


def set_spec_resolver(fn: "Callable[[Mapping[str, Any]], MethodSpec]") -> None:
    """Install the function that turns a spec dict into a spec (the registry's ``spec_from_dict``).

    Injected from above so this module needs nothing but the errors: layers point one way."""
    global _spec_resolver
    _spec_resolver = fn


@dataclasses.dataclass
class PackedKV:
    """A packed key or value block: the spec, what it holds, and its fields (backend arrays).

    ``shape`` is the original ``[batch, kv_heads, tokens, head_dim]``; ``dtype`` is the name of
    the original floating dtype, which decoding returns; ``layer`` selects per-layer constants.
    """

    spec: "MethodSpec"
    kind: Kind
    shape: tuple[int, int, int, int]
    fields: dict[str, Any]
    layer: int = 0
    dtype: str = "float32"

    _checked: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def layout(self) -> Mapping[str, Field]:
        b, h, t, _ = self.shape
        return block_layout(self.spec, self.kind, b, h, t)

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    def nbytes(self) -> int:
        """Bytes actually stored, from the layout (every field, padding included)."""
        return sum(f.nbytes for f in self.layout.values())

    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes() / self.num_elements

    def __repr__(self) -> str:
        """One line: method and spec, what and shape, stored bytes and bits per element (not the arrays)."""
        return (f"PackedKV({self.kind} {self.spec.describe()}, shape={list(self.shape)}, {self.dtype}, layer={self.layer}, "
                f"{self.nbytes():,} bytes, {self.bits_per_element():.3f} bits/elt)")

    def validate(self, all_finite: "Callable[[Any], bool] | None" = None) -> None:
        """Check the block against its spec before any kernel reads it (a block is untrusted data):
        kind, shape (four dims >= 1, head_dim the spec's), dtype name, layer (an int >= 0), every
        field's full shape and dtype against the layout, and every stored float (norms, scales,
        offsets) finite (``all_finite``: the backend adapter's test; default NumPy on the host).

        Raises LayoutError for a structure that does not match, InputError for an empty block or
        non-finite stored floats. Checked once per block: a block keeps the fields it was checked
        with and skips the checks while they are the same objects (in-place writes into a field's
        array after validation are not seen)."""
        if self.is_validated():
            return
        self.check_structure()
        check = all_finite if all_finite is not None else _host_finite
        for name, f in self.layout.items():
            if f.dtype in _FLOAT_DTYPES and not check(self.fields[name]):
                raise InputError(f"{self.spec.method} {self.kind} field {name!r} holds NaN or Inf; a stored "
                                 f"{f.dtype} {name} must be finite (a tampered or corrupted block)")
        self.mark_checked()

    def check_structure(self) -> None:
        """The structural half of :meth:`validate` (everything but the stored values)."""
        where = f"packed {getattr(self.spec, 'method', '?')} {self.kind}"
        if not callable(getattr(self.spec, "key_layout", None)):
            raise LayoutError(f"{where}: spec is a {type(self.spec).__name__}; expected a MethodSpec")
        if self.kind not in ("keys", "values"):
            raise LayoutError(f"{where}: kind={self.kind!r}; expected 'keys' or 'values'")
        shape = self.shape
        if not isinstance(shape, tuple) or len(shape) != 4 or not all(_is_dim(s) for s in shape):
            raise LayoutError(f"{where}: shape={shape!r}; expected four integers [batch, kv_heads, tokens, head_dim]")
        if min(shape) < 1:
            raise InputError(f"{where}: shape {list(shape)} is empty; batch, kv_heads, tokens and head_dim must be >= 1")
        if shape[3] != self.spec.head_dim:
            raise LayoutError(f"{where}: shape {list(shape)} declares head_dim {shape[3]}; its spec has "
                              f"head_dim={self.spec.head_dim}")
        if self.dtype not in BLOCK_DTYPES:
            raise LayoutError(f"{where}: dtype={self.dtype!r}; expected one of {', '.join(BLOCK_DTYPES)}")
        layer = self.layer
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            raise LayoutError(f"{where}: layer={layer!r}; expected an integer >= 0")
        if not isinstance(self.fields, Mapping):
            raise LayoutError(f"{where}: fields is a {type(self.fields).__name__}; expected a dict of arrays")
        layout = self.layout
        missing = sorted(set(layout) - set(self.fields))
        extra = sorted(map(str, set(self.fields) - set(layout)))
        if missing or extra:
            raise LayoutError(f"{self.spec.method} {self.kind}: missing fields {missing}, unexpected {extra}")
        for name, f in layout.items():
            arr = self.fields[name]
            if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
                raise LayoutError(f"{self.spec.method} {self.kind} field {name!r}: got a {type(arr).__name__}; "
                                  f"layout says an array {f.dtype}{list(f.shape)}")
            shape, dtype = tuple(arr.shape), dtype_name(arr.dtype)
            if shape != f.shape or dtype != f.dtype:
                raise LayoutError(
                    f"{self.spec.method} {self.kind} field {name!r}: got {dtype}{list(shape)}, "
                    f"layout says {f.dtype}{list(f.shape)}"
                )

    def mark_checked(self) -> None:
        """Record that the block as it is now passed :meth:`validate` (a quantizer calls this for
        the blocks it makes, whose fields it has just checked)."""
        self._checked = (self.spec, self.kind, self.shape, self.layer, self.dtype, tuple(self.fields.items()))

    def is_validated(self) -> bool:
        """True when the block, as it is now, has passed :meth:`validate`."""
        return self._checked is not None and self._same_as_checked()

    def _same_as_checked(self) -> bool:
        spec, kind, shape, layer, dtype, fields = self._checked
        if spec is not self.spec or kind != self.kind or shape != self.shape or layer != self.layer or dtype != self.dtype:
            return False
        if len(fields) != len(self.fields):
            return False
        current = self.fields
        return all(current.get(name) is arr for name, arr in fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain form: spec dict, metadata and NumPy arrays; any backend can rebuild from it."""
        return {
            "spec": self.spec.to_dict(),
            "kind": self.kind,
            "shape": list(self.shape),
            "layer": self.layer,
            "dtype": self.dtype,
            "fields": {k: to_host(v) for k, v in self.fields.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PackedKV":
        """Rebuild (with NumPy fields) from :meth:`to_dict` output, validating against the layout.

        The spec dict is resolved by the registry (which installs itself with
        :func:`set_spec_resolver` when ``kvq_core`` is imported), so plugin methods round-trip too.
        """
        if _spec_resolver is None:
            raise LayoutError("no spec resolver installed; import kvq_core first")
        if not isinstance(data, Mapping):
            raise LayoutError(f"packed dict: got a {type(data).__name__}; expected a mapping from PackedKV.to_dict()")
        missing = [k for k in ("spec", "kind", "shape", "fields") if k not in data]
        if missing:
            raise LayoutError(f"packed dict lacks {', '.join(map(repr, missing))}")
        shape, fields = data["shape"], data["fields"]
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or len(shape) != 4 or not all(_is_dim(s) for s in shape):
            raise LayoutError(f"packed dict: shape={shape!r}; expected four integers [batch, kv_heads, tokens, head_dim]")
        if not isinstance(fields, Mapping) or not all(isinstance(k, str) for k in fields):
            raise LayoutError(f"packed dict: fields is {type(fields).__name__}; expected a mapping from field names to arrays")
        layer, dtype = data.get("layer", 0), data.get("dtype", "float32")
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise LayoutError(f"packed dict: layer={layer!r}; expected an integer >= 0")
        if not isinstance(dtype, str):
            raise LayoutError(f"packed dict: dtype={dtype!r}; expected one of {', '.join(BLOCK_DTYPES)}")
        arrays = {}
        for name, v in fields.items():
            try:
                arrays[name] = np.asarray(v)
            except (TypeError, ValueError) as exc:  # ragged lists, objects NumPy cannot hold
                raise LayoutError(f"packed dict: field {name!r} is not an array ({type(exc).__name__}: {exc})") from None
            if arrays[name].dtype == object:
                raise LayoutError(f"packed dict: field {name!r} holds Python objects; expected a numeric array")
        try:
            spec = _spec_resolver(data["spec"])
        except KVQError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a malformed spec dict
            raise LayoutError(f"packed dict: spec {data['spec']!r} is malformed ({type(exc).__name__}: {exc})") from None
        packed = cls(
            spec=spec,
            kind=data["kind"],
            shape=tuple(int(s) for s in shape),  # type: ignore[arg-type]
            fields=arrays,
            layer=int(layer),
            dtype=dtype,
        )
        packed.validate()
        return packed

    def map_fields(self, fn: Any) -> "PackedKV":
        """A copy with ``fn`` applied to every field (e.g. to move arrays between backends)."""
        return dataclasses.replace(self, fields={k: fn(v) for k, v in self.fields.items()})


def bits_per_element(*blocks: PackedKV) -> float:
    """Stored bits over original elements, summed over blocks (e.g. keys and values together)."""
    if not blocks:
        raise LayoutError("bits_per_element needs at least one packed block")
    return 8.0 * sum(b.nbytes() for b in blocks) / sum(b.num_elements for b in blocks)


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


def token_granule(spec: "MethodSpec", kind: Kind) -> tuple[int, dict[str, int]] | None:
    """``(G, axes)``: blocks of ``kind`` whose token counts are multiples of ``G`` (the last block
    of a join may have any count) join and split along tokens exactly, each field along its token
    axis ``axes[name]``; None when no ``G <= MAX_GRANULE`` does (or a field has no token axis).

    ``G`` is 1 for per-token layouts (:func:`token_separable`) and the token-group size for
    layouts with statistics per token group (OScaR and KIVI keys: 32 tokens by default): per field,
    the largest token count its extent still covers with one group (found by bisection), and the
    least common multiple of those, checked to grow linearly (``size(k G) = k size(G)``).
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
    return granule, axes


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
    out = dataclasses.replace(first, shape=(first.shape[0], first.shape[1], tokens, first.shape[3]), fields=fields)
    out.check_structure()
    inherit_validation(out, parts)
    return out


def inherit_validation(out: PackedKV, parts: "list[PackedKV]") -> None:
    """A block made by moving codes of ``parts`` stores their values, so when every part has passed
    :meth:`PackedKV.validate` it counts as validated too once its structure checks (no second
    scan of the values on the cache's join, slice and batch-selection paths)."""
    if all(p.is_validated() for p in parts):
        out.check_structure()
        out.mark_checked()


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
    out = dataclasses.replace(p, shape=(p.shape[0], p.shape[1], stop - start, p.shape[3]), fields=fields)
    inherit_validation(out, [p])
    return out
