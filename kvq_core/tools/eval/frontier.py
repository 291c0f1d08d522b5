"""``kvq eval frontier``: quality against true bits, built-in codecs and tuned plans, in one table
and one figure.

It joins a ``kvq eval ppl`` result (PPL, Δ vs fp and KL vs fp per configuration, true bits per
element at its context) and a ``kvq eval niah`` result (passkey and multikey recall at
``--context``) by configuration label, and writes ``frontier.json``, ``frontier.md`` (the table,
with the goal column) and ``frontier.png`` (Δ PPL, KL and recall against true bits). Seed groups
of the ppl run (``--seeds``) give the spread of randomised codecs. Produce the inputs on text the
plans were not tuned on, e.g.::

    kvq eval ppl --text-part evaluation --first-window 0 --methods fp turboquant:bits=2,residual=32 \\
        plan:path=bench/results/plans/smollm2-2k-2.5.json,label=tuned-2.5 --out bench/results/frontier/ppl.json
    kvq eval niah --text-part evaluation --contexts 2048 --methods fp ... --out bench/results/frontier/niah.json
    kvq eval frontier --ppl bench/results/frontier/ppl.json --niah bench/results/frontier/niah.json

Several ``--ppl`` (``--niah``) files of the same windows (prompts) are joined, e.g. built-in codecs
and plans evaluated in separate runs.

The goal: at most ``--goal-bits`` true bits with Δ PPL at most ``--goal-ppl`` %, KL at
most ``--goal-kl`` nats per token and recall within ``--goal-recall`` of fp.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from kvq_core.tools.results import out_help, results_dir

OUT_NAME = "frontier.json"
MARKERS = "osD^v<>pPXh"  # per family, so that a colour the cycle repeats is still told apart; plans are stars


def rows(ppl: dict[str, Any], niah: dict[str, Any] | None, context: int) -> list[dict[str, Any]]:
    """One row per ppl configuration (seed copies folded into their group): bits, PPL, Δ, KL, recall."""
    kinds = {c["label"]: c for c in ppl["configs"]}
    groups = {g["group"]: g for g in ppl.get("groups", [])}
    out, seen = [], set()
    for r in ppl["summary"]:
        name = r.get("group") or r["label"]
        if name in seen:
            continue
        seen.add(name)
        members = [x for x in ppl["summary"] if (x.get("group") or x["label"]) == name]
        cfg = kinds[members[0]["label"]]
        row = {"label": name, "kind": cfg["kind"], "bits": cfg["bits"], "true_bits": members[0]["bits_per_element"],
               "ppl": sum(x["ppl"] for x in members) / len(members),
               "delta_pct": _mean([x.get("delta_pct") for x in members]), "kl": _mean([x.get("kl") for x in members]),
               "seeds": len(members), "windows": min(x.get("windows", 0) for x in members)}
        if name in groups:
            g = groups[name]
            row["delta_sd"] = g["delta_sd"]
            row["kl_sd"] = _sd([x["kl"] for x in members if x.get("kl") is not None])
        if niah is not None:
            labels = [x["label"] for x in members] + [name]  # a niah run without --seeds names the group
            for task in ("passkey", "multikey"):
                hits = [bool(x["correct"]) for x in niah["runs"] if x["label"] in labels and x["task"] == task
                        and x["context"] == context]
                row[task] = sum(hits) / len(hits) if hits else None
                row[f"{task}_n"] = len(hits)
            both = [row[t] for t in ("passkey", "multikey") if row[t] is not None]
            row["recall"] = sum(both) / len(both) if both else None
        out.append(row)
    return out


def merge(results: list[dict[str, Any]], rows_key: str) -> dict[str, Any]:
    """One result from several runs of one protocol: the first run's header, every run's
    configurations and ``rows_key`` rows (a label already seen in an earlier run is skipped).
    Refused when the runs' windows or prompts differ."""
    first = results[0]
    keep = ("windows", "prefix", "score") if rows_key == "summary" else ("tasks", "depths", "trials", "seed", "haystack")
    for r in results[1:]:
        diff = [k for k in keep if r["protocol"].get(k) != first["protocol"].get(k)]
        if diff:
            raise ValueError(f"results of different protocols cannot be joined: {', '.join(diff)} differ")
    out = {**first, "configs": [], rows_key: [], "groups": []}
    seen: set[str] = set()
    for r in results:
        new = {c["label"] for c in r["configs"]} - seen
        out["configs"] += [c for c in r["configs"] if c["label"] in new]
        out[rows_key] += [x for x in r[rows_key] if x["label"] in new]
        named = {c.get("group") for c in r["configs"] if c["label"] in new}  # seed copies name their group
        out["groups"] += [g for g in r.get("groups", []) if g["group"] in new | named]
        seen |= new
    return out


