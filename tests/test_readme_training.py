"""README "Training": its snippet runs as written and prints what its comments say."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hf_version import skip_unless_cache_keyword  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier: a fresh interpreter runs the README's training snippet

pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- training-snippet -->"


def snippet() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    after = text.split(MARKER, 1)[1]
    match = re.match(r"\s*```python\n(.*?)\n```", after, re.S)
    assert match, f"no python block right after {MARKER}"
    return match.group(1)


def test_training_snippet_runs_and_prints_what_it_says() -> None:
    skip_unless_cache_keyword(snippet())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", snippet()], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d: loss (\d+\.\d+)$", proc.stdout, re.M)]
    assert len(losses) == 3 and abs(losses[0] - 4.87) < 0.02, proc.stdout
    assert losses[0] > losses[1] > losses[2], losses  # "falls step by step"
    assert proc.stdout.rstrip().endswith("torch.Size([1, 56])"), proc.stdout
