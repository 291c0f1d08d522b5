"""The user-facing API: ``get_quantizer`` and the :class:`Quantizer` it returns."""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvq_core import registry
from kvq_core.errors import BackendUnavailableError, InputError, SpecError
from kvq_core.kernels import KernelContext
from kvq_core.layout import PackedKV, bits_per_element
from kvq_core.spec import MethodSpec
from kvq_core.validate import check_kv, check_packed, check_query, check_stored_finite, dtype_name


@functools.lru_cache(maxsize=256)
def _constants(spec: MethodSpec, kv_heads: int, layer: int) -> dict[str, Any]:
    consts = spec.constants(kv_heads, layer)
    for arr in consts.values():
        arr.flags.writeable = False
    return consts


class _LazyConsts(Mapping):
    """``spec.constants(kv_heads, layer)`` (cached), computed on first access.

    Kernels that take their constants elsewhere (the torch ops fetch them per device) never
    trigger the NumPy computation, so ``torch.compile`` can trace a Quantizer call without
    tracing into NumPy code.
    """

    __slots__ = ("_key", "_data")

    def __init__(self, spec: MethodSpec, kv_heads: int, layer: int) -> None:
        self._key = (spec, kv_heads, layer)
        self._data: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._data is None:
            self._data = _constants(*self._key)
        return self._data

    def __getitem__(self, name: str) -> Any:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get())


class Quantizer:
    """Encode/decode K and V blocks and attend from codes, for one spec, backend and layer.

    K/V arrays are ``[batch, kv_heads, tokens, head_dim]``; queries ``[batch, q_heads, q_len,
    head_dim]`` with GQA when q_heads is a multiple of kv_heads.
    """

    def __init__(self, spec: MethodSpec, backend: str, layer: int = 0) -> None:
        info = registry.backend_info(backend)
        if spec.method not in info.kernels:
            raise BackendUnavailableError(
                f"backend {backend!r} has no kernels for method {spec.method!r}; it implements {sorted(info.kernels)}"
            )
        ok, reason = registry.backend_status(backend)
        if not ok:
            raise BackendUnavailableError(f"backend {backend!r} is unavailable here: {reason}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise SpecError(spec.method, "layer", layer, "an integer >= 0")
        self.spec = spec
        self.backend = backend
        self.layer = layer
        self.arrays = info.arrays
        self.kernels = info.kernels[spec.method](spec)

    def __repr__(self) -> str:
        return f"Quantizer({self.spec.describe()}, backend={self.backend!r}, layer={self.layer})"

    def _ctx(self, shape: tuple[int, int, int, int]) -> KernelContext:
        return KernelContext(self.spec, self.layer, shape, _LazyConsts(self.spec, shape[1], self.layer))  # type: ignore[arg-type]

    def _pack(self, kind: str, x: Any, encode: Any) -> PackedKV:
        shape = check_kv(x, self.spec, self.arrays, kind)
        fields = encode(self.arrays.asarray(x), self._ctx(shape))
        packed = PackedKV(self.spec, kind, shape, fields, self.layer, dtype_name(x))  # type: ignore[arg-type]
        packed.validate()
        check_stored_finite(packed, x, self.arrays, kind)
        return packed

    def _unpack(self, p: Any, kind: str, decode: Any) -> Any:
        p = check_packed(p, self.spec, kind)
        fields = {k: self.arrays.asarray(v) for k, v in p.fields.items()}
        return self.arrays.cast(decode(fields, self._ctx(p.shape)), p.dtype)

    def encode_keys(self, k: Any) -> PackedKV:
        return self._pack("keys", k, self.kernels.encode_keys)

    def decode_keys(self, pk: PackedKV) -> Any:
        return self._unpack(pk, "keys", self.kernels.decode_keys)

    def encode_values(self, v: Any) -> PackedKV:
        return self._pack("values", v, self.kernels.encode_values)

    def decode_values(self, pv: PackedKV) -> Any:
        return self._unpack(pv, "values", self.kernels.decode_values)

    def attend(self, q: Any, pk: PackedKV, pv: PackedKV, scale: float | None = None, return_lse: bool = False) -> Any:
        """Softmax attention of ``q`` over the packed cache, scoring from the codes.

        Equals softmax attention over the decoded K/V within float tolerance. ``scale``
        defaults to 1/sqrt(head_dim). With ``return_lse`` also returns the log-sum-exp of the
        scaled logits per query row, for merging with attention over other tokens.
        """
        pk = check_packed(pk, self.spec, "keys")
        pv = check_packed(pv, self.spec, "values")
        check_query(q, pk, pv, self.arrays)
        if scale is None:
            scale = 1.0 / math.sqrt(self.spec.head_dim)
        elif not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise InputError(f"scale={scale!r}; expected a finite number > 0")
        kf = {k: self.arrays.asarray(v) for k, v in pk.fields.items()}
        vf = {k: self.arrays.asarray(v) for k, v in pv.fields.items()}
        out, lse = self.kernels.attend(self.arrays.asarray(q), kf, vf, self._ctx(pk.shape), float(scale))
        out = self.arrays.cast(out, dtype_name(q))
        return (out, lse) if return_lse else out

    def bits_per_element(self, packed: PackedKV | Sequence[PackedKV]) -> float:
        """Every stored bit (codes, norms, scales, zero-points, padding) over original elements."""
        blocks = [packed] if isinstance(packed, PackedKV) else list(packed)
        for b in blocks:
            check_packed(b, self.spec, b.kind if isinstance(b, PackedKV) else "keys")
        return bits_per_element(*blocks)


def get_quantizer(
    method: str | MethodSpec, backend: str = "auto", *, layer: int = 0, device: str | None = None, **params: Any
) -> Quantizer:
    """A :class:`Quantizer` for ``method`` (a name plus ``params``, or a ready spec).

    ``backend="auto"`` asks the plugins' ``kvq_select_backend`` hook; ``device`` is a hint for
    that choice (None for NumPy arrays, or a torch device string).
    """
    if isinstance(method, MethodSpec):
        if params:
            raise SpecError(method.method, next(iter(params)), params[next(iter(params))], "no extra parameters when a spec is given")
        spec = method
    else:
        spec = registry.make_spec(method, **params)
    name = registry.select_backend(spec.method, device) if backend == "auto" else backend
    return Quantizer(spec, name, layer)
