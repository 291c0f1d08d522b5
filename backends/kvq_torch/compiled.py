"""The ``"torch-compiled"`` backend's kernels: the torch method kernels compiled by inductor.

Shapes: everything is static except the token dims of K/V and fields and the query's heads and
length, which are marked dynamic before the call, so one graph per (spec, kernel, batch,
kv_heads) serves every token count; inputs are cast to float32 first, so one graph serves
float32/float16/bfloat16. (``dynamic=True`` would also make batch, heads, head_dim and the
spec's integers symbolic, which makes inductor's index algebra ~10x slower to compile.)
Codes are bit-identical to the eager ``"torch"`` backend.
"""
from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from kvq_core.torch_ops.torch_kernels import Fields, TorchContext, field_names
from kvq_core.spec import MethodSpec
from kvq_torch.common import TorchMethod

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


class CompiledMethod:
    """One method's kernels on ``"torch-compiled"``: the eager kernel object ``impl``, each of its
    five functions compiled by inductor on first use (a table kernel of :mod:`kvq_core.torch_ops`)."""

    def __init__(self, impl: TorchMethod) -> None:
        self.impl = impl
        self.spec = impl.spec
        self.spec_json = impl.spec.to_json()

    def _fn(self, what: str, ctx: TorchContext) -> Callable[..., Any]:
        return compiled_kernel(self.impl, self.spec_json, what, ctx.shape[0], ctx.shape[1])

    def _fields(self, kind: str, fields: Fields) -> Fields:
        dims = token_dims(self.spec, kind)[0]
        return {n: _dyn(fields[n], dims[n]) for n in field_names(self.spec, kind)}

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return self._fn("encode_keys", ctx)(_dyn(_f32(k), (2,)), ctx.consts, ctx.layer)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return self._fn("encode_values", ctx)(_dyn(_f32(v), (2,)), ctx.consts, ctx.layer)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._fn("decode_keys", ctx)(self._fields("keys", fields), ctx.consts, ctx.layer, ctx.shape[2])

    def decode_values(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return self._fn("decode_values", ctx)(self._fields("values", fields), ctx.consts, ctx.layer, ctx.shape[2])

    def clips(self, kind: str) -> bool:
        return self.impl.clips(kind)

    def ste_grad(self, x: torch.Tensor, grad: torch.Tensor, ctx: TorchContext, kind: str) -> torch.Tensor:
        """Eager: it runs in a backward pass, for the few codecs that clip."""
        return self.impl.ste_grad(x, grad, ctx, kind)

    def attend(self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        scale_t = torch.tensor(float(scale), dtype=torch.float32, device=q.device)
        return self._fn("attend", ctx)(_dyn(_f32(q), (1, 2)), self._fields("keys", kfields),
                                       self._fields("values", vfields), ctx.consts, ctx.layer, ctx.shape[2], scale_t)

    def attend_window(self, q: torch.Tensor, blocks: list[tuple[Fields, Fields, int]], window_k: torch.Tensor,
                      window_v: torch.Tensor, ctx: TorchContext, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference (:meth:`TorchMethod.attend_window`) over blocks decoded by the compiled kernels."""
        return TorchMethod.attend_window(self, q, blocks, window_k, window_v, ctx, scale)  # type: ignore[arg-type]


def compiled(method_cls: type[TorchMethod]) -> Callable[[MethodSpec], CompiledMethod]:
    """The table factory of ``method_cls`` on ``"torch-compiled"``."""
    return lambda spec: CompiledMethod(method_cls(spec))
