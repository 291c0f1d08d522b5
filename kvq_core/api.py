"""The user-facing API: ``get_quantizer`` and the :class:`Quantizer` it returns."""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvq_core import registry
from kvq_core.constants import LazyConstants
from kvq_core.errors import BackendUnavailableError, InputError, SpecError
from kvq_core.contract import KernelBlocks, KernelContext
from kvq_core.packed import PackedKV, bits_per_element
from kvq_core.spec import MethodSpec
from kvq_core.window_plan import WindowPlan
from kvq_core.validate import (
    KV_DIMS,
    QUERY_DIMS,
    check_attention_finite,
    check_float_array,
    check_kv,
    check_layer,
    check_packed,
    check_query,
    check_query_for,
    check_scale,
    check_stored_finite,
    dtype_name,
)


#: kernel contexts a quantizer keeps (per block shape and layer) before it starts its cache afresh
CONTEXTS_KEPT = 64


class _Bound(NamedTuple):
    """A quantizer's spec and the kernels built for it: swapped whole, so a thread reads a
    consistent pair while another binds the head_dim. ``contexts``: the kernel contexts made for
    them, by (block shape, layer); None on ``torch_ops`` backends, whose shapes may be symbolic
    under ``torch.compile``."""

    spec: MethodSpec
    kernels: Any
    contexts: dict[tuple[Any, int], KernelContext] | None = None


def _kernels_of(backend: str, method: str) -> Any:
    """What a Quantizer calls with a spec to get its kernels: the registry's kernel class, or on a
    ``torch_ops`` backend :class:`~kvq_core.torch_ops.calls.OpKernels`, which runs that class through
    the ``kvq::`` ops (compile and export then see one opaque node per call)."""
    factory = registry.kernel_factory(backend, method)
    if not registry.backend_info(backend).torch_ops:
        return factory
    from kvq_core.torch_ops.calls import OpKernels

    return functools.partial(OpKernels, backend)


