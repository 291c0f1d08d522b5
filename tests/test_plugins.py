"""Third-party plugins as users install them: real distributions, built in a temp dir and
installed with pip (``--target``), found through the ``kvq.plugins`` entry points.

- a plugin that raises on import, one that registers a taken method name, and one whose
  kernels for a built-in backend collide are listed by ``kvq list`` with the reason and keep
  nothing (all or nothing), while ``import kvq_core`` and everything else still work;
- a plugin adding its method's kernels to the built-in numpy and torch backends (hook
  ``kvq_register_kernels``) is served by them; its torch kernels are wrong on purpose and the
  conformance suite says which check, field and element;
- kernels for a backend that is not registered here are skipped and noted, not fatal;
- ``KVQ_DISABLE_PLUGINS=1`` loads the built-ins and nothing else;
- the built-ins come from kvq's own entry-point table (pyproject.toml in a checkout, else the
  installed metadata).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvq_core
from kvq_core import registry, testing

ROOT = Path(__file__).resolve().parents[1]

DISTS = {
    "kvq-broken": ("kvq_broken", "raise ImportError('kvq_broken needs a driver this machine lacks')\n"),
    "kvq-dupmethod": ("kvq_dupmethod", '''
        from kvq_core.hookspecs import hookimpl
        from kvq_core.contract import MethodInfo

        @hookimpl
        def kvq_register_methods(register):
            register(MethodInfo("oscar", "kvq_core.methods.fp16:Fp16Spec", "a second oscar"))
        '''),
    "kvq-dupkernels": ("kvq_dupkernels", '''
        from kvq_core.hookspecs import hookimpl
        from kvq_core.contract import MethodInfo

        @hookimpl
        def kvq_register_methods(register):
            register(MethodInfo("dupk", "kvq_core.methods.fp16:Fp16Spec", "kept only if the kernels register"))

        @hookimpl
        def kvq_register_kernels(register):
            register("numpy", "fp16", "kvq_numpy.fp16:Fp16Kernels")  # numpy serves fp16 already
        '''),
    "kvq-plainfp": ("kvq_plainfp", '''
        """Method "plainfp" (floats stored as float16) with kernels added to the built-in backends."""
        import dataclasses

        import torch

        from kvq_core.hookspecs import hookimpl
        from kvq_core.contract import MethodInfo
        from kvq_core.methods.fp16 import Fp16Spec
        from kvq_torch.common import TorchMethod


        @dataclasses.dataclass(frozen=True)
        class PlainSpec(Fp16Spec):
            method = "plainfp"


        class WrongTorch(TorchMethod):
            """Stores 1% too much: the conformance suite must catch it."""

            def encode_keys(self, k, ctx):
                return {"data": (k.float() * 1.01).to(torch.float16)}

            def decode_keys(self, fields, ctx):
                return fields["data"].float()


        @hookimpl
        def kvq_register_methods(register):
            register(MethodInfo("plainfp", PlainSpec, "fp16 under another name"))

        @hookimpl
        def kvq_register_kernels(register):
            register("numpy", "plainfp", "kvq_numpy.fp16:Fp16Kernels")
            register("torch", "plainfp", WrongTorch)
            register("torch-compiled", "plainfp", WrongTorch)
            register("no-such-backend", "plainfp", WrongTorch)
        '''),
}


def _write_dist(root: Path, dist: str, module: str, source: str) -> Path:
    d = root / dist
    d.mkdir()
    (d / f"{module}.py").write_text(textwrap.dedent(source))
    (d / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "1.2.3"

        [project.entry-points."kvq.plugins"]
        {module} = "{module}"

        [tool.setuptools]
        py-modules = ["{module}"]
        '''))
    return d


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four distributions installed by pip into one target directory (one pip run)."""
    pytest.importorskip("torch")
    src, target = tmp_path_factory.mktemp("dists"), tmp_path_factory.mktemp("site")
    dirs = [str(_write_dist(src, dist, module, source)) for dist, (module, source) in DISTS.items()]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), *dirs], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return target


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch):
    """This interpreter sees the installed distributions (as if pip had put them in site-packages)."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    registry.reload()
    yield
    monkeypatch.undo()
    registry.reload()


def _by_name(records):
    return {r.name: r for r in records}


def _kvq_list(site: Path) -> tuple[dict, str]:
    """``kvq list --json`` and ``kvq list`` in one fresh interpreter with ``site`` on the path."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), str(ROOT / "backends")])}
    environ.pop(registry.DISABLE_ENV, None)
    code = "from kvq_core.tools.cli import main; main(['list', '--json']); print('=' * 8); main(['list'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)
    assert proc.returncode == 0, proc.stderr
    listing, text = proc.stdout.split("=" * 8 + "\n")
    return json.loads(listing), text


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_failing_plugins_are_listed_with_their_reason(site: Path) -> None:
    listing, text = _kvq_list(site)
    plugins = {p["name"]: p for p in listing["plugins"]}
    assert not plugins["kvq_broken"]["available"]
    assert plugins["kvq_broken"]["reason"] == "ImportError: kvq_broken needs a driver this machine lacks"
    assert plugins["kvq_broken"]["origin"] == "plugin kvq_broken (kvq-broken 1.2.3)"
    assert not plugins["kvq_dupmethod"]["available"]
    assert "registers MethodInfo 'oscar', already from built-in kvq-methods" in plugins["kvq_dupmethod"]["reason"]
    assert not plugins["kvq_dupkernels"]["available"]
    assert ("registers kernels for 'fp16' on backend 'numpy', already from built-in numpy"
            in plugins["kvq_dupkernels"]["reason"])
    methods = {m["name"]: m for m in listing["methods"]}
    assert "dupk" not in methods  # all or nothing: its method went with its kernels
    assert methods["oscar"]["origin"] == "built-in kvq-methods" and methods["oscar"]["available"]
    for name in ("kvq_broken", "kvq_dupmethod", "kvq_dupkernels"):
        line = next(li for li in text.splitlines() if li.strip().startswith(name))
        assert "failed: " in line and "(kvq-" in line


