"""The built distributions work on their own: a wheel and an sdist built with ``python -m build``
from a copy of this checkout, each installed into a fresh virtual environment (no system
site-packages, no checkout on the path), run the quick start (``kvq --version``, ``kvq list``, ``kvq
demo``) with every built-in, whose table then comes from the installed metadata.

The environment gets only what the distribution declares (numpy, pluggy; setuptools to build the
sdist) from the package index, so the optional backends (torch, triton, numba) are absent there:
``kvq list`` must name the extra that installs each.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvq_core import registry

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", registry.DISABLE_ENV)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """A wheel and an sdist of this checkout, built by ``python -m build`` (the wheel from the sdist)."""
    pytest.importorskip("build", reason="python -m build needs the dev extra's build")
    tmp = tmp_path_factory.mktemp("dists")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("kvq_core", "backends"):  # a copy: building writes build/ and *.egg-info beside the sources
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)], cwd=tmp)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return {"wheel": next((tmp / "dist").glob("kvq_core-*.whl")), "sdist": next((tmp / "dist").glob("kvq_core-*.tar.gz"))}


@pytest.fixture(scope="module", params=["wheel", "sdist"])
def venv(request, dists: dict[str, Path], tmp_path_factory) -> Path:
    """A fresh venv with the wheel or the sdist installed (and only its declared dependencies)."""
    env = tmp_path_factory.mktemp(request.param) / "venv"
    made = _run([sys.executable, "-m", "venv", str(env)], cwd=env.parent)
    assert made.returncode == 0, made.stderr
    installed = _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", str(dists[request.param])], cwd=env.parent)
    if installed.returncode != 0 and "No matching distribution found" in installed.stderr:
        pytest.skip(f"no package index reachable for the dependencies: {installed.stderr.strip().splitlines()[-1]}")
    assert installed.returncode == 0, installed.stderr
    return env


def test_name_and_builtins_come_from_the_installed_metadata(venv: Path) -> None:
    probe = ("import json, kvq_core, importlib.metadata as md; from kvq_core import registry; "
             "print(json.dumps({'file': kvq_core.__file__, 'builtins': registry.builtin_plugins(), "
             "'dist': md.metadata('kvq-core')['Name'], 'extras': registry.extras()}))")
    proc = _run([str(venv / "bin" / "python"), "-c", probe], cwd=venv.parent)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert Path(got["file"]).is_relative_to(venv) and got["dist"] == declared["name"] == registry.KVQ_DIST
    table, source = got["builtins"]
    assert dict(map(tuple, table)) == declared["entry-points"]["kvq.plugins"]
    assert source == f"the installed {registry.KVQ_DIST} metadata"
    assert set(got["extras"]) == set(declared["optional-dependencies"])


def test_kvq_version_list_and_demo_run_from_the_installed_distribution(venv: Path) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    kvq = str(venv / "bin" / "kvq")
    version = _run([kvq, "--version"], cwd=venv.parent)
    assert version.returncode == 0, version.stderr
    assert version.stdout == f"kvq-core {declared['version']}\n"
    listed = _run([kvq, "list", "--json"], cwd=venv.parent)
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert set(declared["entry-points"]["kvq.plugins"]) <= set(plugins)
    assert plugins["kvq-methods"]["available"] and plugins["numpy"]["available"]
    backends = {b["name"]: b for b in data["backends"]}
    # torch is not installed in this venv: its plugin fails to import; the triton and numba plugins
    # load (they import their compiler lazily) and their backends are unavailable. Each reason names the extra.
    assert not plugins["torch"]["available"] and "torch" not in backends
    reasons = {"torch": plugins["torch"]["reason"], "triton": backends["triton"]["reason"],
               "numba": backends["numba"]["reason"]}
    for name, reason in reasons.items():
        assert name not in backends or not backends[name]["available"]
        assert f"pip install 'kvq-core[{name}]'" in reason, (name, reason)
    methods = {m["name"]: m for m in data["methods"]}
    assert all(m["available"] and "numpy" in m["detail"] for m in methods.values()), methods
    demo = _run([kvq, "demo", "--tokens", "64", "--kv-heads", "2", "--head-dim", "64"], cwd=venv.parent)
    assert demo.returncode == 0, demo.stderr
    for method in methods:  # what .ci/run checks after the README's quick start
        assert f"\n| {method}" in demo.stdout, (method, demo.stdout)