class Quantizer:
    """Encode/decode K and V blocks and attend from codes, for one spec, backend and layer.

    K/V arrays are ``[batch, kv_heads, tokens, head_dim]``; queries ``[batch, q_heads, q_len,
    head_dim]`` with GQA when q_heads is a multiple of kv_heads. ``kv_heads`` is bound by the
    first block the quantizer sees (or given), so a later block with other heads, e.g. one
    transposed to ``[batch, tokens, kv_heads, head_dim]``, is an :class:`InputError`.
 Every packed block handed in is
    validated once against the spec (:meth:`PackedKV.validate`) before a kernel reads it, and
    must record this quantizer's layer unless the call passes ``layer=`` (then that layer's).
    """

    def __init__(self, spec: MethodSpec, backend: str, layer: int = 0, *, bind_head_dim: bool = False,
                 kv_heads: int | None = None, device: str | None = None) -> None:
        """``bind_head_dim``: the spec's head_dim is a default, not the user's choice; the first
        block this quantizer sees (encoded or packed) binds it (:attr:`spec` then shows it).
        ``kv_heads``: the KV heads every block has (default: bound by the first block).
        ``device``: where the blocks will live (only used to name alternatives in errors)."""
        try:
            factory = _kernels_of(backend, spec.method)
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
        self._keep_contexts = not registry.backend_info(backend).torch_ops
        self._check_supports = registry.backend_info(backend).supports is not None
        self._device_of = getattr(self.arrays, "device_of", None)
        self._bind_lock = threading.Lock()
        self._devices: frozenset[str | None] = frozenset()
        self._bound = self._make_bound(spec)
        self._bind_pending = bind_head_dim  # set last: the pair above is in place before anyone binds

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles (a model deep-copied with its kvq-qat settings) get a lock of their own,
        and none of the cached kernel contexts."""
        state = self.__dict__.copy()
        del state["_bind_lock"]
        state["_bound"] = self._bound._replace(contexts={} if self._keep_contexts else None)  # not the cached contexts
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind_lock = threading.Lock()

    @property
    def spec(self) -> MethodSpec:
        return self._bound.spec

    @property
    def kernels(self) -> Any:
        return self._bound.kernels

    def _state(self, head_dim: Any) -> _Bound:
        """The (spec, kernels) pair a call with blocks of ``head_dim`` uses: the bound one, or
        while the head_dim is unbound a candidate for ``head_dim`` (kept only by :meth:`_keep`)."""
        bound = self._bound
        if not self._bind_pending or not isinstance(head_dim, int) or head_dim == bound.spec.head_dim:
            return bound
        try:
            spec = bound.spec.replace(head_dim=head_dim)
        except SpecError as exc:
            raise InputError(f"the first block has head_dim {head_dim}, which {bound.spec.method} cannot take: "
                             f"{exc.expected}") from None
        return self._make_bound(spec)

    def _make_bound(self, spec: MethodSpec) -> _Bound:
        return _Bound(spec, self._factory(spec), {} if self._keep_contexts else None)

    def _keep(self, state: _Bound) -> None:
        """After a call succeeded with ``state``: bind it if the head_dim is still unbound (under a
        lock; the first call to finish binds, a concurrent one of another head_dim then fails)."""
        if not self._bind_pending:
            if state is not self._bound and state.spec != self._bound.spec:
                raise InputError(f"head_dim {state.spec.head_dim} does not match the head_dim={self._bound.spec.head_dim} "
                                 "bound by this quantizer's first block")
            return
        with self._bind_lock:
            if self._bind_pending:
                if state.spec != self._bound.spec:
                    self._bound = state
                self._devices = frozenset()
                self._bind_pending = False
            elif state.spec != self._bound.spec:
                raise InputError(f"head_dim {state.spec.head_dim} does not match the head_dim={self._bound.spec.head_dim} "
                                 "bound by this quantizer's first block")

    def _device_ok(self, state: _Bound, x: Any) -> None:
        """Ask the backend's ``supports(spec, device)`` once per device; raise with its reason."""
        if not self._check_supports:
            return
        device = self._device_of(x) if self._device_of is not None else None
        if device in self._devices and state is self._bound:
            return
        ok, reason = registry.supports(self.backend, state.spec, device)
        if not ok:
            raise BackendUnavailableError(f"{reason}{registry.alternatives(state.spec, device)}")
        if state is self._bound:
            self._devices = self._devices | {device}  # a new set, never mutated: safe to read unlocked

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

    @staticmethod
    def _ctx(state: _Bound, shape: tuple[int, int, int, int], layer: int) -> KernelContext:
        """The kernel context of a call on blocks of ``shape``: made once per shape and layer where
        ``state`` keeps them (a new one costs ~1 us, a tenth of a 1-token attend's Python)."""
        contexts = state.contexts
        if contexts is None:
            return KernelContext(state.spec, layer, shape, LazyConstants(state.spec, shape[1], layer))
        key = (shape, layer)
        ctx = contexts.get(key)
        if ctx is None:
            if len(contexts) >= CONTEXTS_KEPT:
                contexts.clear()
            ctx = contexts[key] = KernelContext(state.spec, layer, shape, LazyConstants(state.spec, shape[1], layer))
        return ctx

    def _pack(self, kind: str, x: Any, layer: int | None) -> PackedKV:
        layer = check_layer(layer, self.layer)
        shape = getattr(x, "shape", None)
        state = self._state(shape[3] if shape is not None and len(shape) == 4 else None)
        encode = state.kernels.encode_keys if kind == "keys" else state.kernels.encode_values
        shape, xa = check_kv(x, state.spec, self.arrays, kind)  # converted once: checks and kernel read it
        heads = self._heads(shape, kind)
        self._device_ok(state, x)
        fields = encode(xa, self._ctx(state, shape, layer))
        packed = PackedKV(state.spec, kind, shape, fields, layer, dtype_name(x))  # type: ignore[arg-type]
        packed.check_structure()
        check_stored_finite(packed, xa, self.arrays, kind)
        packed.mark_checked()  # its fields are the kernel's, just checked: validated once
        self._keep(state)
        self._bind_heads(heads)
        return packed

    def _packed(self, p: Any, kind: str, layer: int | None) -> tuple[_Bound, PackedKV, int]:
        layer = check_layer(layer, self.layer)
        state = self._bound
        if self._bind_pending and isinstance(p, PackedKV) and type(p.spec) is type(state.spec) \
                and isinstance(p.spec.head_dim, int) and p.spec.head_dim != state.spec.head_dim:
            if state.spec.replace(head_dim=p.spec.head_dim) == p.spec:
                state = self._state(p.spec.head_dim)
        p = check_packed(p, state.spec, kind, layer, self.arrays)
        heads = p.shape[1]
        if type(heads) is not int or heads != self.kv_heads:  # unbound, another count, or symbolic
            self._bind_heads(self._heads(p.shape, "packed " + kind))
        return state, p, layer

    def _unpack(self, p: Any, kind: str, layer: int | None) -> Any:
        state, p, layer = self._packed(p, kind, layer)
        fields = {k: self.arrays.asarray(v) for k, v in p.fields.items()}
        self._device_ok(state, next(iter(fields.values())))
        decode = state.kernels.decode_keys if kind == "keys" else state.kernels.decode_values
        out = self.arrays.cast(decode(fields, self._ctx(state, p.shape, layer)), p.dtype)
        self._keep(state)
        return out

    def encode_keys(self, k: Any, *, layer: int | None = None) -> PackedKV:
        """Pack keys ``[batch, kv_heads, tokens, head_dim]`` (``layer``: default the quantizer's)."""
        return self._pack("keys", k, layer)

    def decode_keys(self, pk: PackedKV, *, layer: int | None = None) -> Any:
        """Keys from a packed block recording ``layer`` (default the quantizer's), in its dtype."""
        return self._unpack(pk, "keys", layer)

    def encode_values(self, v: Any, *, layer: int | None = None) -> PackedKV:
        return self._pack("values", v, layer)

    def decode_values(self, pv: PackedKV, *, layer: int | None = None) -> Any:
        return self._unpack(pv, "values", layer)

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
        state = self._state(shape[3] if shape is not None and len(shape) == 4 else None)
        shape, xa = check_kv(x, state.spec, self.arrays, kind)
        self._device_ok(state, x)
        ctx = self._ctx(state, shape, self.layer)
        fused = getattr(state.kernels, "fake_quant", None)
        if fused is not None:
            out = fused(kind, xa, ctx)
        elif getattr(x, "requires_grad", False):
            raise BackendUnavailableError(
                f"backend {self.backend!r} has no differentiable fake_quant ({kind} require grad); use a torch-tensor "
                "backend: 'torch', 'torch-compiled' or 'triton'")
        else:
            encode = state.kernels.encode_keys if kind == "keys" else state.kernels.encode_values
            decode = state.kernels.decode_keys if kind == "keys" else state.kernels.decode_values
            out = self.arrays.cast(decode(encode(xa, ctx), ctx), dtype_name(x))
        if not self.arrays.all_finite(out):
            raise InputError(f"{kind}: {state.spec.method}'s stored fields overflow for this input (float16 holds up to "
                             "65504), so it decodes to non-finite values; scale the input down, or use the method's "
                             "float32 storage option where it has one")
        self._keep(state)
        return out

    def attend(self, q: Any, pk: PackedKV, pv: PackedKV, scale: float | None = None, return_lse: bool = False,
               *, layer: int | None = None) -> Any:
        """Softmax attention of ``q`` over the packed cache, scoring from the codes.

        Equals softmax attention over the decoded K/V within float tolerance. ``scale``
        defaults to 1/sqrt(head_dim); a scale outside float32's normal range, or one whose
        scaled logits overflow float32 (a non-finite log-sum-exp), is an InputError. With
        ``return_lse`` also returns the log-sum-exp of the scaled logits per query row, for
        merging with attention over other tokens. ``layer``: the layer the blocks record
        (default the quantizer's).
        """
        state, pk, layer = self._packed(pk, "keys", layer)
        _, pv, _ = self._packed(pv, "values", layer)
        try:
            _, qa = check_query(q, pk, pv, self.arrays)
        except InputError as exc:
            raise InputError(f"{exc}{_transposed_hint(q, pk)}") from None
        self._device_ok(state, q)
        scale = check_scale(scale, state.spec.head_dim)
        asarray = self.arrays.asarray
        kf = {k: asarray(v) for k, v in pk.fields.items()}
        vf = {k: asarray(v) for k, v in pv.fields.items()}
        out, lse = state.kernels.attend(qa, kf, vf, self._ctx(state, pk.shape, layer), scale)
        check_attention_finite(lse, self.arrays, scale)
        out = self.arrays.cast(out, dtype_name(q))
        self._keep(state)
        return (out, lse) if return_lse else out

    def fuses_window(self, q: Any) -> bool:
        """Whether :meth:`attend_window` runs for queries like ``q``: the backend has a fused kernel
        for this spec on ``q``'s device (numba on the CPU for OScaR/KIVI 2- and 4-bit rows, OCTOPUS and
        TurboQuant; every torch-tensor backend through one ``kvq::attend_window`` op)."""
        fused = getattr(self.kernels, "fuses_window", None)
        return fused is not None and bool(fused(q))

    def plan_window(self, blocks: Sequence[tuple[PackedKV, PackedKV]], *, layer: int | None = None) -> WindowPlan:
        """Check (packed keys, packed values) blocks in token order for :meth:`attend_window` once
        and convert their fields to the backend's arrays: :meth:`attend_window` takes the plan in
        place of the list and then checks only the query and the window (a cache layer's blocks
        change only when it flushes, so its decode steps reuse one plan). The plan holds the blocks."""
        layer = check_layer(layer, self.layer)
        state, parts, shape = self._bound, KernelBlocks(), None
        asarray = self.arrays.asarray
        pairs = tuple(blocks)
        for pk, pv in pairs:
            state, pk, _ = self._packed(pk, "keys", layer)
            _, pv, _ = self._packed(pv, "values", layer)
            if pv.shape != pk.shape:
                raise InputError(f"packed values shape {list(pv.shape)} differs from packed keys shape {list(pk.shape)}")
            if shape is not None and pk.shape[:2] != shape[:2]:
                raise InputError(f"attend_window: block shape {list(pk.shape)} / {list(pv.shape)} differs in batch or "
                                 f"kv_heads from the first block's {list(pairs[0][0].shape)}")
            shape = pk.shape if shape is None else (shape[0], shape[1], shape[2] + pk.shape[2], shape[3])
            parts.add({k: asarray(v) for k, v in pk.fields.items()}, {k: asarray(v) for k, v in pv.fields.items()},
                      pk.shape[2], pk.kernel_memo())
        return WindowPlan(self, layer, state, pairs, parts, shape)

    def attend_window(self, q: Any, blocks: Sequence[tuple[PackedKV, PackedKV]] | WindowPlan, window_k: Any,
                      window_v: Any, scale: float | None = None, *, layer: int | None = None) -> tuple[Any, Any]:
        """``(out, lse)``: softmax attention of ``q`` over packed blocks and an exact window, in one kernel call.

        ``blocks``: (packed keys, packed values) pairs in token order, every token visible to every query,
        or a :meth:`plan_window` of them (made by this quantizer for this layer; a plan whose blocks had
        their fields swapped is made again); ``window_k`` / ``window_v`` ``[batch, kv_heads, w, head_dim]``:
        the ``w >= q_len`` tokens after them in full precision, the last ``q_len`` being the queries' own
        (query ``i`` sees the window up to its position). One online softmax runs across the codes and the
        window (no per-part outputs to merge); it equals softmax attention over the decoded blocks and the
        window within float tolerance. ``out`` is in ``q``'s dtype, ``lse`` float32 ``[batch, q_heads, q_len]``.
        Only where :meth:`fuses_window` (else :meth:`attend` per block and a log-sum-exp merge compute the same).
        """
        if not self.fuses_window(q):
            raise BackendUnavailableError(f"backend {self.backend!r} has no fused window kernel for "
                                          f"{self.spec.describe()} on this input; use attend() per block")
        layer = check_layer(layer, self.layer)
        plan = blocks if isinstance(blocks, WindowPlan) else None
        if plan is None or not plan.current(self, layer):
            plan = self.plan_window(blocks if plan is None else plan.pairs, layer=layer)
        state, shape = plan.state, plan.shape
        asarray = self.arrays.asarray
        check_float_array(window_k, "window keys", KV_DIMS)
        check_float_array(window_v, "window values", KV_DIMS)
        if shape is None:
            check_float_array(q, "query", QUERY_DIMS)
            qa = asarray(q)
        else:
            try:
                _, qa = check_query_for(q, shape, self.arrays)  # converted once: checks and kernel read it
            except InputError as exc:
                raise InputError(f"{exc}{_transposed_hint(q, plan.pairs[0][0])}") from None
        qs, ks, vs = getattr(q, "shape", ()), getattr(window_k, "shape", ()), getattr(window_v, "shape", ())
        if len(qs) != 4 or len(ks) != 4 or tuple(vs) != tuple(ks) or ks[0] != qs[0] or ks[3] != qs[3] \
                or ks[3] != state.spec.head_dim or qs[1] % ks[1] or ks[2] < qs[2] \
                or (shape is not None and tuple(ks[:2]) != tuple(shape[:2])):
            raise InputError(f"attend_window: query {list(qs)}, window keys {list(ks)} and values {list(vs)}; expected "
                             "q [batch, q_heads, q_len, head_dim] and equal windows [batch, kv_heads, w >= q_len, head_dim] "
                             "matching the blocks' batch and kv_heads")
        self._heads(ks, "window keys")
        self._device_ok(state, q)
        scale = check_scale(scale, state.spec.head_dim)
        ctx = self._ctx(state, (ks[0], ks[1], 0 if shape is None else shape[2], ks[3]), layer)
        out, lse = state.kernels.attend_window(qa, plan.blocks, asarray(window_k), asarray(window_v), ctx, scale)
        check_attention_finite(lse, self.arrays, scale)
        out = self.arrays.cast(out, dtype_name(q))
        self._keep(state)
        return out, lse

    def bits_per_element(self, packed: PackedKV | Sequence[PackedKV]) -> float:
        """Every stored bit (codes, norms, scales, zero-points, padding) over original elements."""
        blocks = [packed] if isinstance(packed, PackedKV) else list(packed)
        for b in blocks:
            check_packed(b, self.spec, getattr(b, "kind", "keys"), getattr(b, "layer", self.layer), self.arrays)
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
