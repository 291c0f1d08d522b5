"""A torch-tensor backend's :class:`~kvq_core.contract.MethodKernels`: every call is one ``kvq::`` op
carrying the backend's name, so a user's ``torch.compile(fullgraph=True)`` or ``torch.export``
over kvq calls keeps each as one opaque graph node.

The Quantizer builds one for a backend whose ``BackendInfo.torch_ops`` is set, in place of the
backend's kernel class (which the op bodies, :mod:`kvq_core.torch_ops.run`, get from the registry).
torch is imported when an :class:`OpKernels` is built, not with this module."""
from __future__ import annotations

from typing import Any

from kvq_core.contract import KernelContext
from kvq_core.spec import MethodSpec

#: the blocks' memo key of their fields as the ``kvq::attend_window`` op takes them (flat lists)
_FLAT = "kvq.attend_window_fields"


class OpKernels:
    """The kernels of one method on ``backend``, through the ``kvq::`` ops."""

    def __init__(self, backend: str, spec: MethodSpec) -> None:
        import torch

        import kvq_core.torch_ops.ops  # noqa: F401  (defines the kvq:: ops)
        from kvq_core.torch_ops.torch_kernels import field_names

        ops = torch.ops.kvq
        self.encode_op, self.decode_op, self.attend_op = ops.encode, ops.decode, ops.attend
        self.fake_quant_op, self.attend_window_op = ops.fake_quant, ops.attend_window
        self.backend = backend
        self.spec = spec
        self.spec_json = spec.to_json()  # computed here, outside any traced region
        self.names = {kind: field_names(spec, kind) for kind in ("keys", "values")}

    def _encode(self, kind: str, x: Any, ctx: KernelContext) -> dict[str, Any]:
        return dict(zip(self.names[kind], self.encode_op(self.backend, self.spec_json, ctx.layer, kind, x)))

    def _decode(self, kind: str, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return self.decode_op(self.backend, self.spec_json, ctx.layer, kind,
                              [fields[n] for n in self.names[kind]], list(ctx.shape))

    def encode_keys(self, k: Any, ctx: KernelContext) -> dict[str, Any]:
        return self._encode("keys", k, ctx)

    def decode_keys(self, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return self._decode("keys", fields, ctx)

    def encode_values(self, v: Any, ctx: KernelContext) -> dict[str, Any]:
        return self._encode("values", v, ctx)

    def decode_values(self, fields: dict[str, Any], ctx: KernelContext) -> Any:
        return self._decode("values", fields, ctx)

    def fake_quant(self, kind: str, x: Any, ctx: KernelContext) -> Any:
        """``decode(encode(x))`` in one ``kvq::fake_quant`` op, with a straight-through gradient."""
        return self.fake_quant_op(self.backend, self.spec_json, ctx.layer, kind, x)

    def attend(self, q: Any, kfields: dict[str, Any], vfields: dict[str, Any], ctx: KernelContext,
               scale: float) -> tuple[Any, Any]:
        kf = [kfields[n] for n in self.names["keys"]]
        vf = [vfields[n] for n in self.names["values"]]
        return self.attend_op(self.backend, self.spec_json, ctx.layer, q, kf, vf, list(ctx.shape), float(scale))

    def fuses_window(self, q: Any) -> bool:
        """Every torch-tensor kernel class has ``attend_window`` (at least :class:`kvq_torch.common.TorchMethod`'s
        reference over the decoded blocks), served by one ``kvq::attend_window`` op."""
        return True

    def attend_window(self, q: Any, blocks: list[tuple[dict[str, Any], dict[str, Any], int]], window_k: Any,
                      window_v: Any, ctx: KernelContext, scale: float) -> tuple[Any, Any]:
        memo = getattr(blocks, "memo", {})  # a WindowPlan's blocks keep it over decode steps
        flat = memo.get(_FLAT)
        if flat is None:
            flat = memo[_FLAT] = ([kfields[n] for kfields, _, _ in blocks for n in self.names["keys"]],
                                  [vfields[n] for _, vfields, _ in blocks for n in self.names["values"]],
                                  [t for _, _, t in blocks])
        kf, vf, tokens = flat
        return self.attend_window_op(self.backend, self.spec_json, ctx.layer, q, kf, vf, tokens,
                                     window_k, window_v, float(scale))
