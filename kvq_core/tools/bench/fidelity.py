"""``kvq bench fidelity``: rate-distortion of every method on three synthetic data regimes.

For head dims 64, 96 and 128 and b in {2, 3, 4}: true bits per element, key relative MSE, mean
absolute inner-product error, attention-output relative error and top-8 attention overlap,
on unit Gaussian keys, keys with outlier channels and keys with token-norm imbalance (sinks at
0.15x norm, loud tokens at 3x). Per-token key errors (mean and worst token) weigh every token
alike, which shows what per-channel codecs do to low-norm sink tokens.
A rate-matched TurboQuant row (b+1 bits on as many rotated coordinates as fit) stores no more
bits per key than OCTOPUS (equal at d=64 and 128), so the OCTOPUS gain is shown at equal storage.
head_dim 96 (Phi-3) is not a power of two: its Hadamard rotations are block diagonal (three
32-wide blocks, :mod:`kvq_core.math.hadamard`); :func:`rotation_cost` sets its errors against
head_dim 128's, which is what the weaker mixing costs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import kvq_core
from kvq_core.tools.metrics import measure
from kvq_core.tools.progress import progress
from kvq_core.tools.results import out_help, results_dir
from kvq_core.tools.synthetic import make_kv, make_queries

REGIMES = {"gaussian": "(a) unit Gaussian", "outliers": "(b) outlier channels", "sinks": "(c) token-norm imbalance"}


def key_bits(method: str, **params: Any) -> float:
    """True key bits per element of a spec, from its layout (8 KV heads, 1024 tokens)."""
    spec = kvq_core.make_spec(method, **params)
    return 8 * sum(f.nbytes for f in spec.key_layout(1, 8, 1024).values()) / (8 * 1024 * spec.head_dim)


def rate_matched_coords(head_dim: int, bits: int) -> int:
    """Most TurboQuant coordinates at bits+1 whose true key bits stay <= OCTOPUS's at ``bits``."""
    target = key_bits("octopus", head_dim=head_dim, bits=bits)
    fits = [n for n in range(head_dim + 1)
            if key_bits("turboquant", head_dim=head_dim, bits=bits, high_bits_coords=n) <= target + 1e-12]
    return max(fits)


