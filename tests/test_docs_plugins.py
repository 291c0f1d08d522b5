"""docs/plugins.md's minimal backend is real: installed with pip from the doc's own module and
pyproject.toml, found through its entry point, and proven equal to the reference."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvq_core
from kvq_core import registry, testing

pytestmark = pytest.mark.slow  # slow tier: pip-installs the doc's plugin

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def _block(marker: str, lang: str) -> str:
    """The fenced ``lang`` block right after ``<!-- marker -->`` in docs/plugins.md."""
    found = re.search(rf"<!-- {marker} -->\n```{lang}\n(.*?)\n```", DOC.read_text(), re.S)
    assert found, f"docs/plugins.md has no ```{lang} block after <!-- {marker} -->"
    return found.group(1) + "\n"


def test_minimal_backend_installs_and_conforms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _block("minimal-backend", "python")
    assert len(code.splitlines()) < 60
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    (src / "my_kvq_backend.py").write_text(code)
    (src / "pyproject.toml").write_text(_block("minimal-backend-pyproject", "toml"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    registry.reload()
    try:
        mini = {b.name: b for b in kvq_core.list_backends()}["mini"]
        assert mini.available and mini.detail == ("fp16",) and mini.origin == "plugin mini (my-kvq-backend 0.1.0)"
        assert kvq_core.get_quantizer("fp16", backend="mini").backend == "mini"
        report = testing.run_conformance("mini", ["fp16"], max_examples=8, exact_codes=True)
        assert report.ok and report.methods[0].examples > 0
    finally:
        monkeypatch.undo()
        registry.reload()


def test_docs_name_every_built_in_plugin() -> None:
    """The plugin guide and the architecture page list kvq's built-in plugins as pyproject.toml has them."""
    names = {name for name, _ in registry.builtin_plugins()[0]}
    for doc in (DOC, DOC.parent / "architecture.md"):
        listing = re.search(r"\(`kvq-methods`,[^)]*\)", doc.read_text())
        assert listing, f"{doc.name} names no built-in plugins"
        assert set(re.findall(r"`([\w-]+)`", listing.group(0))) == names, (doc.name, listing.group(0), names)
