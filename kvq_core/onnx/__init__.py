"""ONNX export of kvq's cache computations (issue #14); needs ``pip install 'kvq[onnx,torch]'``.

- :func:`export` writes one of :data:`GRAPHS` for a quantizer's spec and layer;
- ``kvq export onnx METHOD --graph GRAPH -o FILE`` does the same from the shell (:mod:`kvq_core.onnx.cli`).

See :mod:`kvq_core.onnx.graphs` for what is traced, :mod:`kvq_core.onnx.translations` for the
onnxscript translations (the unsigned-shift workaround), README "ONNX export" for usage.
"""
from kvq_core.onnx.export import EXPORTABLE, MIN_OPSET, check_exportable, export
from kvq_core.onnx.graphs import GRAPHS

__all__ = ["EXPORTABLE", "GRAPHS", "MIN_OPSET", "check_exportable", "export"]