def _mean(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _sd(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def meets_goal(row: dict[str, Any], fp_recall: float | None, goal: dict[str, float]) -> bool | None:
    """Whether ``row`` meets the goal; None when a number it needs is missing."""
    need = (row.get("delta_pct"), row.get("kl"), row.get("recall"), fp_recall)
    if any(x is None for x in need):
        return None
    return (row["true_bits"] <= goal["bits"] + 1e-9 and row["delta_pct"] <= goal["ppl"] and row["kl"] <= goal["kl"]
            and row["recall"] >= fp_recall - goal["recall"] - 1e-9)


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(table: list[dict[str, Any]], goal: dict[str, float], context: int) -> str:
    """The Markdown frontier table, sorted by true bits."""
    fp = next((r for r in table if r["kind"] == "fp"), None)
    fp_recall = fp.get("recall") if fp else None
    lines = [f"| configuration | kind | true bits/elt | PPL | Δ vs fp | KL vs fp (nats/token) | passkey @{context} | "
             f"multikey @{context} | recall @{context} | PPL windows | goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(table, key=lambda r: (-r["true_bits"] if r["kind"] == "fp" else r["true_bits"])):
        delta = _f(r.get("delta_pct"), "+.1f") + "%" if r.get("delta_pct") is not None else "-"
        if r.get("delta_sd") is not None:
            delta += f" ± {r['delta_sd']:.1f} ({r['seeds']} seeds)"
        kl = _f(r.get("kl"), ".4f") + (f" ± {r['kl_sd']:.4f}" if r.get("kl_sd") is not None else "")
        ok = meets_goal(r, fp_recall, goal) if r["kind"] != "fp" else None
        rec = [(_f(r.get(t), ".2f") + (f" (n={r[t + '_n']})" if r.get(t + "_n") else "")) for t in ("passkey", "multikey")]
        lines.append(f"| {r['label']} | {'tuned plan' if r['kind'] == 'plan' else r['kind']} | {r['true_bits']:.2f} | "
                     f"{r['ppl']:.3f} | {delta} | {kl} | {rec[0]} | {rec[1]} | {_f(r.get('recall'), '.2f')} | "
                     f"{r.get('windows', '-')} | {'-' if ok is None else ('yes' if ok else 'no')} |")
    return "\n".join(lines)


def family(label: str) -> str:
    """The line a row belongs to: its label without the bit width (``turboquant-2[residual=32]`` ->
    ``turboquant[residual=32]``, ``tuned-2.5-mixed`` -> ``tuned-mixed``); a label without one
    (``polarquant-paper``, ``kvq-best``) is its own family."""
    m = re.fullmatch(r"(.*?)-\d+(?:\.\d+)?(-[A-Za-z]+)?(\[.*\])?", label)
    return label if m is None else m.group(1) + (m.group(2) or "") + (m.group(3) or "")


def plot(table: list[dict[str, Any]], png: Path, goal: dict[str, float], title: str) -> None:
    """Three panels against true bits: Δ PPL, KL and recall, one line per :func:`family`; tuned
    plans as stars, the goal shaded."""
    from kvq_core.tools.eval.report import _plt

    plt = _plt()
    fp = next((r for r in table if r["kind"] == "fp"), None)
    panels = [("delta_pct", "Δ PPL vs fp (%)", goal["ppl"]), ("kl", "KL vs fp (nats/token)", goal["kl"]),
              ("recall", "passkey+multikey recall", None)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    families: dict[str, list[dict[str, Any]]] = {}
    for r in table:
        if r["kind"] not in ("fp",):
            families.setdefault(family(r["label"]), []).append(r)
    for ax, (key, name, limit) in zip(axes, panels):
        for n, (fam, rs) in enumerate(sorted(families.items())):
            rs = sorted((r for r in rs if r.get(key) is not None), key=lambda r: r["true_bits"])
            if not rs:
                continue
            star = rs[0]["kind"] == "plan"
            ax.plot([r["true_bits"] for r in rs], [r[key] for r in rs], marker="*" if star else MARKERS[n % len(MARKERS)],
                    markersize=12 if star else 5, linestyle="-" if not star else ":", label=fam,
                    color=f"C{n % 10}" if n < 10 else plt.cm.tab20(n % 20))
            for r in rs:
                sd = r.get("delta_sd" if key == "delta_pct" else "kl_sd" if key == "kl" else "")
                if sd:
                    ax.errorbar([r["true_bits"]], [r[key]], yerr=[sd], color="gray", capsize=2, linewidth=0.8)
        if key == "recall" and fp is not None and fp.get("recall") is not None:
            ax.axhline(fp["recall"], color="black", linestyle="--", linewidth=0.8, label="fp")
            limit = fp["recall"] - goal["recall"]
            ax.axhspan(limit, 1.02, xmax=_frac(ax, goal["bits"]), color="green", alpha=0.08)
        elif limit is not None:
            ax.axhspan(0, limit, color="green", alpha=0.08)
            ax.set_yscale("symlog", linthresh=limit)
        ax.axvline(goal["bits"], color="green", linestyle=":", linewidth=0.8)
        ax.set_xlabel("true bits per element (everything stored)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _frac(ax: Any, x: float) -> float:
    lo, hi = ax.get_xlim()
    return max(0.0, min(1.0, (x - lo) / (hi - lo))) if hi > lo else 1.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq eval frontier", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--ppl", nargs="+", required=True,
                   help="kvq eval ppl results JSON(s) on the same windows (a label's first appearance counts)")
    p.add_argument("--niah", nargs="+", default=None,
                   help="kvq eval niah results JSON(s) with the same prompts (recall at --context)")
    p.add_argument("--context", type=int, default=2048, help="context of the recall columns (default 2048)")
    p.add_argument("--goal-bits", type=float, default=2.5)
    p.add_argument("--goal-ppl", type=float, default=5.0, help="Δ PPL in percent (default 5)")
    p.add_argument("--goal-kl", type=float, default=0.05, help="nats per token (default 0.05)")
    p.add_argument("--goal-recall", type=float, default=0.05, help="recall below fp (default 0.05)")
    default = str(results_dir() / OUT_NAME)
    p.add_argument("--out", default=default, help=out_help("frontier JSON, with .md and .png beside it", default))
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """``kvq eval frontier``: join the results, write the table and the figure."""
    args = build_parser().parse_args(argv)
    ppl = merge([json.loads(Path(p).read_text(encoding="utf-8")) for p in args.ppl], "summary")
    niah = merge([json.loads(Path(p).read_text(encoding="utf-8")) for p in args.niah], "runs") if args.niah else None
    goal = {"bits": args.goal_bits, "ppl": args.goal_ppl, "kl": args.goal_kl, "recall": args.goal_recall}
    table = rows(ppl, niah, args.context)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    proto = ppl["protocol"]
    source = (f"model {ppl['model']['name']}; PPL/KL on {ppl['text']} ({len(proto['windows'])} windows of "
              f"{proto['prefix']} prefix + {proto['score']} scored tokens)")
    if niah is not None:
        source += f"; recall at {args.context} tokens on {niah['protocol']['haystack']}"
    md = (f"# Quality against true bits\n\n{source}. True bits per element count everything stored at "
          f"{proto['prefix'] + proto['score']} tokens (codes, norms, scales, exact window at 16 bits). Goal: <= "
          f"{args.goal_bits} bits with Δ PPL <= +{args.goal_ppl}%, KL <= {args.goal_kl} nats/token, recall within "
          f"{args.goal_recall} of fp.\n\n" + format_table(table, goal, args.context) + "\n")
    out.write_text(json.dumps({"goal": goal, "source": source, "rows": table}, indent=1), encoding="utf-8")
    out.with_suffix(".md").write_text(md + (f"\n![frontier]({out.with_suffix('.png').name})\n" if not args.no_plot else ""),
                                      encoding="utf-8")
    if not args.no_plot:
        title = (f"{ppl['model']['name']}: PPL/KL on {len(proto['windows'])} windows of {proto['prefix']}+{proto['score']} "
                 f"tokens" + (f", recall at {args.context} tokens" if niah is not None else "") + " (text: see frontier.md)")
        plot(table, out.with_suffix(".png"), goal, title)
    print(format_table(table, goal, args.context))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
