"""A failure stays where it happens: one optional module blocked at a time (a meta-path finder in
a fresh interpreter) disables only what needs it, with the reason; everything else still works."""
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
from kvq_core import registry
from kvq_core.errors import BackendUnavailableError, MethodUnavailableError, PluginError
from kvq_core.hookspecs import hookimpl
from kvq_core.contract import BackendInfo, MethodInfo

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = '''
import importlib.abc, json, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, Block())
'''

PROBE = '''
import numpy as np
import kvq_core
from kvq_core import registry
out = {
    "methods": {m.name: [m.available, m.reason] for m in kvq_core.list_methods()},
    "backends": {b.name: [b.available, b.reason, list(b.detail), list(b.problems)] for b in kvq_core.list_backends()},
    "plugins": {p.name: [p.available, p.reason] for p in kvq_core.list_plugins()},
}
k = np.random.default_rng(0).standard_normal((1, 2, 40, 64)).astype(np.float32)
ok = {}
for m in ("oscar", "octopus", "kivi", "qjl", "fp16"):
    try:
        q = kvq_core.get_quantizer(m, backend="numpy")
        ok[m] = float(np.abs(q.decode_keys(q.encode_keys(k)) - k).max())
    except Exception as exc:
        ok[m] = f"{type(exc).__name__}: {exc}"
out["roundtrip"] = ok
print("RESULT" + json.dumps(out))
'''


