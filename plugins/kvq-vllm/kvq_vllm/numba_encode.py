"""``kvq::encode`` on CPU tensors through the numba backend's kernels (an adapter of this plugin).

The numba backend registers NumPy kernels, not ``kvq::`` op entries, so on its own the ops would
encode with the torch kernels (OCTOPUS's joint rounding in eager torch: tens of ms per layer and
step). :func:`register` adds a ``("numba", method)`` op entry for every method numba serves: CPU
tensors go in as NumPy views, the numba kernel encodes them with the core's constants, and the
fields come back as tensors. Encode only: attention is ``kvq::attend_paged``.
"""
from __future__ import annotations

import numpy as np
import torch

from kvq_core import registry
from kvq_core.constants import constants
from kvq_core.dispatch.table import methods, register_kernel
from kvq_core.dispatch.torch_kernels import Fields, TorchContext, TorchMethod
from kvq_core.kernels import KernelContext

BACKEND = "numba"


class NumbaEncode(TorchMethod):
    """The numba backend's encoders of one spec, on CPU torch tensors."""

    def __init__(self, spec) -> None:  # noqa: ANN001  (a MethodSpec)
        super().__init__(spec)
        self.kernels = registry.kernel_factory(BACKEND, spec.method)(spec)

    def _run(self, encode, x: torch.Tensor, ctx: TorchContext) -> Fields:  # noqa: ANN001
        arr = x.detach().to(torch.float32).numpy()
        shape = tuple(int(s) for s in x.shape)
        consts = constants(self.spec, shape[1], ctx.layer, ctx.head_offset)
        fields = encode(arr, KernelContext(self.spec, ctx.layer, shape, consts))
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in fields.items()}

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return self._run(self.kernels.encode_keys, k, ctx)

    def encode_values(self, v: torch.Tensor, ctx: TorchContext) -> Fields:
        return self._run(self.kernels.encode_values, v, ctx)


def register() -> None:
    """Add the numba encoders to the ``kvq::`` op table (once; nothing when numba is unavailable)."""
    if not registry.backend_status(BACKEND)[0]:
        return
    served = [m for m, entry in registry.backend_info(BACKEND).kernels.items() if registry.serves(BACKEND, m)[0]]
    for method in served:
        if method not in methods(BACKEND):
            register_kernel(BACKEND, method, NumbaEncode)
