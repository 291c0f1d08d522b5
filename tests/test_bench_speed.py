"""``kvq bench speed`` at a tiny size: attend is timed paired with SDPA, targets are reported with
their thresholds, and the memcpy figure times a copy, not page faults."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvq_core.tools.bench import speed  # noqa: E402


def test_paired_attend_reports_median_ratios() -> None:
    calls = iter([0.0] * 1000)
    out = speed.paired_attend(lambda: next(calls), {"gqa": lambda: sum(range(20000)), "folded": lambda: None}, 5)
    assert set(out) == {"attend_s", "attend_vs_sdpa_fp32_gqa", "attend_vs_sdpa_fp32_folded"}
    assert out["attend_s"] > 0 and out["attend_vs_sdpa_fp32_gqa"] > out["attend_vs_sdpa_fp32_folded"] > 0


def test_targets_of_compares_paired_speedups_with_the_thresholds() -> None:
    row = {"method": "oscar", "backend": "numba", "tokens": 32768, "head_dim": 128, "attend_s": 0.02, "encode_s": 0.1,
           "packed_bytes": 25e6, "attend_gbps_packed": 1.25, "attend_vs_sdpa_fp32_gqa": 4.2, "attend_vs_sdpa_fp32_folded": 1.4}
    torch_row = {**row, "backend": "torch", "encode_s": 0.6}
    res = {"rows": [row, torch_row], "memcpy_gbps": 10.0}
    got = {(t["method"], t["vs"]): t for t in speed.targets_of(res, "numba")}
    assert set(got) == {("oscar", "gqa"), ("oscar", "folded")}  # octopus was not measured
    assert got["oscar", "gqa"]["met"] and not got["oscar", "folded"]["met"]
    assert got["oscar", "gqa"]["encode_speedup_vs_torch"] == pytest.approx(6.0)
    assert speed.targets_of(res, "torch-compiled") == []


def test_speed_cli_runs_small(tmp_path) -> None:
    out = tmp_path / "speed"
    assert speed.main(["--contexts", "256", "--head-dims", "64", "--methods", "oscar", "--backends", "numpy", "torch",
                       "--repeats", "2", "--threads", "1", "--out", str(out), "--no-plot"]) == 0
    res = json.loads((out / "speed.json").read_text())
    assert {r["backend"] for r in res["rows"]} == {"numpy", "torch"}
    for r in res["rows"]:
        assert r["attend_vs_sdpa_fp32_gqa"] > 0 and r["attend_vs_sdpa_fp32_folded"] > 0
    assert res["memcpy_gbps"] > 0.1 and res["targets"] == []  # 32k rows only carry targets
    md = (out / "speed.md").read_text()
    assert "CPU capability" in md and "| oscar | torch | 256 |" in md


def test_call_overhead_reports_interleaved_rounds() -> None:
    """The attend call overhead figure (numba): the best attend round minus the best kernel round, the
    per-round spread beside it, and the line `kvq bench speed` prints."""
    pytest.importorskip("numba")
    o = speed.call_overhead(repeats=3, calls=50)
    assert o["attend_us"] > 0 and o["kernel_us"] > 0
    assert o["overhead_us"] == o["attend_us"] - o["kernel_us"] and o["met"] == (o["overhead_us"] <= speed.OVERHEAD_TARGET_US)
    r = o["overhead_rounds_us"]
    assert r["min"] <= r["median"] <= r["max"]
    assert f"overhead **{o['overhead_us']:.1f} us**" in speed._overhead_line(o)
