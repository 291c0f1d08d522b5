"""``export(quantizer, path, graph=...)``: one kvq computation as an ONNX file.

The graph is the ``"torch"`` backend's kernel traced by ``torch.onnx.export(dynamo=True)``
(:mod:`kvq_core.integrations.onnx.graphs`), with kvq's translations (:mod:`kvq_core.integrations.onnx.translations`),
checked afterwards to hold no ``kvq`` node.
"""
from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import onnx
import torch

from kvq_core import registry
from kvq_core.api import Quantizer
from kvq_core.errors import ExportError, KVQError
from kvq_core.integrations.onnx.graphs import BACKEND, GRAPHS, GraphIO, build
from kvq_core.integrations.onnx.translations import TRANSLATIONS

#: The oldest opset kvq exports: the project targets opset 23+ (ONNX ``Attention``, sub-byte
#: Q/DQ types; shared/specs/platform.md 4) and the parity tests run there, so an older opset is
#: an ExportError rather than an untested file.
MIN_OPSET = 23
#: Methods whose every graph is exported and checked against the NumPy reference in onnxruntime
#: (tests/test_onnx.py); others raise :class:`ExportError` rather than produce an unchecked file.
EXPORTABLE = ("kivi", "octopus", "oscar", "turboquant")


def check_exportable(method: str, graph: str, opset: int) -> None:
    """Raise :class:`ExportError` naming what is missing for (method, graph, opset)."""
    if graph not in GRAPHS:
        raise ExportError(f"ONNX export: graph={graph!r} is not one of {', '.join(GRAPHS)}")
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise ExportError(f"ONNX export: opset={opset!r} is unsupported; expected an integer in {MIN_OPSET}..{newest} "
                          f"(this onnx {onnx.__version__} knows up to {newest})")
    if method not in EXPORTABLE:
        raise ExportError(f"ONNX export: method {method!r} has no checked export path; exportable: {', '.join(EXPORTABLE)}")
    try:
        ok, reason = registry.serves(BACKEND, method)
    except KVQError as exc:  # the torch backend is not registered at all (torch missing)
        ok, reason = False, str(exc)
    if not ok:
        raise ExportError(f"ONNX export traces the {BACKEND!r} backend's kernels for {method!r}: {reason}")


def to_onnx(io: GraphIO, path: str | os.PathLike, opset: int = MIN_OPSET) -> onnx.ModelProto:
    """Trace ``io.module`` with kvq's translations, save it (weights inline) and return the model."""
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # torch.onnx/export chatter (deprecations, training mode)
            program = torch.onnx.export(
                io.module.eval(), io.args, dynamo=True, opset_version=opset, verbose=False,
                input_names=list(io.input_names), output_names=list(io.output_names),
                dynamic_shapes=io.dynamic_shapes, custom_translation_table=TRANSLATIONS)
    except torch.onnx.OnnxExporterError as exc:  # e.g. an op with no translation (an opaque kvq:: op)
        cause: BaseException = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ExportError(f"ONNX export of {type(io.module).__name__} failed: {str(cause).strip().splitlines()[0]}") from exc
    model = program.model_proto
    leftover = sorted({f"{n.domain}::{n.op_type}" for n in _nodes(model) if "kvq" in n.domain or "kvq" in n.op_type})
    if leftover:
        raise ExportError(f"ONNX export left kvq ops untranslated: {', '.join(leftover)}")
    onnx.save_model(model, os.fspath(path))
    return model


def _nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = list(model.graph.node)
    for fn in model.functions:
        nodes.extend(fn.node)
    return nodes


def export(quantizer: Quantizer, path: str | os.PathLike, graph: str, *, kv_heads: int, q_heads: int | None = None,
           scale: float | None = None, opset: int = MIN_OPSET) -> Path:
    """Write ``graph`` of ``quantizer``'s spec and layer as an ONNX model at ``path``.

    ``graph`` is ``"encode_keys"``, ``"encode_values"`` (x -> packed fields), ``"decode_keys"``,
    ``"decode_values"`` (packed fields -> x) or ``"attend"`` (q, ``keys_<field>``...,
    ``values_<field>``... -> ``out``, ``lse``). Inputs and outputs are named after the layout's
    fields with its dtypes (uint8 code rows, float16/float32 side fields), batch, tokens and
    q_len are dynamic; ``kv_heads`` (and ``q_heads`` for attend, a multiple of it: GQA) and the
    spec's head_dim are fixed (give ``head_dim`` to ``get_quantizer``: an unbound quantizer
    exports at its default). K/V and q are float32; ``scale`` defaults to 1/sqrt(head_dim).
    The quantizer's backend does not matter: the ``"torch"`` kernels are traced.
    """
    spec = quantizer.spec
    check_exportable(spec.method, graph, opset)
    q_heads = kv_heads if q_heads is None else q_heads
    for name, value in (("kv_heads", kv_heads), ("q_heads", q_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExportError(f"ONNX export: {name}={value!r}; expected an integer >= 1")
    if q_heads % kv_heads:
        raise ExportError(f"ONNX export: q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    scale = 1.0 / math.sqrt(spec.head_dim) if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ExportError(f"ONNX export: scale={scale!r}; expected a finite number > 0")
    io = build(spec, graph, layer=quantizer.layer, kv_heads=kv_heads, q_heads=q_heads, scale=float(scale))
    to_onnx(io, path, opset)
    return Path(path)
