"""``kvq demo``: every available method on an embedded synthetic K/V set with LLM-like structure.

The data (no download) has a few massive, biased key channels per head and attention-sink
tokens at 0.15x norm next to loud tokens at 3x (kvq_core.tools.synthetic regime ``llm``).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import kvq_core
from kvq_core.tools.metrics import measure
from kvq_core.tools.progress import progress
from kvq_core.tools.synthetic import make_kv, make_queries

# Headline methods are also shown at other bit widths; everything else at its defaults.
SWEEPS: dict[str, list[dict[str, Any]]] = {
    "oscar": [{"bits": 2}, {"bits": 3}, {"bits": 4}],
    "octopus": [{"bits": 2}, {"bits": 3}, {"bits": 4}],
    "kivi": [{"bits": 2}, {"bits": 4}],
    "turboquant": [{"bits": 2}, {"bits": 3}],
}


def rows(backend: str, tokens: int, kv_heads: int, head_dim: int, seed: int) -> list[tuple[str, Any]]:
    """(label, Fidelity) for every available method and sweep point."""
    k, v = make_kv("llm", 1, kv_heads, tokens, head_dim, seed=seed)
    q = make_queries(1, 4 * kv_heads, 4, head_dim, seed=seed + 1)
    jobs = []
    for rec in kvq_core.list_methods():
        if rec.available and (backend == "auto" or backend in rec.detail):
            jobs += [(rec.name, params) for params in SWEEPS.get(rec.name, [{}])]
    out = []
    for method, params in progress(jobs, "demo", total=len(jobs)):
        quantizer = kvq_core.get_quantizer(method, backend=backend, head_dim=head_dim, **params)
        label = method + "".join(f" {k}={v}" for k, v in params.items())
        out.append((label, measure(quantizer, k, v, q)))
    return out


def table(results: list[tuple[str, Any]]) -> str:
    lines = ["| method | K+V bits/elem | key bits | key rel. MSE | value rel. MSE | attn-output rel. err | top-8 overlap |",
             "|---|---|---|---|---|---|---|"]
    for label, f in sorted(results, key=lambda r: (r[1].kv_bits, r[0])):
        lines.append(f"| {label} | {f.kv_bits:.3f} | {f.key_bits:.3f} | {f.key_rel_mse:.4f} | {f.value_rel_mse:.4f} | "
                     f"{f.attn_rel_err:.4f} | {f.top8_overlap:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvq demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="numpy", help="backend name, or auto")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = rows(args.backend, args.tokens, args.kv_heads, args.head_dim, args.seed)
    for rec in kvq_core.list_methods():
        if not rec.available:
            print(f"kvq demo: skipped {rec.name}: {rec.reason}")
    print(f"kvq demo: {args.kv_heads} KV heads x {args.tokens} tokens x head_dim {args.head_dim}, "
          f"outlier channels + sink tokens, {4 * args.kv_heads} query heads (GQA 4), backend {args.backend}\n")
    print(table(results))
    print("\nbits/elem count every stored bit: codes, scales, zero-points, norms and padding (fp16 = 16).")
    print(f"{len(results)} configurations in {time.perf_counter() - t0:.1f} s")
    return 0