def test_kernels_join_the_builtin_backends(installed) -> None:
    plugins = _by_name(kvq_core.list_plugins())
    plain = plugins["kvq_plainfp"]
    assert plain.available and plain.origin == "plugin kvq_plainfp (kvq-plainfp 1.2.3)"
    assert plain.detail == ("method plainfp", "kernels numpy/plainfp", "kernels torch/plainfp",
                            "kernels torch-compiled/plainfp")
    assert plain.problems == ("kernels no-such-backend/plainfp: backend 'no-such-backend' is not registered here",)
    backends = _by_name(kvq_core.list_backends())
    assert "plainfp" in backends["numpy"].detail and "plainfp" in backends["torch"].detail
    assert "plainfp" in testing.methods_for("torch")  # the conformance suite sees it too
    k = np.random.default_rng(0).standard_normal((1, 2, 5, 64)).astype(np.float32)
    q = kvq_core.get_quantizer("plainfp", head_dim=64)
    assert q.backend == "numpy"
    np.testing.assert_array_equal(q.decode_keys(q.encode_keys(k)), k.astype(np.float16).astype(np.float32))
    import torch

    qt = kvq_core.get_quantizer("plainfp", backend="auto", device="cpu", head_dim=64)
    assert qt.backend == "torch"  # served through the kvq:: ops like a built-in method
    packed = qt.encode_keys(torch.from_numpy(k))
    assert packed.fields["data"].dtype == torch.float16


