"""The kvq command line: --version, list, info, demo and the fidelity benchmark."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

import kvq_core
from kvq_core.tools.cli import main


def test_version_names_the_distribution_and_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"kvq-core {declared['version']}\n"
    assert kvq_core.__version__ == declared["version"]
    from kvq_core import __version__

    assert __version__ == kvq_core.__version__


def test_list_names_every_method_and_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for rec in kvq_core.list_methods():
        assert rec.name in out
    assert "numpy" in out and "built-in numpy" in out
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in data["methods"]} == {m.name for m in kvq_core.list_methods()}


def test_info_reports_true_bits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "oscar", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["defaults"]["bits"] == 2 and data["default_residual"] == 128
    # INT2 keys: 2 + 32/32 (fp16 scale + offset per 32 tokens) + 32/(8*128) (fp32 token norm)
    assert data["bits_per_element"]["128"]["keys"] == pytest.approx(2 + 1 + 32 / 1024)
    assert main(["info", "octopus"]) == 0
    assert "head_dim 128: keys 2.625" in capsys.readouterr().out


def test_unknown_method_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_demo_runs_every_available_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tokens", "64", "--kv-heads", "2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    for rec in kvq_core.list_methods():
        if rec.available:
            assert f"| {rec.name}" in out
    assert "| fp16 | 16.000 |" in out


def test_bench_fidelity_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "fidelity", "--tokens", "64", "--kv-heads", "2", "--head-dims", "64", "--bits", "2", "3", "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "fidelity.json").read_text())
    rows = data["rows"]
    assert {r["regime"] for r in rows} == {"gaussian", "outliers", "sinks"}
    labels = {r["label"] for r in rows}
    assert {"oscar", "octopus", "turboquant", "turboquant rate-matched", "kivi", "quarot", "qjl", "polarquant", "turboquant_prod"} <= labels
    by = {(r["regime"], r["bits"], r["label"]): r for r in rows}
    for b in (2, 3):  # equal storage: the rate-matched row stores exactly OCTOPUS's bits
        assert by["gaussian", b, "turboquant rate-matched"]["key_bits"] == by["gaussian", b, "octopus"]["key_bits"]
        assert by["gaussian", b, "octopus"]["key_rel_mse"] < by["gaussian", b, "turboquant"]["key_rel_mse"]
    assert (tmp_path / "fidelity.png").stat().st_size > 10_000
    assert "## (c) token-norm imbalance, head_dim 64" in (tmp_path / "fidelity.md").read_text()