def _probe(*blocked: str, extra: str = "") -> dict:
    code = PRELUDE.format(blocked=list(blocked)) + PROBE + textwrap.dedent(extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")]),
           "KVQ_DISABLE_PLUGINS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_nothing_blocked_everything_works() -> None:
    out = _probe()
    assert all(ok for ok, _ in out["methods"].values()), out["methods"]
    assert all(isinstance(v, float) for v in out["roundtrip"].values()), out["roundtrip"]


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_scipy_is_not_needed() -> None:
    out = _probe("scipy")
    assert all(ok for ok, _ in out["methods"].values()), out["methods"]
    assert all(isinstance(v, float) for v in out["roundtrip"].values()), out["roundtrip"]


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_a_method_module_that_fails_disables_only_that_method() -> None:
    out = _probe("kvq_core.methods.polarquant", extra='''
        try:
            kvq_core.get_quantizer("polarquant")
        except kvq_core.KVQError as exc:
            out["error"] = f"{type(exc).__name__} {exc}"
        print("RESULT" + json.dumps(out))
    ''')
    ok, reason = out["methods"]["polarquant"]
    assert not ok and "ModuleNotFoundError" in reason and "kvq_core.methods.polarquant" in reason
    others = {m: v for m, v in out["methods"].items() if m != "polarquant"}
    assert all(a for a, _ in others.values()), others
    assert all(isinstance(v, float) for v in out["roundtrip"].values()), out["roundtrip"]
    assert out["error"].startswith("MethodUnavailableError polarquant is unavailable: ModuleNotFoundError")


def own_modules(method: str) -> list[str]:
    """A method's own modules: its spec module and each backend's kernel module named for it.

    OScaR, KIVI and QuaRot own only their spec: their kernels are each backend's one int-codes
    class (``kvq_<backend>.intcodes``, serving every :class:`~kvq_core.methods.intcodes.IntCodeRecipe`),
    an ingredient shared like ``kvq_numpy.attention``, which
    :func:`test_a_shared_int_codes_module_that_fails_disables_its_methods_on_that_backend_only` blocks."""
    kernels = [f"{pkg}.{method}" for pkg in ("kvq_numpy", "kvq_torch", "kvq_triton", "kvq_numba")
               if (ROOT / "backends" / pkg / f"{method}.py").exists()]
    return [f"kvq_core.methods.{method}", *kernels]


@pytest.mark.slow  # slow tier: a fresh interpreter
@pytest.mark.parametrize("method", ["polarquant", "qjl", "kivi", "octopus", "oscar", "quarot"])
def test_every_method_module_blocked_takes_down_only_methods_built_on_it(method: str) -> None:
    """A method's own modules blocked: that method is unavailable, and so is any method whose
    codec contains it (QJL stores its values as KIVI's codec), nothing else (TurboQuant_prod
    shares only QJL's sign sketch, which lives in kvq_core.math.sketch and the backends' sketch modules)."""
    out = _probe(*own_modules(method))
    contains = {"kivi": {"kivi", "qjl"}}.get(method, {method})
    down = {m for m, (ok, _) in out["methods"].items() if not ok}
    assert down == contains, out["methods"]


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_a_kernel_module_that_fails_disables_only_that_backend_method() -> None:
    out = _probe("kvq_numpy.octopus")
    ok, reason, served, problems = out["backends"]["numpy"]
    assert ok and "octopus" not in served and "oscar" in served
    assert any(p.startswith("octopus: ModuleNotFoundError") for p in problems), problems
    assert "kernels failed to load" in out["roundtrip"]["octopus"]
    assert isinstance(out["roundtrip"]["oscar"], float)
    assert out["methods"]["octopus"][0]  # torch still serves it


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_a_shared_int_codes_module_that_fails_disables_its_methods_on_that_backend_only() -> None:
    """The NumPy int-codes kernels blocked: OScaR, KIVI, QuaRot (and QJL, whose values are KIVI's
    codec) lose the numpy backend, with the reason; torch still serves them, other methods keep numpy."""
    out = _probe("kvq_numpy.intcodes")
    ok, reason, served, problems = out["backends"]["numpy"]
    assert ok and {"oscar", "kivi", "quarot", "qjl"}.isdisjoint(served) and "octopus" in served
    for m in ("oscar", "kivi", "quarot", "qjl"):
        assert any(p.startswith(f"{m}: ModuleNotFoundError") for p in problems), problems
        assert out["methods"][m][0]  # torch still serves it
    for m in ("oscar", "kivi", "qjl"):
        assert "kernels failed to load" in out["roundtrip"][m]
    assert isinstance(out["roundtrip"]["octopus"], float)


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_without_torch_numpy_still_serves_everything() -> None:
    out = _probe("torch")
    assert not out["plugins"]["torch"][0] and "torch" in out["plugins"]["torch"][1]
    assert "torch" not in out["backends"]
    assert all(ok for ok, _ in out["methods"].values()), out["methods"]
    assert all(isinstance(v, float) for v in out["roundtrip"].values())


@pytest.mark.slow  # slow tier: a fresh interpreter
@pytest.mark.parametrize("blocked", ["transformers", "onnx", "hypothesis"])
def test_without_an_extra_the_core_still_works(blocked: str) -> None:
    out = _probe(blocked)
    assert all(ok for ok, _ in out["methods"].values()), out["methods"]
    assert all(isinstance(v, float) for v in out["roundtrip"].values())


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_cli_list_works_without_torch_and_names_why() -> None:
    code = PRELUDE.format(blocked=["torch"]) + "from kvq_core.tools.cli import main\nmain(['list'])\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")]), "KVQ_DISABLE_PLUGINS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "torch" in proc.stdout and "No module named 'torch'" in proc.stdout
    backends = proc.stdout.split("\nbackends:\n")[1].split("\nplugins:\n")[0]
    assert "kvq-methods" not in backends


# ------------------------------------------------------------------------------------------------
# in-process: a plugin's registrations are all or nothing; supports() per spec and device
# ------------------------------------------------------------------------------------------------
class _HalfPlugin:
    """Registers a method, then a backend, then raises: nothing of it may be kept."""

    @hookimpl
    def kvq_register_methods(self, register):
        register(MethodInfo("halfmethod", "kvq_core.methods.fp16:Fp16Spec", "half"))

    @hookimpl
    def kvq_register_backends(self, register):
        from kvq_numpy.arrays import NumpyArrays

        register(BackendInfo("halfbackend", {"fp16": "kvq_numpy.fp16:Fp16Kernels"}, NumpyArrays()))
        raise PluginError("this plugin breaks half way")


