"""Intervals over windows and paired comparisons of seed groups (kvq_core.tools.eval.stats)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvq_core.tools.eval.stats import compare_groups, mean_interval, t_quantile_975


@pytest.mark.parametrize("df, exact", [(3, 3.1824), (5, 2.5706), (10, 2.2281), (31, 2.0395), (120, 1.9799)])
def test_t_quantile_matches_the_table(df, exact):
    assert t_quantile_975(df) == pytest.approx(exact, rel=0.01)


def test_t_quantile_refuses_tiny_df():
    with pytest.raises(ValueError, match="df >= 3"):
        t_quantile_975(2)


def test_mean_interval_covers_the_mean_at_the_nominal_rate():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        m, lo, hi = mean_interval(list(rng.normal(1.0, 2.0, size=8)))
        hits += lo <= 1.0 <= hi
    assert 0.935 < hits / 2000 < 0.965
    assert all(math.isnan(x) for x in mean_interval([1.0, 2.0, 3.0])[1:])


def _data(effect_a: float, effect_b: float, windows: int, seeds: int = 4, noise: float = 0.01) -> dict:
    """Synthetic runs: fp NLL per token varies by window; A and B add their effect plus noise."""
    rng = np.random.default_rng(1)
    runs, summary = [], []
    for w in range(windows):
        base = 3.0 + rng.normal(0, 0.3)
        runs.append({"label": "fp", "window": w, "nll": base * 512, "tokens": 512})
        for name, eff in (("a", effect_a), ("b", effect_b)):
            for s in range(seeds):
                nll = (base + eff + rng.normal(0, noise)) * 512
                runs.append({"label": f"{name}@seed{s}", "window": w, "nll": nll, "tokens": 512, "kl": eff * 512})
    for name in ("a", "b"):
        summary += [{"label": f"{name}@seed{s}", "group": name, "bits": 4} for s in range(seeds)]
    return {"fp_label": "fp", "runs": runs, "summary": summary}


def test_paired_comparison_finds_a_real_gap_and_not_a_false_one():
    out = compare_groups(_data(0.010, 0.020, windows=16))
    (pair,) = out["pairs"]
    assert pair["verdict"] == "a lower" and pair["hi_pct"] < 0
    assert pair["ratio_pct"] == pytest.approx(100 * math.expm1(-0.010), abs=0.2)
    assert pair["kl_diff"] == pytest.approx(-0.010)
    a = next(g for g in out["groups"] if g["group"] == "a")
    assert a["lo_pct"] < a["delta_pct"] < a["hi_pct"] and a["delta_pct"] == pytest.approx(1.0, abs=0.1)
    tie = compare_groups(_data(0.010, 0.010, windows=16, noise=0.05))["pairs"][0]
    assert tie["verdict"] == "tie at this power" and tie["lo_pct"] < 0 < tie["hi_pct"]


def test_too_few_windows_give_no_verdict():
    pair = compare_groups(_data(0.010, 0.020, windows=3))["pairs"][0]
    assert math.isnan(pair["lo_pct"]) and pair["verdict"] == "tie at this power"
