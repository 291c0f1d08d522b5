"""Records the argument types of every CUDA kernel launch the numba backend makes, for the PTX
compile gate (tests/test_numba_ptx.py runs this under NUMBA_ENABLE_CUDASIM=1, which must be set
before numba is imported; the file name keeps pytest from collecting it).

Each CUDA path of the backend (every served method's encode, decode and attend; rotation and OTS
on and off; OCTOPUS values coded and float16; float16 input, which alone adds a launch, on the
first path only) runs once at a tiny shape through the public ``Quantizer``. The simulator's kernel launches are watched (its
``FakeCUDAKernel.__call__``), each argument described as it is typed on a GPU: a NumPy dtype, a
dimension count (0 for a scalar) and a layout. Prints one JSON object: ``"module:kernel"`` ->
sorted list of signatures, each a list of ``[dtype, ndim, layout]``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

#: (method, spec parameters): every branch of the CUDA kernels' launches
PATHS = (
    ("oscar", {"bits": 2}),
    ("oscar", {"bits": 4, "rotation": False, "token_scaling": False}),
    ("oscar", {"bits": 8, "key_group": 16, "value_group": 16}),
    ("octopus", {"values": "octopus", "rounding": "joint"}),
    ("octopus", {"values": "fp16", "rounding": "plain"}),
)
HEAD_DIM, TOKENS, KV_HEADS, GQA = 16, 3, 2, 2


def describe(arg: Any) -> list:
    """``[dtype, ndim, layout]`` of a launch argument as numba types it (scalars: ndim 0)."""
    a = getattr(arg, "_ary", arg)  # a simulator device array wraps a NumPy array
    if isinstance(a, np.ndarray) and a.ndim > 0:
        layout = "C" if a.flags.c_contiguous else "F" if a.flags.f_contiguous else "A"
        return [a.dtype.str, a.ndim, layout]
    return [np.asarray(a).dtype.str, 0, ""]


def record() -> dict[str, list]:
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from kvq_core import registry
    from kvq_core.api import Quantizer

    seen: dict[str, set] = {}
    launch = FakeCUDAKernel.__call__

    def watched(self: Any, *args: Any) -> Any:
        if not self._device and self.grid_dim is not None:
            key = f"{self.fn.__module__}:{self.fn.__name__}"
            seen.setdefault(key, set()).add(json.dumps([describe(a) for a in args]))
        return launch(self, *args)

    FakeCUDAKernel.__call__ = watched
    from numba import cuda

    rng = np.random.default_rng(0)
    for i, (method, params) in enumerate(PATHS):
        spec = registry.make_spec(method, head_dim=HEAD_DIM, **params)
        quant = Quantizer(spec, "numba")
        for dtype in (np.float32, np.float16) if i == 0 else (np.float32,):
            k, v = (cuda.to_device(rng.standard_normal((1, KV_HEADS, TOKENS, HEAD_DIM)).astype(dtype)) for _ in "kv")
            q = cuda.to_device(rng.standard_normal((1, KV_HEADS * GQA, 1, HEAD_DIM)).astype(dtype))
            pk, pv = quant.encode_keys(k), quant.encode_values(v)
            quant.decode_keys(pk)
            quant.decode_values(pv)
            quant.attend(q, pk, pv)
    return {key: sorted(json.loads(s) for s in sigs) for key, sigs in sorted(seen.items())}


if __name__ == "__main__":
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("set NUMBA_ENABLE_CUDASIM=1 (before numba is imported)")
    print(json.dumps(record()))
