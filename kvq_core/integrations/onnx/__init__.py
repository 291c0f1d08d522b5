"""ONNX export of kvq's cache computations; needs ``pip install 'kvq-core[onnx,torch]'``.

- :func:`export` writes one of :data:`GRAPHS` for a quantizer's spec and layer;
- ``kvq export onnx METHOD --graph GRAPH -o FILE`` does the same from the shell (:mod:`kvq_core.integrations.onnx.cli`).

See :mod:`kvq_core.integrations.onnx.graphs` for what is traced, :mod:`kvq_core.integrations.onnx.translations` for the
onnxscript translations (the unsigned-shift workaround), docs/backends.md "ONNX export" for usage. The
names below load on first use, so ``kvq export onnx`` can say which extra is missing.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {"EXPORTABLE": "exporter", "MIN_OPSET": "exporter", "check_exportable": "exporter", "export": "exporter",
         "GRAPHS": "graphs"}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'kvq_core.integrations.onnx' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvq_core.integrations.onnx.{_HOME[name]}"), name)
