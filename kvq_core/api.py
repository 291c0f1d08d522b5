"""The user-facing API: ``get_quantizer`` and the :class:`Quantizer` it returns."""
from __future__ import annotations

import math
import os
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
    head_dim]`` with GQA when q_heads is a multiple of kv_heads. ``kv_heads`` is bound by the
    first block the quantizer sees (or given), so a later block with other heads, e.g. one
    transposed to ``[batch, tokens, kv_heads, head_dim]``, is an :class:`InputError`.
    """

    def __init__(self, spec: MethodSpec, backend: str, layer: int = 0, *, bind_head_dim: bool = False,
                 kv_heads: int | None = None, device: str | None = None) -> None:
        """``bind_head_dim``: the spec's head_dim is a default, not the user's choice; the first
        block this quantizer sees (encoded or packed) binds it (:attr:`spec` then shows it).
        ``kv_heads``: the KV heads every block has (default: bound by the first block).
        ``device``: where the blocks will live (only used to name alternatives in errors)."""
        try:
            factory = registry.kernel_factory(backend, spec.method)
            ok, reason = registry.backend_status(backend)
            if not ok:
                raise BackendUnavailableError(f"backend {backend!r} is unavailable here: {reason}")
        except BackendUnavailableError as exc:
            raise BackendUnavailableError(f"{exc}{registry.alternatives(spec, device)}") from None
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise SpecError(spec.method, "layer", layer, "an integer >= 0")
        if kv_heads is not None and (isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1):
            raise SpecError(spec.method, "kv_heads", kv_heads, "None (bound by the first block) or an integer >= 1")
        #: KV heads of every block: given, or bound by the first block (None until then)
        self.kv_heads = kv_heads
        self._kv_heads_given = kv_heads is not None
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
            raise BackendUnavailableError(f"{reason}{registry.alternatives(self.spec, device)}")
        self._devices.add(device)

    def _heads(self, shape: Any, what: str) -> Any:
        """The block's KV heads, checked against the bound ``kv_heads``: a block with others, e.g.
        ``[batch, tokens, kv_heads, head_dim]``, would be coded as that many heads of few tokens."""
        heads = shape[1]
        if self.kv_heads is None or not isinstance(heads, int) or heads == self.kv_heads:
            return heads
        how = "given as kv_heads=" if self._kv_heads_given else "bound by the first block"
        hint = ""
        if shape[2] == self.kv_heads:
            hint = ("; it looks transposed, as [batch, tokens, kv_heads, head_dim]: pass x.transpose(1, 2) "
                    "(NumPy: x.swapaxes(1, 2))")
        raise InputError(f"{what}: shape {list(shape)} has {heads} KV heads where this quantizer has kv_heads="
                         f"{self.kv_heads} ({how}); expected the order [batch, kv_heads, tokens, head_dim]{hint}")

    def _bind_heads(self, heads: Any) -> None:
        if self.kv_heads is None and isinstance(heads, int):
            self.kv_heads = heads

    def __repr__(self) -> str:
        heads = "" if self.kv_heads is None else f", kv_heads={self.kv_heads}"
        return f"Quantizer({self.spec.describe()}, backend={self.backend!r}, layer={self.layer}{heads})"

    def _ctx(self, shape: tuple[int, int, int, int]) -> KernelContext:
        return KernelContext(self.spec, self.layer, shape, LazyConstants(self.spec, shape[1], self.layer))

    def _pack(self, kind: str, x: Any) -> PackedKV:
        shape = getattr(x, "shape", None)
        if self._bind_pending and shape is not None and len(shape) == 4:
            self._bind(shape[3])
        encode = self.kernels.encode_keys if kind == "keys" else self.kernels.encode_values
        shape = check_kv(x, self.spec, self.arrays, kind)
        heads = self._heads(shape, kind)
        self._device_ok(x)
        fields = encode(self.arrays.asarray(x), self._ctx(shape))
        packed = PackedKV(self.spec, kind, shape, fields, self.layer, dtype_name(x))  # type: ignore[arg-type]
        packed.validate()
        check_stored_finite(packed, x, self.arrays, kind)
        self._bind_heads(heads)
        return packed

    def _packed(self, p: Any, kind: str) -> PackedKV:
        if self._bind_pending and isinstance(p, PackedKV) and type(p.spec) is type(self.spec):
            if self.spec.replace(head_dim=p.spec.head_dim) == p.spec:
                self._bind(p.spec.head_dim)
        p = check_packed(p, self.spec, kind)
        self._bind_heads(self._heads(p.shape, f"packed {kind}"))
        return p

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

    def attend(self, q: Any, pk: PackedKV, pv: PackedKV, scale: float | None = None, return_lse: bool = False) -> Any:
        """Softmax attention of ``q`` over the packed cache, scoring from the codes.

        Equals softmax attention over the decoded K/V within float tolerance. ``scale``
        defaults to 1/sqrt(head_dim). With ``return_lse`` also returns the log-sum-exp of the
        scaled logits per query row, for merging with attention over other tokens.
        """
        pk = self._packed(pk, "keys")
        pv = self._packed(pv, "values")
        try:
            check_query(q, pk, pv, self.arrays)
        except InputError as exc:
            raise InputError(f"{exc}{_transposed_hint(q, pk)}") from None
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


def _transposed_hint(q: Any, pk: PackedKV) -> str:
    """A hint when the blocks hold more KV heads than the query has heads: K/V encoded as
    ``[batch, tokens, kv_heads, head_dim]`` (their tokens taken for heads) look like this."""
    q_heads = getattr(q, "shape", (None, None))[1] if len(getattr(q, "shape", ())) == 4 else None
    if not isinstance(q_heads, int) or pk.shape[1] <= q_heads:
        return ""
    return (f"; the blocks hold {pk.shape[1]} KV heads of {pk.shape[2]} tokens, more than the query's {q_heads} heads: "
            "were K/V encoded as [batch, tokens, kv_heads, head_dim]? kvq takes [batch, kv_heads, tokens, head_dim] "
            "(x.transpose(1, 2))")


def check_device(device: Any) -> str | None:
    """``device`` as a string, raising when it names CUDA on a machine without it (the
    quantizer would otherwise be built for a device no block can reach)."""
    if device is None:
        return None
    device = str(device)
    if device.split(":")[0] != "cuda" or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return device
    try:
        import torch
    except ImportError:  # optional: CUDA tensors are torch tensors
        torch = None
    if torch is None:
        raise BackendUnavailableError(f"device={device!r} needs torch with CUDA, and torch is not installed; "
                                      "pass device=None for NumPy arrays")
    if not torch.cuda.is_available():
        build = " (this torch is a CPU build)" if torch.version.cuda is None else ""
        raise BackendUnavailableError(f"device={device!r}, but CUDA is not available here: torch.cuda.is_available() "
                                      f"is False{build}; pass device='cpu' for CPU tensors or device=None for NumPy arrays")
    index = device.partition(":")[2]
    if index.isdigit() and int(index) >= torch.cuda.device_count():
        raise BackendUnavailableError(f"device={device!r}, but this machine has {torch.cuda.device_count()} CUDA "
                                      "device(s)")
    return device


def get_quantizer(
    method: str | MethodSpec, backend: str = "auto", *, layer: int = 0, device: str | None = None,
    kv_heads: int | None = None, **params: Any
) -> Quantizer:
    """A :class:`Quantizer` for ``method`` (a name plus ``params``, or a ready spec).

    ``backend="auto"`` asks the plugins' ``kvq_select_backend`` hook among the backends that
    support the spec on ``device`` (None for NumPy arrays, or a torch device string such as
    "cpu" or "cuda", which must exist here). Without an explicit ``head_dim`` or ``kv_heads``
    the first block the quantizer sees binds them.
    """
    device = check_device(device)
    if isinstance(method, MethodSpec):
        if params:
            raise SpecError(method.method, next(iter(params)), params[next(iter(params))], "no extra parameters when a spec is given")
        spec, bind = method, False
    else:
        spec, bind = registry.make_spec(method, **params), "head_dim" not in params
    name = registry.select_backend(spec, device) if backend == "auto" else backend
    return Quantizer(spec, name, layer, bind_head_dim=bind, kv_heads=kv_heads, device=device)