def _only64(spec, device):
    return (True, None) if spec.head_dim == 64 else (False, f"head_dim {spec.head_dim}; this backend needs 64")


class _PickyPlugin:
    @hookimpl
    def kvq_register_backends(self, register):
        from kvq_numpy.arrays import NumpyArrays

        register(BackendInfo("picky", {"fp16": "kvq_numpy.fp16:Fp16Kernels"}, NumpyArrays(), supports=_only64))

    @hookimpl(tryfirst=True)
    def kvq_select_backend(self, method, device, candidates):
        return "picky" if "picky" in candidates else None


@pytest.fixture
def extra_plugins(monkeypatch: pytest.MonkeyPatch):
    import types

    mods = {}
    for name, cls in (("halfplug", _HalfPlugin), ("pickyplug", _PickyPlugin)):
        mod = types.ModuleType(name)
        obj = cls()
        for attr in dir(cls):
            if attr.startswith("kvq_"):
                setattr(mod, attr, getattr(obj, attr))
        mods[name] = mod
        monkeypatch.setitem(sys.modules, name, mod)
    table, source = registry.builtin_plugins()
    monkeypatch.setattr(registry, "builtin_plugins",
                        lambda: ((*table, ("halfplug", "halfplug"), ("pickyplug", "pickyplug")), source))
    registry.reload()
    yield
    registry.reload()


def test_a_plugin_that_raises_half_way_registers_nothing(extra_plugins) -> None:
    plugins = {p.name: p for p in kvq_core.list_plugins()}
    assert not plugins["halfplug"].available and "breaks half way" in plugins["halfplug"].reason
    assert "halfmethod" not in {m.name for m in kvq_core.list_methods()}
    assert "halfbackend" not in {b.name for b in kvq_core.list_backends()}


def test_supports_is_asked_per_spec_and_explains(extra_plugins) -> None:
    assert kvq_core.get_quantizer("fp16", head_dim=64).backend == "picky"
    assert kvq_core.get_quantizer("fp16", head_dim=128).backend == "numpy"  # auto skips what cannot serve
    q = kvq_core.get_quantizer("fp16", backend="picky", head_dim=128)
    with pytest.raises(BackendUnavailableError, match="head_dim 128; this backend needs 64"):
        q.encode_keys(np.zeros((1, 1, 2, 128), np.float32))
    ok, reason = registry.supports("picky", kvq_core.make_spec("fp16", head_dim=128), None)
    assert not ok and "picky" in reason and "NumPy arrays" in reason


def test_unavailable_method_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    registry.reload()
    entry = registry.state().methods["oscar"]
    monkeypatch.setattr(entry, "spec", registry._Lazy("kvq_core.methods.no_such_module:Spec"))
    with pytest.raises(MethodUnavailableError, match="oscar is unavailable: ModuleNotFoundError"):
        kvq_core.get_quantizer("oscar")
    registry.reload()


def test_head_dim_binds_from_the_first_block() -> None:
    q = kvq_core.get_quantizer("oscar", backend="numpy")
    assert q.spec.head_dim == 128
    k = np.random.default_rng(1).standard_normal((1, 2, 40, 64)).astype(np.float32)
    pk = q.encode_keys(k)
    assert q.spec.head_dim == 64 and pk.spec.head_dim == 64
    with pytest.raises(kvq_core.InputError, match="head_dim"):
        q.encode_keys(np.zeros((1, 2, 4, 128), np.float32))  # bound now: a second head_dim is an error
    explicit = kvq_core.get_quantizer("oscar", backend="numpy", head_dim=128)
    with pytest.raises(kvq_core.InputError, match="head_dim"):
        explicit.encode_keys(k)  # an explicit value is validated, never rebound
    fresh = kvq_core.get_quantizer("oscar", backend="numpy")
    np.testing.assert_allclose(fresh.decode_keys(pk), q.decode_keys(pk))  # a packed block binds too
    assert fresh.spec.head_dim == 64
