"""Tables (Markdown) and plots (PNG) for the evaluation results, and the combined summary.

``write_ppl_report`` / ``write_niah_report`` write ``<out>.md`` and ``<out>.png`` beside the
JSON; both then refresh ``eval_summary.md`` in the same folder, which joins the PPL and NIAH
results of each configuration into one table (the file docs/benchmarks.md and docs/eval.md link).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvq_core.tools.eval.stats import compare_groups

SUMMARY_MD = "eval_summary.md"


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def format_ppl_table(rows: list[dict[str, Any]]) -> str:
    head = ("| method | bits | bits/elt (incl. window) | PPL | Δ vs fp | KL vs fp (10⁻³ nats/token) | tokens/s | "
            "cache MiB | DynamicCache MiB |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        delta, kl = r.get("delta_pct"), r.get("kl")
        lines.append(
            f"| {r['label']} | {r['bits']} | {_fmt(r['bits_per_element'])} | {_fmt(r['ppl'], '.3f')} | "
            f"{'-' if delta is None else f'{delta:+.1f}%'} | {'-' if kl is None else f'{1e3 * kl:.2f}'} | "
            f"{_fmt(r['tok_s'], '.1f')} | {_mib(r['cache_bytes'])} | {_mib(r['dynamic_bytes'])} |"
        )
    return head + "\n".join(lines)


def format_group_table(groups: list[dict[str, Any]]) -> str:
    """One row per seed group: Δ vs fp as mean ± sd over rotation seeds, its range, and mean KL."""
    head = ("| configuration | bits | bits/elt | seeds | Δ vs fp, mean ± sd | Δ per seed | KL mean (10⁻³ nats/token) |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for g in groups:
        kl = g.get("kl_mean")
        lines.append(
            f"| {g['group']} | {g['bits']} | {_fmt(g['bits_per_element'])} | {g['seeds']} | "
            f"{g['delta_mean']:+.2f}% ± {_fmt(g['delta_sd'])} | {' / '.join(f'{d:+.2f}' for d in g['deltas'])} | "
            f"{'-' if kl is None else f'{1e3 * kl:.2f}'} |"
        )
    return head + "\n".join(lines)


def format_intervals(comparison: dict[str, list[dict[str, Any]]]) -> str:
    """Cluster intervals per seed group and the paired comparisons of :func:`compare_groups`."""
    def ci(r: dict[str, Any]) -> str:
        return "-" if math.isnan(r["lo_pct"]) else f"{r['lo_pct']:+.2f} .. {r['hi_pct']:+.2f}"

    lines = ["| configuration | bits | seeds | windows | Δ PPL vs fp, pooled | 95% interval (windows as clusters) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {g['group']} | {g['bits']} | {g['seeds']} | {g['windows']} | {g['delta_pct']:+.2f}% | {ci(g)} |"
              for g in comparison["groups"]]
    if comparison["pairs"]:
        def kl(p: dict[str, Any]) -> str:
            if "kl_diff" not in p:
                return "-"
            bounds = "" if math.isnan(p["kl_lo"]) else f" ({1e3 * p['kl_lo']:+.2f} .. {1e3 * p['kl_hi']:+.2f})"
            return f"{1e3 * p['kl_diff']:+.2f}{bounds}"

        lines += ["", "| A | B | bits | windows | PPL of A relative to B | 95% interval | verdict | "
                  "KL of A minus B, 10⁻³ nats/token (95%) |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p['a']} | {p['b']} | {p['bits']} | {p['windows']} | {p['ratio_pct']:+.2f}% | {ci(p)} | "
                  f"{p['verdict']} | {kl(p)} |" for p in comparison["pairs"]]
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _family(label: str) -> str:
    return label.split("[")[0].rsplit("-", 1)[0] if "[" not in label.split("-")[0] else label.split("[")[0]


def plot_ppl(rows: list[dict[str, Any]], png: Path, title: str, groups: list[dict[str, Any]] | None = None) -> None:
    """ΔPPL (%) and KL vs fp against true bits per element, one point per configuration.

    Configurations run over several rotation seeds (``groups``) are drawn once, at the seed
    mean, with a bar spanning the seeds' range."""
    plt = _plt()
    grouped = {g["group"]: g for g in groups or []}
    points = []  # (label, bits, delta, delta_lo, delta_hi, kl, kl_lo, kl_hi)
    for r in rows:
        if r.get("delta_pct") is None or r["label"] == "fp" or r.get("group") in grouped:
            continue
        points.append((r["label"], r["bits_per_element"], r["delta_pct"], None, None, r.get("kl"), None, None))
    for name, g in grouped.items():
        kls = [r["kl"] for r in rows if r.get("group") == name and r.get("kl") is not None]
        points.append((f"{name} ({g['seeds']} seeds)", g["bits_per_element"], g["delta_mean"], g["delta_min"],
                       g["delta_max"], g.get("kl_mean"), min(kls) if kls else None, max(kls) if kls else None))
    with_kl = any(p[5] is not None for p in points)
    fig, axes = plt.subplots(1, 2 if with_kl else 1, figsize=(13 if with_kl else 8, 5.5), squeeze=False)
    families = sorted({_family(p[0]) for p in points})
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(families)}
    panels = [(axes[0][0], 2, "PPL increase vs fp (%) [log]", 0.05)]
    if with_kl:
        panels.append((axes[0][1], 5, "KL(fp || cache), 10⁻³ nats per token [log]", 1e-3))
    for ax, at, ylabel, floor in panels:
        seen = set()
        for p in points:
            if p[at] is None:
                continue
            scale = 1e3 if at == 5 else 1.0
            y, fam = max(scale * p[at], floor), _family(p[0])
            ax.scatter([p[1]], [y], s=30, color=colors[fam], label=None if fam in seen else fam)
            if p[at + 1] is not None:
                lo, hi = max(scale * p[at + 1], floor), max(scale * p[at + 2], floor)
                ax.vlines(p[1], lo, hi, color=colors[fam], linewidth=1.2)
            seen.add(fam)
            ax.annotate(p[0], (p[1], y), fontsize=6.5, xytext=(3, 3), textcoords="offset points")
        ax.axvline(3.2, color="grey", linestyle="--", linewidth=0.8)
        ax.legend(fontsize=7, loc="upper right")
        ax.set_yscale("log")
        ax.set_xlabel("true bits per element (codes + metadata + exact window at 16 bits)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title + (" — bars: range over rotation seeds" if grouped else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def write_ppl_report(data: dict[str, Any], out_json: Path) -> None:
    out_json = Path(out_json)
    rows = data.get("summary", [])
    proto = data["protocol"]
    title = (f"{data['model']['name']}: PPL, {len(proto['windows'])} windows x ({proto['prefix']} prefix "
             f"+ {proto['score']} scored)")
    md = [f"# Perplexity: {data['model']['name']}", "",
          f"Text: `{Path(data['text']).name}` ({data['text_tokens']} tokens); windows {proto['windows']} "
          f"({'tuning' if proto.get('tuning') else 'report'}); prefix {proto['prefix']} tokens through the cache, "
          f"{proto['score']} tokens scored in teacher-forced chunks ({proto['chunk']}); attention `{proto['attn']}`; "
          f"kvq backend `{proto['backend']}`.", "", format_ppl_table(rows), "",
          f"bits/elt: stored bits per K/V element at {proto['prefix'] + proto['score']} tokens with the exact window "
          "full: the packed rate measured from the blocks the cache holds (codes, scales, zero-points, norms, "
          "padding) plus the window (and any full-precision layer) at 16 bits. cache MiB: bytes held after the last "
          "chunk (packed blocks + exact window in the model dtype), not counting kvq's decoded-history copy used by "
          "dequant-mode attention. tokens/s: scored tokens over scoring time on a shared 2-core CPU (indicative).",
          "", "KL vs fp: mean over scored tokens of KL(fp next-token distribution || this cache's), on the same "
          "windows; it is never negative and varies far less between runs than Δ PPL.",
          "", f"![ppl]({out_json.with_suffix('.png').name})", ""]
    if data.get("groups"):
        md[-2:-2] = ["## Across rotation seeds", "",
                     f"Each configuration run once per rotation seed ({proto.get('seeds')}); Δ vs fp pooled over "
                     "the windows for each seed, then mean ± sd over seeds.", "",
                     format_group_table(data["groups"]), ""]
        comparison = compare_groups(data)
        if comparison["groups"]:
            md[-2:-2] = ["### Intervals over windows", "",
                         "Each window's Δ NLL per token against fp, averaged over the seeds, then a 95% "
                         "t-interval over windows (runs on one window share its prefix, so windows are the "
                         "independent units). Pairs: groups at the same nominal bits compared window by "
                         "window on the same seeds; the verdict needs the interval to exclude 0 (needs "
                         "at least 4 windows).", "", format_intervals(comparison), ""]
    out_json.with_suffix(".md").write_text("\n".join(md))
    if rows:
        plot_ppl(rows, out_json.with_suffix(".png"), title, data.get("groups"))
    write_summary(out_json.parent)


# -- NIAH -----------------------------------------------------------------------------------
def niah_cells(data: dict[str, Any], label: str, task: str) -> dict[tuple[int, float], list[bool]]:
    cells: dict[tuple[int, float], list[bool]] = {}
    for r in data["runs"]:
        if r["label"] == label and r["task"] == task:
            cells.setdefault((r["context"], r["depth"]), []).append(bool(r["correct"]))
    return cells


def recall(data: dict[str, Any], label: str, task: str | None = None, context: int | None = None) -> float | None:
    hits = [bool(r["correct"]) for r in data["runs"] if r["label"] == label
            and (task is None or r["task"] == task) and (context is None or r["context"] == context)]
    return sum(hits) / len(hits) if hits else None


def format_niah_table(data: dict[str, Any]) -> str:
    tasks, contexts = data["protocol"]["tasks"], data["protocol"]["contexts"]
    cols = [f"{t} {c // 1024}k" if c % 1024 == 0 else f"{t} {c}" for t in tasks for c in contexts]
    head = "| method | bits | " + " | ".join(cols) + " | all |\n|---|---|" + "---|" * (len(cols) + 1) + "\n"
    lines = []
    for cfg in data["configs"]:
        vals = [recall(data, cfg["label"], t, c) for t in tasks for c in contexts]
        lines.append(f"| {cfg['label']} | {cfg['bits']} | " + " | ".join(_fmt(v) for v in vals)
                     + f" | {_fmt(recall(data, cfg['label']))} |")
    return head + "\n".join(lines)


def _first_number(text: str) -> str | None:
    import re

    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar (sign) test on the discordant prompts: P(a split this uneven | no effect)."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def niah_vs_fp(data: dict[str, Any], fp_label: str = "fp") -> list[dict[str, Any]]:
    """Prompt-by-prompt comparison with the fp cache, per configuration and task, over every prompt both ran:
    recall of each, prompts lost (fp right, this wrong) and gained, same first number as fp, McNemar p."""
    key = ("task", "context", "depth", "trial")
    fp = {tuple(r[k] for k in key): r for r in data["runs"] if r["label"] == fp_label}
    rows = []
    for cfg in data["configs"]:
        if cfg["label"] == fp_label:
            continue
        for task in data["protocol"]["tasks"]:
            pairs = [(fp[k], r) for r in data["runs"] if r["label"] == cfg["label"] and r["task"] == task
                     and (k := tuple(r[x] for x in key)) in fp]
            if not pairs:
                continue
            lost = sum(a["correct"] and not b["correct"] for a, b in pairs)
            gained = sum(b["correct"] and not a["correct"] for a, b in pairs)
            rows.append({"label": cfg["label"], "task": task, "n": len(pairs),
                         "fp_recall": sum(a["correct"] for a, _ in pairs) / len(pairs),
                         "recall": sum(b["correct"] for _, b in pairs) / len(pairs), "lost": lost, "gained": gained,
                         "same_answer": sum(_first_number(a["reply"]) == _first_number(b["reply"]) for a, b in pairs)
                         / len(pairs), "p": mcnemar_p(lost, gained)})
    return rows


def format_niah_vs_fp(rows: list[dict[str, Any]]) -> str:
    head = ("| method | task | prompts | recall (fp) | lost / gained vs fp | same answer as fp | McNemar p |\n"
            "|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['label']} | {r['task']} | {r['n']} | {r['recall']:.2f} ({r['fp_recall']:.2f}) | {r['lost']} / {r['gained']} | "
        f"{r['same_answer']:.2f} | {r['p']:.2f} |" for r in rows)


def plot_niah(data: dict[str, Any], png: Path) -> None:
    """A recall heatmap (depth x context) per configuration and task."""
    import numpy as np

    plt = _plt()
    tasks, contexts, depths = data["protocol"]["tasks"], data["protocol"]["contexts"], data["protocol"]["depths"]
    labels = [c["label"] for c in data["configs"] if any(r["label"] == c["label"] for r in data["runs"])]
    if not labels:
        return
    ncols = min(6, len(labels))
    per_task = -(-len(labels) // ncols)
    fig, axes = plt.subplots(per_task * len(tasks), ncols, figsize=(2.0 * ncols + 0.6, 2.0 * per_task * len(tasks) + 0.8),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ti, task in enumerate(tasks):
        for li, label in enumerate(labels):
            ax = axes[ti * per_task + li // ncols][li % ncols]
            ax.axis("on")
            cells = niah_cells(data, label, task)
            grid = np.full((len(depths), len(contexts)), np.nan)
            for (c, d), hits in cells.items():
                if c in contexts and d in depths:
                    grid[depths.index(d), contexts.index(c)] = sum(hits) / len(hits)
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i in range(len(depths)):
                for j in range(len(contexts)):
                    if not np.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2g}", ha="center", va="center", fontsize=6)
            ax.set_xticks(range(len(contexts)), [f"{c / 1024:g}k" for c in contexts], fontsize=6)
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=6)
            ax.set_title(f"{task}: {label}", fontsize=6)
            if li % ncols == 0:
                ax.set_ylabel("needle depth", fontsize=6)
    fig.suptitle(f"{data['model']['name']}: needle recall (depth x context)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def write_niah_report(data: dict[str, Any], out_json: Path) -> None:
    out_json = Path(out_json)
    proto = data["protocol"]
    md = [f"# Needle in a haystack: {data['model']['name']}", "",
          f"Tasks {proto['tasks']}, contexts {proto['contexts']} tokens, needle depths {proto['depths']}, "
          f"{proto['trials']} trial(s) per cell, haystack `{Path(str(proto['haystack'])).name}`. The context (instructions + haystack "
          "with needles) is prefilled through the cache; the question is then fed as a chunk attending to the cache "
          f"and the answer decoded greedily ({proto['answer_tokens']} tokens). A cell is correct when the first "
          "number in the answer is the needle's.", "", format_niah_table(data), ""]
    vs = niah_vs_fp(data)
    if vs:
        md += ["Against the fp cache, prompt by prompt (lost: fp answers and this cache does not; gained: the reverse; "
               "McNemar p: exact two-sided test of lost vs gained — a small p means the difference is not chance):",
               "", format_niah_vs_fp(vs), ""]
    md += [f"![niah]({out_json.with_suffix('.png').name})", ""]
    out_json.with_suffix(".md").write_text("\n".join(md))
    plot_niah(data, out_json.with_suffix(".png"))
    write_summary(out_json.parent)


# -- combined summary -------------------------------------------------------------------------
def write_summary(folder: Path, ppl_name: str = "eval_ppl.json", niah_name: str = "eval_niah.json",
                  niah_2k_name: str = "eval_niah_2k.json", seeds_name: str = "eval_ppl_seeds.json") -> Path | None:
    """Join PPL and NIAH results per configuration label into ``eval_summary.md``.

    The per-task recall columns at 2k come from ``eval_niah_2k.json`` (more trials) when present;
    the seed study (``eval_ppl_seeds.json``), when present, is appended as its own table. A folder
    holding neither ``ppl_name`` nor ``niah_name`` (results written under other names) gets no
    summary: it would be an empty table. Returns the summary's path, or None.
    """
    folder = Path(folder)
    ppl = json.loads((folder / ppl_name).read_text()) if (folder / ppl_name).exists() else None
    niah = json.loads((folder / niah_name).read_text()) if (folder / niah_name).exists() else None
    if ppl is None and niah is None:
        return None
    niah2k = json.loads((folder / niah_2k_name).read_text()) if (folder / niah_2k_name).exists() else None
    rows: dict[str, dict[str, Any]] = {}
    for r in (ppl or {}).get("summary", []):
        rows[r["label"]] = dict(r)
    ctx2k = None
    if niah:
        contexts = niah["protocol"]["contexts"]
        ctx2k = 2048 if 2048 in contexts else contexts[len(contexts) // 2]
        src = niah2k if niah2k and ctx2k in niah2k["protocol"]["contexts"] else niah
        n_at = len(src["protocol"]["depths"]) * src["protocol"]["trials"]
        for cfg in niah["configs"]:
            row = rows.setdefault(cfg["label"], {"label": cfg["label"], "bits": cfg["bits"]})
            row["recall_all"] = recall(niah, cfg["label"])
            for t in niah["protocol"]["tasks"]:
                row[f"recall_{t}"] = recall(src, cfg["label"], t, ctx2k)
    tasks = niah["protocol"]["tasks"] if niah else []
    head = ["method", "bits", "true bits/elt", "PPL", "Δ vs fp", "KL vs fp (10⁻³)"] + \
        [f"{t} @{ctx2k} (n={n_at})" for t in tasks] + \
        (["recall (all)"] if niah else []) + ["tokens/s", "cache MiB", "DynamicCache MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows.values():
        delta = r.get("delta_pct")
        cells = [r["label"], str(r.get("bits", "-")), _fmt(r.get("bits_per_element")), _fmt(r.get("ppl"), ".3f"),
                 "-" if delta is None else f"{delta:+.1f}%", "-" if r.get("kl") is None else f"{1e3 * r['kl']:.1f}"]
        cells += [_fmt(r.get(f"recall_{t}")) for t in tasks] + ([_fmt(r.get("recall_all"))] if niah else [])
        cells += [_fmt(r.get("tok_s"), ".1f"), _mib(r.get("cache_bytes")), _mib(r.get("dynamic_bytes"))]
        lines.append("| " + " | ".join(cells) + " |")
    md = ["# kvq evaluation summary", ""]
    if ppl:
        p = ppl["protocol"]
        md.append(f"Model {ppl['model']['name']}; PPL on `{Path(ppl['text']).name}`, {len(p['windows'])} windows of "
                  f"{p['prefix']} prefix tokens through the cache + {p['score']} scored tokens.")
    if niah:
        md.append(f"NIAH: {niah['protocol']['tasks']} at contexts {niah['protocol']['contexts']}, depths "
                  f"{niah['protocol']['depths']}; the per-task recall columns are at {ctx2k} tokens (n prompts per "
                  "task), 'recall (all)' over every context, depth and task of the main NIAH run.")
    md += ["", *lines, ""]
    seeds = json.loads((folder / seeds_name).read_text()) if (folder / seeds_name).exists() else None
    if seeds and seeds.get("groups"):
        md += ["Rotation codecs over sign seeds " + str(seeds["protocol"].get("seeds")) + " on the same windows "
               "(Δ vs fp as mean ± sd over seeds; KL vs fp in 10⁻³ nats per token; "
               f"[details]({Path(seeds_name).with_suffix('.md').name})):", "", format_group_table(seeds["groups"]), ""]
    details = ([f"[perplexity]({Path(ppl_name).with_suffix('.md').name})"] if ppl else []) + \
        ([f"[needle in a haystack]({Path(niah_name).with_suffix('.md').name})"] if niah else []) + \
        ([f"[needle at 2k, more trials]({Path(niah_2k_name).with_suffix('.md').name})"] if niah2k else [])
    md += ["Details: " + ", ".join(details)
           + "; protocol and findings in [docs/eval.md](../../docs/eval.md).", ""]
    path = folder / SUMMARY_MD
    path.write_text("\n".join(md))
    return path
