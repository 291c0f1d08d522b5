"""The packed block: :class:`PackedKV` (a spec, what it holds, and its fields laid out by
:mod:`kvq_core.layout`), its validation as untrusted data, its plain-dict round trip, and
:func:`bits_per_element`."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvq_core.errors import InputError, KVQError, LayoutError
from kvq_core.host_arrays import dtype_name, host_all_finite, to_host
from kvq_core.layout import FLOAT_DTYPES, Field, Kind, block_layout, block_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from kvq_core.spec import MethodSpec

#: what a block's ``dtype`` (the dtype decoding returns) may name: the input dtypes kvq encodes
BLOCK_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _host_finite(x: Any) -> bool:
    return host_all_finite(to_host(x))


def _plain_shape(shape: Any) -> bool:
    """Four plain ``int`` sizes in a tuple: what every block built by kvq holds (one test, no generator)."""
    if type(shape) is not tuple or len(shape) != 4:
        return False
    b, h, t, d = shape
    return type(b) is int and type(h) is int and type(t) is int and type(d) is int


def _is_dim(s: Any) -> bool:
    """An integer size: int or NumPy integer (not bool), or a symbolic size under torch.compile."""
    return (isinstance(s, (int, np.integer)) and not isinstance(s, bool)) or type(s).__name__ == "SymInt"


_spec_resolver: "Callable[[Mapping[str, Any]], MethodSpec] | None" = None


def set_spec_resolver(fn: "Callable[[Mapping[str, Any]], MethodSpec]") -> None:
    """Install the function that turns a spec dict into a spec (the registry's ``spec_from_dict``).

    Injected from above so this module imports nothing above the layout: layers point one way."""
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
    _memo: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def layout(self) -> Mapping[str, Field]:
        b, h, t, _ = self.shape
        return block_layout(self.spec, self.kind, b, h, t)

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    def nbytes(self) -> int:
        """Bytes actually stored, from the layout (every field, padding included)."""
        b, h, t, _ = self.shape
        return block_nbytes(self.spec, self.kind, b, h, t)

    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes() / self.num_elements

    def with_tokens(self, tokens: int, fields: dict[str, Any]) -> "PackedKV":
        """This block's spec, kind, layer and dtype over ``tokens`` tokens with ``fields`` (unchecked): what
        joining, slicing and paging make. Built directly: ``dataclasses.replace`` costs ~5 us a block."""
        b, h, _, d = self.shape
        return PackedKV(self.spec, self.kind, (b, h, tokens, d), fields, self.layer, self.dtype)

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
            if f.dtype in FLOAT_DTYPES and not check(self.fields[name]):
                raise InputError(f"{self.spec.method} {self.kind} field {name!r} holds NaN or Inf; a stored "
                                 f"{f.dtype} {name} must be finite (a tampered or corrupted block)")
        self.mark_checked()

    def check_structure(self) -> None:
        """The structural half of :meth:`validate` (everything but the stored values)."""
        if not callable(getattr(self.spec, "key_layout", None)):
            raise LayoutError(f"{self._where()}: spec is a {type(self.spec).__name__}; expected a MethodSpec")
        if self.kind != "keys" and self.kind != "values":
            raise LayoutError(f"{self._where()}: kind={self.kind!r}; expected 'keys' or 'values'")
        shape = self.shape
        if not _plain_shape(shape):  # the usual case (plain ints) in one test; NumPy or symbolic sizes here
            if not isinstance(shape, tuple) or len(shape) != 4 or not all(_is_dim(s) for s in shape):
                raise LayoutError(f"{self._where()}: shape={shape!r}; expected four integers [batch, kv_heads, tokens, head_dim]")
        if min(shape) < 1:
            raise InputError(f"{self._where()}: shape {list(shape)} is empty; batch, kv_heads, tokens and head_dim must be >= 1")
        if shape[3] != self.spec.head_dim:
            raise LayoutError(f"{self._where()}: shape {list(shape)} declares head_dim {shape[3]}; its spec has "
                              f"head_dim={self.spec.head_dim}")
        if self.dtype not in BLOCK_DTYPES:
            raise LayoutError(f"{self._where()}: dtype={self.dtype!r}; expected one of {', '.join(BLOCK_DTYPES)}")
        layer = self.layer
        if type(layer) is not int and (isinstance(layer, bool) or not isinstance(layer, (int, np.integer))) or layer < 0:
            raise LayoutError(f"{self._where()}: layer={layer!r}; expected an integer >= 0")
        fields = self.fields
        if type(fields) is not dict and not isinstance(fields, Mapping):
            raise LayoutError(f"{self._where()}: fields is a {type(fields).__name__}; expected a dict of arrays")
        layout = self.layout
        if layout.keys() != fields.keys():  # the usual case in one comparison; the names only on a mismatch
            missing = sorted(set(layout) - set(fields))
            extra = sorted(map(str, set(fields) - set(layout)))
            if missing or extra:
                raise LayoutError(f"{self.spec.method} {self.kind}: missing fields {missing}, unexpected {extra}")
        for name, f in layout.items():
            arr = fields[name]
            try:
                shape, dtype = tuple(arr.shape), dtype_name(arr.dtype)
            except (AttributeError, TypeError):
                raise LayoutError(f"{self.spec.method} {self.kind} field {name!r}: got a {type(arr).__name__}; "
                                  f"layout says an array {f.dtype}{list(f.shape)}") from None
            if shape != f.shape or dtype != f.dtype:
                raise LayoutError(
                    f"{self.spec.method} {self.kind} field {name!r}: got {dtype}{list(shape)}, "
                    f"layout says {f.dtype}{list(f.shape)}"
                )

    def mark_checked(self) -> None:
        """Record that the block as it is now passed :meth:`validate` (a quantizer calls this for
        the blocks it makes, whose fields it has just checked)."""
        self._checked = (self.spec, self.kind, self.shape, self.layer, self.dtype, tuple(self.fields.items()))

    def kernel_memo(self) -> dict[Any, Any]:
        """A dict for what a kernel derives from this block's fields (buffers, descriptors: never
        copies of the values), kept while the block holds the fields it was last checked with; a
        new, empty one after its fields are swapped and checked again. For validated blocks only
        (:meth:`kvq_core.Quantizer.plan_window` hands it to kernels in ``KernelBlocks.block_memos``)."""
        memo = self._memo
        if memo is None or memo[0] is not self._checked:
            memo = self._memo = (self._checked, {})
        return memo[1]

    def _where(self) -> str:
        return f"packed {getattr(self.spec, 'method', '?')} {self.kind}"

    def is_validated(self) -> bool:
        """True when the block, as it is now, has passed :meth:`validate`."""
        return self._checked is not None and self._same_as_checked()

    def _same_as_checked(self) -> bool:
        spec, kind, shape, layer, dtype, fields = self._checked
        if spec is not self.spec or kind != self.kind or shape != self.shape or layer != self.layer or dtype != self.dtype:
            return False
        current = self.fields
        if len(fields) != len(current):
            return False
        for name, arr in fields:  # a plain loop: this runs twice per attend call
            if current.get(name) is not arr:
                return False
        return True

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
