"""``bench/qat_finetune.py --quick``: the KV-aware fine-tuning bench runs end to end on a tiny
random model (every code path: three fine-tunes, PPL through the real caches, passkey recall,
the report); its numbers mean nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # slow tier: runs the fine-tuning bench in a child

pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "qat.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "bench/qat_finetune.py", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"base", "plain", "qat-oscar", "qat-octopus"}
    assert data["train_tokens"] > 0 and data["held_out_tokens"] > 0
    labels = [c["label"] for c in data["configs"]]
    assert labels[0] == "fp" and len(labels) == 3
    for name, r in data["results"].items():
        assert set(r["eval"]["ppl"]) == set(labels) and set(r["eval"]["recall"]) == set(labels)
        assert all(1 < p < 1e4 for p in r["eval"]["ppl"].values()), (name, r["eval"])
        if name != "base":
            assert len(r["train"]["losses"]) == data["args"]["steps"]
    # fine-tuning moved the weights: the fp perplexity changed
    assert data["results"]["plain"]["eval"]["ppl"]["fp"] != data["results"]["base"]["eval"]["ppl"]["fp"]
    assert [s["codec"] for s in data["summary"]] == labels[1:]
    md = out.with_suffix(".md").read_text()
    assert "gap closed" in md and "| qat-octopus |" in md
