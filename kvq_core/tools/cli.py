"""The ``kvq`` command line: list, info, demo, warmup, tune, bench, eval and export."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys

import kvq_core
from kvq_core.errors import KVQError

# subcommand -> module with main(argv) (imported lazily: the bench/eval extras may be missing)
FORWARDED = {
    ("bench", "fidelity"): "kvq_core.tools.bench.fidelity",
    ("bench", "speed"): "kvq_core.tools.bench.speed",
    ("bench", "decode"): "kvq_core.tools.bench.decode",
    ("eval", "ppl"): "kvq_core.tools.eval.ppl",
    ("eval", "niah"): "kvq_core.tools.eval.niah",
    ("eval", "frontier"): "kvq_core.tools.eval.frontier",
    ("export", "onnx"): "kvq_core.integrations.onnx.cli",
}


def _cmd_list(args: argparse.Namespace) -> int:
    methods, backends, plugins = kvq_core.list_methods(), kvq_core.list_backends(), kvq_core.list_plugins()
    if args.json:
        print(json.dumps({"methods": [m.as_dict() for m in methods], "backends": [b.as_dict() for b in backends],
                          "plugins": [p.as_dict() for p in plugins]}, indent=1))
        return 0
    print("methods:")
    for m in methods:
        state = "available" if m.available else f"unavailable ({m.reason})"
        print(f"  {m.name:16s} {state}; backends: {', '.join(m.detail) or '-'}; from {m.origin}")
    print("backends:")
    for b in backends:
        state = f"serves {', '.join(b.detail) or 'nothing'}" if b.available else f"unavailable: {b.reason}"
        print(f"  {b.name:16s} {state}; from {b.origin}")
        for problem in b.problems:
            print(f"  {'':16s} cannot serve {problem}")
    print("plugins:")
    for p in plugins:
        state = "loaded" if p.available else f"failed: {p.reason}"
        print(f"  {p.name:16s} {state}; {p.origin}")
        if p.detail:
            print(f"  {'':16s} registers {', '.join(p.detail)}")
        for problem in p.problems:
            print(f"  {'':16s} skipped {problem}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    info = kvq_core.registry.method_info(args.method)
    spec = info.spec_cls()
    params = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    bits = {}
    for d in (64, 128):
        s = spec.replace(head_dim=d)
        layout_k, layout_v = s.key_layout(1, 8, 4096), s.value_layout(1, 8, 4096)
        n = 8 * 4096 * d
        bits[d] = (8 * sum(f.nbytes for f in layout_k.values()) / n, 8 * sum(f.nbytes for f in layout_v.values()) / n)
    if args.json:
        print(json.dumps({"method": info.name, "summary": info.summary, "defaults": params,
                          "default_residual": spec.default_residual,
                          "bits_per_element": {str(d): {"keys": k, "values": v} for d, (k, v) in bits.items()}}, indent=1, default=str))
        return 0
    print(f"{info.name}: {info.summary}")
    print("parameters (defaults):")
    for name, value in params.items():
        print(f"  {name} = {value!r}")
    print(f"default full-precision window for a cache: {spec.default_residual} tokens")
    print("true bits per element at defaults (8 KV heads, 4096 tokens):")
    for d, (k, v) in bits.items():
        print(f"  head_dim {d:3d}: keys {k:.3f}, values {v:.3f}, K+V {(k + v) / 2:.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq", description="Compressed KV caches: OScaR, OCTOPUS and baselines.")
    p.add_argument("--version", action="version", version=f"{kvq_core.registry.KVQ_DIST} {kvq_core.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("list", help="methods and backends, with availability and origin")
    lp.add_argument("--json", action="store_true")
    ip = sub.add_parser("info", help="a method's parameters, defaults and bits per element")
    ip.add_argument("method")
    ip.add_argument("--json", action="store_true")
    sub.add_parser("demo", help="every method on embedded synthetic K/V (add --help for options)", add_help=False)
    sub.add_parser("warmup", help="compile the kernels a model's cache needs, once (add --help for options)",
                   add_help=False)
    sub.add_parser("tune", help="search a cache plan under a true-bits budget (add --help for options)", add_help=False)
    for group, names in (("bench", ("fidelity", "speed", "decode")), ("eval", ("ppl", "niah", "frontier")), ("export", ("onnx",))):
        gp = sub.add_parser(group, help=f"{group}: {', '.join(names)} (add --help after the name)")
        gp.add_argument("name", choices=names)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["bench"], ["eval"], ["tune"]):  # they measure the backend they name: it compiles before use
        os.environ.setdefault("KVQ_COMPILE", "foreground")
    try:
        if argv[:1] == ["demo"]:
            from kvq_core.tools.demo import main as demo_main

            return demo_main(argv[1:])
        if argv[:1] == ["tune"]:
            from kvq_core.tools.tune import main as tune_main

            return tune_main(argv[1:])
        if argv[:1] == ["warmup"]:
            from kvq_core.tools.warmup import main as warmup_main

            return warmup_main(argv[1:])
        if len(argv) >= 2 and tuple(argv[:2]) in FORWARDED:
            return importlib.import_module(FORWARDED[tuple(argv[:2])]).main(argv[2:])
        args = build_parser().parse_args(argv)
        return {"list": _cmd_list, "info": _cmd_info}[args.command](args)
    except KVQError as exc:
        print(f"kvq: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:  # missing model or eval text: the message names the flag to pass
        print(f"kvq: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"kvq: error: {exc}; install the extra it needs, e.g. {kvq_core.registry.install_hint('bench,hf,torch')}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
