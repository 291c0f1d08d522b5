"""The user-facing API: ``get_quantizer`` and the :class:`Quantizer` it returns."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvq_core import registry
from kvq_core.constants import LazyConstants
from kvq_core.errors import BackendUnavailableError, InputError, SpecError
from kvq_core.kernels import KernelContext
from kvq_core.layout import PackedKV, bits_per_element
from kvq_core.spec import MethodSpec
from kvq_core.validate import check_kv, check_packed, check_query, check_stored_finite, dtype_name


class Quantizer:
    """Encode/decode K and V blocks and attend from codes, for one spec, backend and layer.

    K/V arrays are ``[batch, kv_heads, tokens, head_dim]``; queries ``[batch, q_heads, q_len,
    head_dim]`` with GQA when q_heads is a multiple of kv_heads.
    """

    def __init__(self, spec: MethodSpec, backend: str, layer: int = 0, *, bind_head_dim: bool = False) -> None:
        """``bind_head_dim``: the spec's head_dim is a default, not the user's choice; the first
        block this quantizer sees (encoded or packed) binds it (:attr:`spec` then shows it)."""
        factory = registry.kernel_factory(backend, spec.method)
        ok, reason = registry.backend_status(backend)
        if not ok:
            raise BackendUnavailableError(f"backend {backend!r} is unavailable here: {reason}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise SpecError(spec.method, "layer", layer, "an integer >= 0")
        self.backend = backend
        self.layer = layer
        self.arrays = registry.backend_info(backend).arrays
        self._factory = factory
        self._check_supports = registry.backend_info(backend).supports is not None
        self._bind_pending = bind_head_dim
        self._set_spec(spec)

    def _set_spec(self, spec: MethodSpec) -> None:
        self.spec = spec
        self.kernels = self._factory(spec)
        self._devices: set[str | None] = set()

    def _bind(self, head_dim: Any) -> None:
        """Bind a defaulted head_dim to the first block's (once)."""
        self._bind_pending = False
        if isinstance(head_dim, int) and head_dim != self.spec.head_dim:
            try:
                self._set_spec(self.spec.replace(head_dim=head_dim))
            except SpecError as exc:
                raise InputError(f"the first block has head_dim {head_dim}, which {self.spec.method} cannot take: "
                                 f"{exc.expected}") from None

    def _device_ok(self, x: Any) -> None:
        """Ask the backend's ``supports(spec, device)`` once per device; raise with its reason."""
        if not self._check_supports:
            return
        device_of = getattr(self.arrays, "device_of", None)
        device = device_of(x) if device_of else None
        if device in self._devices:
            return
        ok, reason = registry.supports(self.backend, self.spec, device)
        if not ok:
            raise BackendUnavailableError(reason)
        self._devices.add(device)

    def __repr__(self) -> str:
        return f"Quantizer({self.spec.describe()}, backend={self.backend!r}, layer={self.layer})"

    def _ctx(self, shape: tuple[int, int, int, int]) -> KernelContext:
        return KernelContext(self.spec, self.layer, shape, LazyConstants(self.spec, shape[1], self.layer))

    def _pack(self, kind: str, x: Any) -> PackedKV:
        shape = getattr(x, "shape", None)
        if self._bind_pending and shape is not None and len(shape) == 4:
            self._bind(shape[3])
        encode = self.kernels.encode_keys if kind == "keys" else self.kernels.encode_values
        shape = check_kv(x, self.spec, self.arrays, kind)
        self._device_ok(x)
        fields = encode(self.arrays.asarray(x), self._ctx(shape))
        packed = PackedKV(self.spec, kind, shape, fields, self.layer, dtype_name(x))  # type: ignore[arg-type]
        packed.validate()
        check_stored_finite(packed, x, self.arrays, kind)
        return packed

    def _packed(self, p: Any, kind: str) -> PackedKV:
        if self._bind_pending and isinstance(p, PackedKV) and type(p.spec) is type(self.spec):
            if self.spec.replace(head_dim=p.spec.head_dim) == p.spec:
                self._bind(p.spec.head_dim)
        return check_packed(p, self.spec, kind)

    def _unpack(self, p: Any, kind: str) -> Any:
        p = self._packed(p, kind)
        fields = {k: self.arrays.asarray(v) for k, v in p.fields.items()}
        self._device_ok(next(iter(fields.values())))
        decode = self.kernels.decode_keys if kind == "keys" else self.kernels.decode_values
        return self.arrays.cast(decode(fields, self._ctx(p.shape)), p.dtype)

    def encode_keys(self, k: Any) -> PackedKV:
        return self._pack("keys", k)

    def decode_keys(self, pk: PackedKV) -> Any:
        return self._unpack(pk, "keys")

    def encode_values(self, v: Any) -> PackedKV:
        return self._pack("values", v)

    def decode_values(self, pv: PackedKV) -> Any:
        return self._unpack(pv, "values")

    def fake_quant(self, x: Any, kind: str) -> Any:
        """``decode(encode(x))`` in x's shape and dtype: what attention reads back from a cache
        storing ``x`` as ``kind`` ("keys" or "values"), for quantization-aware training.

        On the torch-tensor backends (torch, torch-compiled, triton) this is one ``kvq::fake_quant``
        op with a straight-through gradient (identity, zero where the codec clips:
        :mod:`kvq_core.training`), traceable by ``torch.compile(fullgraph=True)``. Other backends
        compose encode and decode and have no gradient (a tensor that requires grad is refused).
        Eager calls reject non-finite input, and input whose stored fields overflow (a float16
        scale past 65504: the output would not be finite); the underflow check of ``encode_*``
        is not made.
        """
        if kind not in ("keys", "values"):
            raise InputError(f"kind={kind!r}; expected 'keys' or 'values'")
        shape = getattr(x, "shape", None)
        if self._bind_pending and shape is not None and len(shape) == 4:
            self._bind(shape[3])
        shape = check_kv(x, self.spec, self.arrays, kind)
        self._device_ok(x)
        fused = getattr(self.kernels, "fake_quant", None)
        if fused is not None:
            out = fused(kind, self.arrays.asarray(x), self._ctx(shape))
        elif getattr(x, "requires_grad", False):
            raise BackendUnavailableError(
                f"backend {self.backend!r} has no differentiable fake_quant ({kind} require grad); use a torch-tensor "
                "backend: 'torch', 'torch-compiled' or 'triton'")
        else:
            encode = self.kernels.encode_keys if kind == "keys" else self.kernels.encode_values
            decode = self.kernels.decode_keys if kind == "keys" else self.kernels.decode_values
            ctx = self._ctx(shape)
            out = self.arrays.cast(decode(encode(self.arrays.asarray(x), ctx), ctx), dtype_name(x))
        if not self.arrays.all_finite(out):
            raise InputError(f"{kind}: {self.spec.method}'s stored fields overflow for this input (float16 holds up to "
                             "65504), so it decodes to non-finite values; scale the input down, or use the method's "
                             "float32 storage option where it has one")
        return out

    def attend(self, q: Any, pk: PackedKV, pv: PackedKV, scale: float | None = None, return_lse: bool = False) -> Any:
        """Softmax attention of ``q`` over the packed cache, scoring from the codes.

        Equals softmax attention over the decoded K/V within float tolerance. ``scale``
        defaults to 1/sqrt(head_dim). With ``return_lse`` also returns the log-sum-exp of the
        scaled logits per query row, for merging with attention over other tokens.
        """
        pk = self._packed(pk, "keys")
        pv = self._packed(pv, "values")
        check_query(q, pk, pv, self.arrays)
        self._device_ok(q)
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

    ``backend="auto"`` asks the plugins' ``kvq_select_backend`` hook among the backends that
    support the spec on ``device`` (None for NumPy arrays, or a torch device string). Without an
    explicit ``head_dim`` the first block the quantizer sees binds it.
    """
    if isinstance(method, MethodSpec):
        if params:
            raise SpecError(method.method, next(iter(params)), params[next(iter(params))], "no extra parameters when a spec is given")
        spec, bind = method, False
    else:
        spec, bind = registry.make_spec(method, **params), "head_dim" not in params
    name = registry.select_backend(spec, device) if backend == "auto" else backend
    return Quantizer(spec, name, layer, bind_head_dim=bind)
