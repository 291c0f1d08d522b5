"""``kvq export onnx METHOD --graph GRAPH -o FILE``: :func:`kvq_core.integrations.onnx.export` from the shell."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvq_core.errors import ExportError


def _param(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` with VALUE read as JSON where it parses (3, 0.5, true, null), else a string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--param {text!r}: expected NAME=VALUE, e.g. bits=3")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def build_parser() -> argparse.ArgumentParser:
    from kvq_core.integrations.onnx.exporter import MIN_OPSET
    from kvq_core.integrations.onnx.graphs import GRAPHS

    p = argparse.ArgumentParser(prog="kvq export onnx", description="Write one kvq cache computation as an ONNX graph.")
    p.add_argument("method")
    p.add_argument("--graph", required=True, choices=GRAPHS)
    p.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--q-heads", type=int, default=None, help="query heads for attend (a multiple of --kv-heads; default equal)")
    p.add_argument("--layer", type=int, default=0, help="layer index (per-layer constants such as rotation signs)")
    p.add_argument("--scale", type=float, default=None, help="attend's logit scale (default 1/sqrt(head_dim))")
    p.add_argument("--opset", type=int, default=MIN_OPSET)
    p.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                   help="a method parameter, e.g. --param bits=3 (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        from kvq_core.integrations.onnx.exporter import export
    except ImportError as exc:
        print(f"kvq: error: kvq export onnx needs torch, onnx and onnxscript: pip install 'kvq-core[onnx,torch]' ({exc})",
              file=sys.stderr)
        return 2
    from kvq_core.api import get_quantizer

    args = build_parser().parse_args(argv)
    params = dict(args.param)
    if "head_dim" in params:
        raise ExportError("give the head dim with --head-dim, not --param head_dim=...")
    quantizer = get_quantizer(args.method, "numpy", layer=args.layer, head_dim=args.head_dim, **params)
    path = export(quantizer, args.output, args.graph, kv_heads=args.kv_heads, q_heads=args.q_heads,
                  scale=args.scale, opset=args.opset)
    print(f"wrote {path}: {args.graph} of {quantizer.spec.describe()} (layer {args.layer}, kv_heads {args.kv_heads}, "
          f"opset {args.opset})")
    return 0