def test_plugin_torch_kernels_are_the_backends_own(installed) -> None:
    """One table: the plugin's TorchMethod subclass is the class the registry holds for torch and
    torch-compiled; the Quantizer runs it through the kvq:: ops, and torch-compiled compiles it
    (the backend's ``adapt``) exactly as it does a built-in class."""
    import torch

    from kvq_core.torch_ops import run
    from kvq_core.torch_ops.calls import OpKernels
    from kvq_torch.common import TorchMethod
    from kvq_torch.compiled import CompiledMethod
    from kvq_torch.paged import PagedTorch

    cls = registry.kernel_factory("torch", "plainfp")
    assert cls.__name__ == "WrongTorch" and cls.__module__ == "kvq_plainfp" and issubclass(cls, TorchMethod)
    assert registry.paged_factory("torch", "plainfp") is PagedTorch  # the paged ops serve it too
    k = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 2, 5, 64)).astype(np.float32))
    wrong = (k * 1.01).to(torch.float16)
    q = kvq_core.get_quantizer("plainfp", backend="torch", head_dim=64)
    assert isinstance(q.kernels, OpKernels) and q.kernels.backend == "torch"
    torch.testing.assert_close(q.encode_keys(k).fields["data"], wrong, rtol=0, atol=0)
    assert type(run.kernel("torch", q.spec.to_json())) is cls  # what the kvq::encode body ran
    compiled = registry.kernel_factory("torch-compiled", "plainfp")(q.spec)
    assert isinstance(compiled, CompiledMethod) and type(compiled.impl) is cls
    ok, why = registry.backend_status("torch-compiled")
    if not ok:
        pytest.skip(f"torch-compiled unavailable here: {why}")
    qc = kvq_core.get_quantizer("plainfp", backend="torch-compiled", head_dim=64)
    assert isinstance(qc.kernels, OpKernels) and qc.kernels.backend == "torch-compiled"
    torch.testing.assert_close(qc.encode_keys(k).fields["data"], wrong, rtol=0, atol=0)
    assert isinstance(run.kernel("torch-compiled", qc.spec.to_json()), CompiledMethod)


def test_conformance_says_where_wrong_kernels_fail(installed) -> None:
    with pytest.raises(testing.ConformanceError) as info:
        testing.check_method("torch", "plainfp", max_examples=0, errors=False, dtypes=("float32",),
                             regimes=("gaussian",), head_dims=(64,))
    message = str(info.value)
    assert "keys field 'data' failed for Case(plainfp(head_dim=64, storage='float16')" in message
    assert "values differ: at (" in message and "backend" in message and "reference" in message
    testing.check_method("numpy", "plainfp", max_examples=0, errors=False, head_dims=(64,))  # the reference passes


def test_disable_env_loads_the_builtins_only(installed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    registry.reload()
    plugins = kvq_core.list_plugins()
    builtins = {name for name, _ in registry.builtin_plugins()[0]}
    assert {p.name for p in plugins} == builtins and {"kvq-methods", "numpy", "torch"} <= builtins
    assert all(p.available for p in plugins), [(p.name, p.reason) for p in plugins if not p.available]
    assert {"numpy", "torch"} <= {b.name for b in kvq_core.list_backends() if b.available}
    assert "plainfp" not in {m.name for m in kvq_core.list_methods()}
    assert "plainfp" not in _by_name(kvq_core.list_backends())["numpy"].detail


def test_builtins_are_kvqs_own_entry_points() -> None:
    tomllib = pytest.importorskip("tomllib")

    table, source = registry.builtin_plugins()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["kvq.plugins"]
    assert dict(table) == declared and source == str(ROOT / "pyproject.toml")
    assert {"kvq-methods", "numpy", "torch"} <= set(declared)


def test_builtins_from_installed_metadata_and_when_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel has no pyproject.toml beside kvq_core: the installed metadata names the built-ins;
    with neither, kvq list says so instead of failing."""
    monkeypatch.setattr(registry, "__file__", str(tmp_path / "kvq_core" / "registry.py"))
    monkeypatch.setenv(registry.DISABLE_ENV, "1")  # the built-ins alone, whatever else this environment installed
    info = tmp_path / "site" / "kvq_core-9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvq-core\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text("[kvq.plugins]\nkvq-methods = kvq_core.methods\nnumpy = kvq_numpy.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert registry.builtin_plugins() == ((("kvq-methods", "kvq_core.methods"), ("numpy", "kvq_numpy.plugin")),
                                          "the installed kvq-core metadata")
    registry.reload()
    try:
        assert {b.name for b in kvq_core.list_backends()} == {"numpy"}
        (info / "entry_points.txt").write_text("")
        registry.reload()
        kvq = _by_name(kvq_core.list_plugins())["kvq-core"]
        assert not kvq.available and "no built-in plugins" in kvq.reason and "pip install -e ." in kvq.reason
        assert kvq_core.list_backends() == []
    finally:
        monkeypatch.undo()
        registry.reload()
