"""Confidence intervals for perplexity runs over windows and rotation seeds.

Windows are the independent units: runs on one window share its prefix, so a group's seeds are
averaged within each window first and the interval is a t-interval over windows (a cluster
interval). Two seed groups at the same nominal bits are compared window by window on the same
seeds (a paired design), which cancels the text's difficulty from the difference.
"""
from __future__ import annotations

import math
from typing import Any

_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """Student-t 97.5% quantile by the Cornish-Fisher expansion (Abramowitz-Stegun 26.7.5),
    within 1% from df=3 (3.159 vs exact 3.182; 2.0395 at df=31, as exact)."""
    if df < 3:
        raise ValueError(f"df={df}; the expansion needs df >= 3")
    z = _Z975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of independent values (NaN bounds for fewer than 4)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n < 4:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def window_deltas(runs: list[dict[str, Any]], labels: list[str], fp_label: str) -> dict[int, float]:
    """Per window holding fp and every one of ``labels``: NLL per scored token minus fp's,
    averaged over ``labels`` (a seed group's members)."""
    fp = {r["window"]: r for r in runs if r["label"] == fp_label}
    out: dict[int, float] = {}
    for w, ref in fp.items():
        rs = [r for r in runs if r["window"] == w and r["label"] in labels]
        if len(rs) == len(labels):
            out[w] = sum(r["nll"] / r["tokens"] - ref["nll"] / ref["tokens"] for r in rs) / len(rs)
    return out


def window_kl(runs: list[dict[str, Any]], labels: list[str]) -> dict[int, float]:
    """Per window where every one of ``labels`` has a KL: KL vs fp per token, averaged over ``labels``."""
    out: dict[int, float] = {}
    for w in {r["window"] for r in runs}:
        rs = [r for r in runs if r["window"] == w and r["label"] in labels and r.get("kl") is not None]
        if len(rs) == len(labels):
            out[w] = sum(r["kl"] / r["tokens"] for r in rs) / len(rs)
    return out


def _pct(x: float) -> float:
    """A mean NLL difference per token as a percent change of perplexity."""
    return 100.0 * math.expm1(x) if math.isfinite(x) else math.nan


def compare_groups(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Cluster intervals of each seed group's Δ PPL vs fp, and paired comparisons of the groups
    that share nominal bits (same windows, same seeds): ``{"groups": [...], "pairs": [...]}``."""
    fp_label = data.get("fp_label")
    members: dict[str, list[str]] = {}
    bits: dict[str, Any] = {}
    for row in data.get("summary", []):
        if row.get("group"):
            members.setdefault(row["group"], []).append(row["label"])
            bits[row["group"]] = row["bits"]
    if not fp_label or not members:
        return {"groups": [], "pairs": []}
    deltas = {g: window_deltas(data["runs"], labels, fp_label) for g, labels in members.items()}
    groups = []
    for g, d in deltas.items():
        if d:
            m, lo, hi = mean_interval(list(d.values()))
            groups.append({"group": g, "bits": bits[g], "seeds": len(members[g]), "windows": len(d),
                           "delta_pct": _pct(m), "lo_pct": _pct(lo), "hi_pct": _pct(hi)})
    pairs = []
    names = list(deltas)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            common = sorted(set(deltas[a]) & set(deltas[b]))
            if bits[a] != bits[b] or not common:
                continue
            m, lo, hi = mean_interval([deltas[a][w] - deltas[b][w] for w in common])
            verdict = f"{a} lower" if hi < 0 else f"{b} lower" if lo > 0 else "tie at this power"
            pair = {"a": a, "b": b, "bits": bits[a], "windows": len(common),
                    "ratio_pct": _pct(m), "lo_pct": _pct(lo), "hi_pct": _pct(hi), "verdict": verdict}
            kl_a, kl_b = window_kl(data["runs"], members[a]), window_kl(data["runs"], members[b])
            kl_common = sorted(set(kl_a) & set(kl_b) & set(common))
            if kl_common:
                pair["kl_diff"], pair["kl_lo"], pair["kl_hi"] = mean_interval([kl_a[w] - kl_b[w] for w in kl_common])
            pairs.append(pair)
    return {"groups": groups, "pairs": pairs}
