"""Registers the torch backends through kvq's hooks, like any third-party plugin.

- ``"torch"``: eager; every kernel call is one ``kvq::`` custom op (:mod:`kvq_torch.ops`), so a
  user's ``torch.compile(fullgraph=True)`` or ``torch.export`` over kvq calls keeps each op as one
  opaque graph node, with no graph break.
- ``"torch-compiled"``: the same method kernels (``KERNELS``), each kernel function compiled by
  inductor with ``torch.compile(dynamic=True, fullgraph=True)``; codes are bit-identical to
  ``"torch"``. It calls the compiled functions directly (not through the custom ops, whose bodies
  inductor cannot see). Inputs are cast to float32 before the compiled region so one graph
  serves float32/float16/bfloat16 input. Use ``"torch"`` inside your own ``torch.compile``.

Adding a method: write one :class:`kvq_torch.common.TorchMethod` subclass in
``kvq_torch/<method>.py`` and add one line to ``KERNELS``.
"""
from __future__ import annotations

import functools
import os
import shutil
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

import kvq_torch.ops  # noqa: F401  (defines the kvq:: ops)
from kvq_core.hookspecs import hookimpl
from kvq_core.kernels import KernelContext
from kvq_core.registry import BackendInfo
from kvq_core.spec import MethodSpec
from kvq_torch.arrays import TorchArrays
from kvq_torch.common import TorchContext, TorchMethod, consts_for, field_names
from kvq_torch.fp16 import Fp16Torch
from kvq_torch.kivi import KiviTorch
from kvq_torch.octopus import OctopusTorch
from kvq_torch.oscar import OscarTorch
from kvq_torch.polarquant import PolarQuantTorch
from kvq_torch.qjl import QJLTorch
from kvq_torch.quarot import QuaRotTorch
from kvq_torch.turboquant import TurboQuantProdTorch, TurboQuantTorch

#: method name -> TorchMethod subclass. One line per method.
KERNELS: dict[str, type[TorchMethod]] = {
    "fp16": Fp16Torch,
    "kivi": KiviTorch,
    "octopus": OctopusTorch,
    "oscar": OscarTorch,
    "polarquant": PolarQuantTorch,
    "qjl": QJLTorch,
    "quarot": QuaRotTorch,
    "turboquant": TurboQuantTorch,
    "turboquant_prod": TurboQuantProdTorch,
}

EAGER, COMPILED = "torch", "torch-compiled"


