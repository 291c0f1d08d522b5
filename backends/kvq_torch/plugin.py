"""Registers the torch backends through kvq's hooks, like any third-party plugin.

- ``"torch"``: eager; every kernel call is one ``kvq::`` custom op (:mod:`kvq_core.torch_ops.ops`,
  ``BackendInfo.torch_ops``) served by the classes of ``KERNELS``, so a user's ``torch.compile(fullgraph=True)`` or
  ``torch.export`` over kvq calls keeps each op as one opaque graph node, with no graph break.
- ``"torch-compiled"``: the same classes, each kernel function compiled by inductor
  (:mod:`kvq_torch.compiled`, the backend's ``BackendInfo.adapt``), through the same ops; codes
  are bit-identical to ``"torch"``.

Adding a method: write one :class:`kvq_torch.common.TorchMethod` subclass in
``kvq_torch/<method>.py`` and add one line to ``KERNELS``; a third-party plugin registers its
subclass with the ``kvq_register_kernels`` hook instead, and it runs exactly the same way (the
registry stores it in the backend's table and applies the backend's ``adapt``).

Importing this module does not import torch (only checks it is installed): torch loads when a
kernel or the array adapter is first used, so ``kvq_core`` with a NumPy or Numba quantizer
never pays for it.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
from collections.abc import Callable
from typing import Any

from kvq_core.hookspecs import hookimpl
from kvq_core.contract import ALL_METHODS, BackendInfo

if importlib.util.find_spec("torch") is None:  # no torch: this plugin registers nothing, with the reason
    raise ModuleNotFoundError("No module named 'torch' (pip install torch)", name="torch")

#: the torch array adapter, imported (with torch) on first use
ARRAYS = "kvq_core.torch_ops.arrays:TorchArrays"

#: method name -> TorchMethod subclass (lazy: a module that fails to import disables one method).
KERNELS: dict[str, str] = {
    "fp16": "kvq_torch.fp16:Fp16Torch",
    "kivi": "kvq_torch.intcodes:IntCodesTorch",
    "octopus": "kvq_torch.octopus:OctopusTorch",
    "oscar": "kvq_torch.intcodes:IntCodesTorch",
    "polarquant": "kvq_torch.polarquant:PolarQuantTorch",
    "qjl": "kvq_torch.qjl:QJLTorch",
    "quarot": "kvq_torch.intcodes:IntCodesTorch",
    "turboquant": "kvq_torch.turboquant:TurboQuantTorch",
    "turboquant_prod": "kvq_torch.turboquant:TurboQuantProdTorch",
}

EAGER, COMPILED = "torch", "torch-compiled"

#: ``kvq::attend_paged`` for every method: decode the pages, masked softmax (the fallback of every backend)
PAGED = "kvq_torch.paged:PagedTorch"
#: ``kvq::write_paged`` for every method: encode, pack, scatter (the reference, and every backend's fallback)
PAGED_WRITE = "kvq_torch.paged_write:PagedWriteTorch"


@functools.lru_cache(maxsize=1)
def _compiled_available() -> tuple[bool, str | None]:
    """Inductor's CPU code generation needs a C++ compiler (CUDA tensors need Triton besides)."""
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in candidates):
        return False, "torch.compile (inductor) needs a C++ compiler (g++/clang++) for CPU kernels; none on PATH"
    torch_spec = importlib.util.find_spec("torch")  # torch itself is not imported to answer
    places = torch_spec.submodule_search_locations if torch_spec is not None else None
    if not places or not any(os.path.isdir(os.path.join(p, "_inductor")) for p in places):
        return False, "this torch has no torch._inductor (torch.compile's code generator)"  # pragma: no cover
    return True, None


def compiled(cls: Any) -> Any:
    """:func:`kvq_torch.compiled.compiled` (imported with torch when the kernels resolve)."""
    from kvq_torch.compiled import compiled as compile_kernels

    return compile_kernels(cls)


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a source build without metadata
        return "(version unknown)"


@hookimpl
def kvq_register_backends(register: Callable[[BackendInfo], None]) -> None:
    register(BackendInfo(EAGER, KERNELS, ARRAYS, torch_ops=True,
                         paged={ALL_METHODS: PAGED}, paged_write={ALL_METHODS: PAGED_WRITE},
                         summary=f"PyTorch {_torch_version()} eager: kvq:: custom ops (CPU/CUDA; compile/export friendly)"))
    register(BackendInfo(COMPILED, KERNELS, ARRAYS, _compiled_available, torch_ops=True, adapt=compiled,
                         summary="PyTorch kernels compiled by inductor, codes bit-identical to 'torch'"))


@hookimpl
def kvq_select_backend(method: str, device: str | None, candidates: list[str]) -> str | None:
    """``backend="auto"`` with a torch device string picks the eager torch backend."""
    if device is not None and EAGER in candidates:
        return EAGER
    return None