def configs(head_dim: int, bits: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, method, params) of every method at nominal ``bits`` and head dim ``head_dim``."""
    d = head_dim
    known = {m.name for m in kvq_core.list_methods()}
    matched = rate_matched_coords(d, bits) if {"octopus", "turboquant"} <= known else 0
    rows = [
        ("oscar", "oscar", {"bits": bits}),
        ("octopus", "octopus", {"bits": bits}),
        ("turboquant", "turboquant", {"bits": bits}),
        ("turboquant rate-matched", "turboquant", {"bits": bits, "high_bits_coords": matched}),
        ("turboquant_prod", "turboquant_prod", {"bits": bits}),
        ("qjl", "qjl", {"sketch_dim": bits * d, "value_bits": bits}),
        ("polarquant", "polarquant", {"level_bits": (bits + 2, bits, bits, bits)}),
        ("kivi", "kivi", {"bits": bits}),
        ("quarot", "quarot", {"bits": bits}),
    ]
    return [(label, m, {"head_dim": d, **p}) for label, m, p in rows if m in known]


def run(head_dims: tuple[int, ...], bits_list: tuple[int, ...], tokens: int, kv_heads: int, backend: str, seed: int) -> list[dict]:
    """Measure every (regime, head_dim, bits, method) cell; one dict per cell."""
    jobs = [(r, d, b, c) for r in REGIMES for d in head_dims for b in bits_list for c in configs(d, b)]
    rows, data = [], {}
    for regime, d, b, (label, method, params) in progress(jobs, "fidelity", total=len(jobs)):
        if (regime, d) not in data:
            k, v = make_kv(regime, 1, kv_heads, tokens, d, seed=seed)
            data[regime, d] = (k, v, make_queries(1, 4 * kv_heads, 4, d, seed=seed + 1))
        k, v, q = data[regime, d]
        quantizer = kvq_core.get_quantizer(method, backend=backend, **params)
        fid = measure(quantizer, k, v, q)
        rows.append({"regime": regime, "head_dim": d, "bits": b, "label": label, "method": method,
                     "spec": quantizer.spec.to_dict(), **dataclasses.asdict(fid)})
    return rows


def markdown(rows: list[dict], setting: str) -> str:
    """One table per (regime, head_dim): methods x bits with every metric."""
    out = [f"# kvq fidelity benchmark\n\n{setting}\n",
           "Columns: true key / K+V bits per element (every stored bit), key relative MSE, mean per-token key "
           "relative error, mean |Δ q·k|, attention-output relative error, top-8 attention overlap with full precision.\n"]
    for regime, title in REGIMES.items():
        for d in sorted({r["head_dim"] for r in rows}):
            cell = [r for r in rows if r["regime"] == regime and r["head_dim"] == d]
            if not cell:
                continue
            out.append(f"\n## {title}, head_dim {d}\n")
            out.append("| b | method | key bits | K+V bits | key rel. MSE | per-token key err (mean / worst) | mean abs IP err | attn rel. err | top-8 overlap |")
            out.append("|---|---|---|---|---|---|---|---|---|")
            for r in sorted(cell, key=lambda r: (r["bits"], r["label"])):
                out.append(f"| {r['bits']} | {r['label']} | {r['key_bits']:.3f} | {r['kv_bits']:.3f} | {r['key_rel_mse']:.4g} | {r['key_token_rel_err']:.3f} / {r['key_token_rel_err_max']:.3f} | "
                           f"{r['ip_abs_err']:.4g} | {r['attn_rel_err']:.4g} | {r['top8_overlap']:.3f} |")
    return "\n".join(out) + "\n"


#: methods whose codec rotates by a (block) Hadamard matrix
ROTATING = ("oscar", "octopus", "turboquant", "turboquant_prod", "polarquant", "quarot")


def rotation_cost(rows: list[dict], head_dim: int = 96, reference: int = 128) -> str:
    """Errors at a non-power-of-two ``head_dim`` over the same method's at ``reference``, per
    regime: > 1 is what the block-diagonal rotation (and any bits difference) costs."""
    by = {(r["regime"], r["head_dim"], r["bits"], r["label"]): r for r in rows}
    out = [f"\n## Block-diagonal rotation: head_dim {head_dim} against {reference}\n",
           f"Ratios d={head_dim} / d={reference} of key relative MSE and attention-output relative error, same "
           "method and b (1.00 = no cost); key bits per element at both.\n",
           "| b | method | key bits | " + " | ".join(f"key MSE ratio {g}" for g in "abc") + " | "
           + " | ".join(f"attn err ratio {g}" for g in "abc") + " |",
           "|---|---|---|" + "---|" * 6]
    keys = sorted({(r["bits"], r["label"]) for r in rows if r["head_dim"] == head_dim and r["method"] in ROTATING})
    for b, label in keys:
        pairs = [(by.get((g, head_dim, b, label)), by.get((g, reference, b, label))) for g in REGIMES]
        if any(x is None or y is None for x, y in pairs):
            continue
        mse = " | ".join(f"{x['key_rel_mse'] / y['key_rel_mse']:.2f}" for x, y in pairs)
        att = " | ".join(f"{x['attn_rel_err'] / y['attn_rel_err']:.2f}" for x, y in pairs)
        out.append(f"| {b} | {label} | {pairs[0][0]['key_bits']:.3f} / {pairs[0][1]['key_bits']:.3f} | {mse} | {att} |")
    return "\n".join(out) + "\n"


def summary(rows: list[dict], head_dim: int = 128) -> str:
    """A compact table for docs/benchmarks.md: key MSE per regime, sink-regime per-token error and attention error."""
    out = ["| b | method | key bits | K+V bits | key MSE (a) | key MSE (b) | key MSE (c) | per-token key err (c) | worst-token key err (c) | attn err (c) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["regime"], r["bits"], r["label"]): r for r in rows if r["head_dim"] == head_dim}
    for b, label in sorted({(r["bits"], r["label"]) for r in rows if r["head_dim"] == head_dim}):
        a, o, c = (by[g, b, label] for g in ("gaussian", "outliers", "sinks"))
        out.append(f"| {b} | {label} | {a['key_bits']:.3f} | {a['kv_bits']:.3f} | {a['key_rel_mse']:.4f} | {o['key_rel_mse']:.4f} | "
                   f"{c['key_rel_mse']:.4f} | {c['key_token_rel_err']:.3f} | {c['key_token_rel_err_max']:.3f} | {c['attn_rel_err']:.3f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Key distortion against true key bits per element (log y), a panel per regime and head dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["head_dim"] for r in rows})
    fig, axes = plt.subplots(len(dims), len(REGIMES), figsize=(5 * len(REGIMES), 4 * len(dims)), squeeze=False)
    labels = sorted({r["label"] for r in rows})
    for i, d in enumerate(dims):
        for j, (regime, title) in enumerate(REGIMES.items()):
            ax = axes[i][j]
            for label in labels:
                pts = sorted((r["key_bits"], r["key_rel_mse"]) for r in rows if r["label"] == label and r["regime"] == regime and r["head_dim"] == d)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
            xs = np.linspace(1.5, max(r["key_bits"] for r in rows) + 0.2, 50)
            ax.plot(xs, 4.0 ** -xs, "k--", label="4^-b lower bound")
            ax.set_yscale("log")
            ax.set_title(f"{title}, d={d}")
            ax.set_xlabel("true key bits per element")
            ax.set_ylabel("key relative MSE")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvq bench fidelity``."""
    p = argparse.ArgumentParser(prog="kvq bench fidelity", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens and heads (under a minute)")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 96, 128])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=results_dir(), help=out_help("directory for fidelity.{md,json,png}", results_dir()))
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokens = args.tokens or (256 if args.quick else 1024)
    kv_heads = args.kv_heads or (4 if args.quick else 8)
    t0 = time.perf_counter()
    rows = run(tuple(args.head_dims), tuple(args.bits), tokens, kv_heads, args.backend, args.seed)
    setting = (f"Setting: batch 1, {kv_heads} KV heads, {tokens} tokens, {4 * kv_heads} query heads (GQA 4) x 4 query tokens, "
               f"seed {args.seed}, backend {args.backend}. Command: `kvq bench fidelity{' --quick' if args.quick else ''}`.")
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, setting)
    if {96, 128} <= set(args.head_dims):
        md += rotation_cost(rows)
    (args.out / "fidelity.md").write_text(md)
    if 128 in args.head_dims and set(REGIMES) <= {r["regime"] for r in rows}:
        (args.out / "fidelity_summary.md").write_text(summary(rows))
    (args.out / "fidelity.json").write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    if not args.no_plot:
        plot(rows, args.out / "fidelity.png")
    print(md)
    print(f"wrote {args.out}/fidelity.md, .json{'' if args.no_plot else ', .png'} in {time.perf_counter() - t0:.1f} s")
    return 0