class TorchKernels:
    """The :class:`kvq_core.kernels.MethodKernels` of one method on the ``"torch"`` backend:
    each call is one ``kvq::`` custom op (traceable by torch.compile / torch.export)."""

    def __init__(self, method_cls: type[TorchMethod], spec: MethodSpec) -> None:
        self.spec = spec
        self.spec_json = spec.to_json()  # computed here, outside any traced region
        self.impl = method_cls(spec)
        self.names = {kind: field_names(spec, kind) for kind in ("keys", "values")}

    def _encode(self, kind: str, x: Any, ctx: KernelContext) -> dict[str, Any]:
        return dict(zip(self.names[kind], torch.ops.kvq.encode(self.spec_json, ctx.layer, kind, x)))

    def _decode(self, kind: str, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return torch.ops.kvq.decode(self.spec_json, ctx.layer, kind, [fields[n] for n in self.names[kind]], list(ctx.shape))

    def encode_keys(self, k: Any, ctx: KernelContext) -> dict[str, Any]:
        return self._encode("keys", k, ctx)

    def decode_keys(self, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return self._decode("keys", fields, ctx)

    def encode_values(self, v: Any, ctx: KernelContext) -> dict[str, Any]:
        return self._encode("values", v, ctx)

    def decode_values(self, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return self._decode("values", fields, ctx)

    def attend(self, q: Any, kfields: dict[str, Any], vfields: dict[str, Any], ctx: KernelContext, scale: float):
        kf = [kfields[n] for n in self.names["keys"]]
        vf = [vfields[n] for n in self.names["values"]]
        return torch.ops.kvq.attend(self.spec_json, ctx.layer, q, kf, vf, list(ctx.shape), float(scale))


# ------------------------------------------------------------------------------------------------
# the compiled backend
# ------------------------------------------------------------------------------------------------
_compiled: dict[tuple[str, str, int, int], Callable[..., Any]] = {}
_compiled_lock = threading.Lock()


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object, so dynamo keeps a separate cache (and recompile
    budget) for it: one per (spec, kernel), instead of all specs sharing one code object."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@functools.lru_cache(maxsize=512)
def token_dims(spec: MethodSpec, kind: str) -> tuple[dict[str, tuple[int, ...]], tuple[str, int] | None]:
    """Per field, the dims whose size depends on the token count, and one (field, dim) whose
    size *is* the token count (None if no field has one); found by probing the layout."""
    make = spec.key_layout if kind == "keys" else spec.value_layout
    t1, t2 = 4099, 8209
    a, b = make(2, 3, t1), make(2, 3, t2)
    dims = {n: tuple(i for i, (p, q) in enumerate(zip(a[n].shape, b[n].shape)) if p != q) for n in a}
    exact = next(((n, i) for n in a for i in dims[n] if a[n].shape[i] == t1 and b[n].shape[i] == t2), None)
    return dims, exact


def _build(impl: TorchMethod, what: str, batch: int, kv_heads: int) -> Callable[..., Any]:
    """The function to compile. Batch, kv_heads, head_dim and the spec are closure constants
    (static); the token count comes from a tensor dim marked dynamic (or an int argument when
    no field's dim equals it)."""
    spec = impl.spec
    d = spec.head_dim
    if what in ("encode_keys", "encode_values"):
        method = getattr(impl, what)

        def run(x, consts, layer):
            return method(x, TorchContext(spec, layer, (batch, kv_heads, x.shape[2], d), consts))

        return run
    kind = "keys" if what in ("decode_keys", "attend") else "values"
    src = token_dims(spec, kind)[1]

    def tokens_of(fields, tokens):
        return fields[src[0]].shape[src[1]] if src is not None else tokens

    if what in ("decode_keys", "decode_values"):
        method = getattr(impl, what)

        def run(fields, consts, layer, tokens):
            return method(fields, TorchContext(spec, layer, (batch, kv_heads, tokens_of(fields, tokens), d), consts))

        return run

    def run(q, kfields, vfields, consts, layer, tokens, scale):
        ctx = TorchContext(spec, layer, (batch, kv_heads, tokens_of(kfields, tokens), d), consts)
        return impl.attend(q, kfields, vfields, ctx, scale)

    return run


def compiled_kernel(impl: TorchMethod, spec_json: str, what: str, batch: int, kv_heads: int) -> Callable[..., Any]:
    """The inductor-compiled ``what`` kernel of ``impl`` (cached per spec, kernel, batch, kv_heads)."""
    key = (spec_json, what, int(batch), int(kv_heads))
    fn = _compiled.get(key)
    if fn is None:
        with _compiled_lock:
            fn = _compiled.get(key)
            if fn is None:
                name = f"kvq_{impl.spec.method}_{what}_{len(_compiled)}"
                run = _own_code(_build(impl, what, int(batch), int(kv_heads)), name)
                fn = torch.compile(run, fullgraph=True)
                _compiled[key] = fn
    return fn


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _dyn(x: torch.Tensor, dims: tuple[int, ...] = ()) -> torch.Tensor:
    """A view of ``x`` (the caller's tensor stays unmarked) with ``dims`` marked dynamic."""
    v = x.view(x.shape)
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(v, d)
    return v


class CompiledTorchKernels(TorchKernels):
    """The ``"torch-compiled"`` kernels: the same method code, compiled by inductor.

    Shapes: everything is static except the token dims of K/V and fields and the query's heads
    and length, which are marked dynamic before the call, so one graph per (spec, kernel, batch,
    kv_heads) serves every token count; inputs are cast to float32 first, so one graph serves
    float32/float16/bfloat16. (``dynamic=True`` would also make batch, heads, head_dim and the
    spec's integers symbolic, which makes inductor's index algebra ~10x slower to compile.)
    """

    def _consts(self, ctx: KernelContext, device: torch.device) -> dict[str, torch.Tensor]:
        return consts_for(self.spec_json, ctx.shape[1], ctx.layer, device)

    def _fields(self, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
        dims = token_dims(self.spec, kind)[0]
        return {n: _dyn(fields[n], dims[n]) for n in self.names[kind]}

    def _encode(self, kind: str, x: Any, ctx: KernelContext) -> dict[str, Any]:
        fn = compiled_kernel(self.impl, self.spec_json, f"encode_{kind}", ctx.shape[0], ctx.shape[1])
        return fn(_dyn(_f32(x), (2,)), self._consts(ctx, x.device), ctx.layer)

    def _decode(self, kind: str, fields: dict[str, Any], ctx: KernelContext) -> Any:
        fn = compiled_kernel(self.impl, self.spec_json, f"decode_{kind}", ctx.shape[0], ctx.shape[1])
        device = next(iter(fields.values())).device
        return fn(self._fields(kind, fields), self._consts(ctx, device), ctx.layer, ctx.shape[2])

    def attend(self, q: Any, kfields: dict[str, Any], vfields: dict[str, Any], ctx: KernelContext, scale: float):
        fn = compiled_kernel(self.impl, self.spec_json, "attend", ctx.shape[0], ctx.shape[1])
        scale_t = torch.tensor(float(scale), dtype=torch.float32, device=q.device)
        return fn(_dyn(_f32(q), (1, 2)), self._fields("keys", kfields), self._fields("values", vfields),
                  self._consts(ctx, q.device), ctx.layer, ctx.shape[2], scale_t)


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------
def _eager_available() -> tuple[bool, str | None]:
    return True, None


@functools.lru_cache(maxsize=1)
def _compiled_available() -> tuple[bool, str | None]:
    """Inductor's CPU code generation needs a C++ compiler (CUDA tensors need Triton besides)."""
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in candidates):
        return False, "torch.compile (inductor) needs a C++ compiler (g++/clang++) for CPU kernels; none on PATH"
    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:  # pragma: no cover - broken torch install
        return False, f"torch._inductor failed to import: {type(exc).__name__}: {exc}"
    return True, None


def _table(cls: type[TorchKernels]) -> dict[str, Callable[[MethodSpec], Any]]:
    return {name: functools.partial(cls, impl) for name, impl in KERNELS.items()}


@hookimpl
def kvq_register_backends(register: Callable[[BackendInfo], None]) -> None:
    arrays = TorchArrays()
    register(BackendInfo(EAGER, _table(TorchKernels), arrays, _eager_available,
                         summary=f"PyTorch {torch.__version__} eager: kvq:: custom ops (CPU/CUDA; compile/export friendly)"))
    register(BackendInfo(COMPILED, _table(CompiledTorchKernels), arrays, _compiled_available,
                         summary="PyTorch kernels compiled by inductor (torch.compile dynamic=True), codes bit-identical to 'torch'"))


@hookimpl
def kvq_select_backend(method: str, device: str | None, candidates: list[str]) -> str | None:
    """``backend="auto"`` with a torch device string picks the eager torch backend."""
    if device is not None and EAGER in candidates:
        return EAGER
    return None
