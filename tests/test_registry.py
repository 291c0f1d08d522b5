"""The pluggy registry: built-ins, third-party entry points, failures, selection, records."""
from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvq_core
from kvq_core import registry
from kvq_core.errors import BackendUnavailableError, SpecError, UnknownBackendError, UnknownMethodError

GOOD = '''
from kvq_core.hookspecs import hookimpl
from kvq_core.contract import BackendInfo
from kvq_numpy.arrays import NumpyArrays
from kvq_numpy.fp16 import Fp16Kernels

@hookimpl
def kvq_register_backends(register):
    register(BackendInfo("fakeplug", {"fp16": Fp16Kernels}, NumpyArrays(), summary="test plugin"))

@hookimpl(tryfirst=True)
def kvq_select_backend(method, device, candidates):
    return "fakeplug" if device == "fake" else None
'''
BROKEN = "raise ImportError('this plugin needs a GPU driver')\n"
MISSPELT = '''
from kvq_core.hookspecs import hookimpl

@hookimpl
def kvq_register_backend(register):
    pass
'''
DUPLICATE = '''
from kvq_core.hookspecs import hookimpl
from kvq_core.contract import BackendInfo
from kvq_numpy.arrays import NumpyArrays

@hookimpl
def kvq_register_backends(register):
    register(BackendInfo("numpy", {}, NumpyArrays()))
'''


def _install(root: Path, name: str, source: str) -> None:
    """A minimal installed distribution exposing ``name`` in the kvq.plugins entry-point group."""
    (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvq.plugins]\n{name} = {name}\n")


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name, src in (("fakeplug", GOOD), ("brokenplug", BROKEN), ("misspeltplug", MISSPELT), ("dupplug", DUPLICATE)):
        _install(tmp_path, name, src)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    registry.reload()
    yield
    registry.reload()


def _by_name(records):
    return {r.name: r for r in records}


def test_builtins_registered_like_plugins() -> None:
    registry.reload()
    backends = _by_name(kvq_core.list_backends())
    assert backends["numpy"].available and backends["numpy"].origin == "built-in numpy"
    assert "fp16" in backends["numpy"].detail
    methods = _by_name(kvq_core.list_methods())
    assert methods["fp16"].available and "numpy" in methods["fp16"].detail
    assert {"kvq-methods", "numpy"} <= {p.name for p in kvq_core.list_plugins() if p.available}


def test_third_party_plugin_loads_and_selects(plugins) -> None:
    backends = _by_name(kvq_core.list_backends())
    assert backends["fakeplug"].available
    assert backends["fakeplug"].origin == "plugin fakeplug (fakeplug 0.1)"
    q = kvq_core.get_quantizer("fp16", backend="auto", device="fake")
    assert q.backend == "fakeplug"
    assert kvq_core.get_quantizer("fp16").backend == "numpy"  # no device hint: the reference
    k = np.ones((1, 1, 2, 128), np.float32)
    np.testing.assert_array_equal(q.decode_keys(q.encode_keys(k)), k)


def test_failing_plugins_are_listed_not_raised(plugins) -> None:
    recs = _by_name(kvq_core.list_plugins())
    assert not recs["brokenplug"].available and "needs a GPU driver" in recs["brokenplug"].reason
    assert not recs["misspeltplug"].available and "kvq_register_backend" in recs["misspeltplug"].reason
    assert not recs["dupplug"].available and "already from built-in numpy" in recs["dupplug"].reason
    listed = _by_name(kvq_core.list_backends())
    assert "brokenplug" not in listed and "kvq-methods" not in listed  # plugins are not backends
    assert kvq_core.get_quantizer("fp16", backend="numpy").backend == "numpy"


def test_disable_env_skips_third_party(plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    registry.reload()
    names = {p.name for p in kvq_core.list_plugins()}
    assert "fakeplug" not in names and "brokenplug" not in names
    assert "numpy" in names


def test_unknown_names_raise_typed_errors() -> None:
    with pytest.raises(UnknownMethodError, match="'nope'"):
        kvq_core.get_quantizer("nope")
    with pytest.raises(UnknownBackendError, match="'nope'"):
        kvq_core.get_quantizer("fp16", backend="nope")
    with pytest.raises(SpecError, match="parameter colour='red'"):
        kvq_core.get_quantizer("fp16", colour="red")
    with pytest.raises(SpecError, match="layer"):
        kvq_core.get_quantizer("fp16", backend="numpy", layer=-1)


def test_unavailable_backend_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = registry.state().backends["numpy"]
    monkeypatch.setattr(entry, "info", dataclasses.replace(entry.info, is_available=lambda: (False, "switched off")))
    with pytest.raises(BackendUnavailableError, match="switched off"):
        kvq_core.get_quantizer("fp16", backend="numpy")
    registry.reload()


@pytest.mark.parametrize("method", [m.name for m in kvq_core.list_methods()])
def test_spec_json_round_trip_for_every_method(method: str) -> None:
    import json

    spec = kvq_core.make_spec(method)
    assert kvq_core.spec_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.to_dict()["method"] == method


def test_one_kernel_table_holds_the_real_classes() -> None:
    """The registry's table is the only one: it holds each backend's kernel class (no op-calling
    wrapper, no second table in dispatch), and a backend's trip through the kvq:: ops is a flag."""
    import importlib.util

    from kvq_core import contract
    from kvq_numba.intcodes import IntCodesNumba
    from kvq_numpy.intcodes import IntCodesKernels

    assert registry.kernel_factory("numpy", "oscar") is IntCodesKernels
    assert registry.kernel_factory("numba", "oscar") is IntCodesNumba
    assert importlib.util.find_spec("kvq_core.torch_ops.table") is None
    assert not hasattr(contract, "Deferred")
    fields = {f.name for f in dataclasses.fields(contract.BackendInfo)}
    assert "kernel_entry" not in fields and {"torch_ops", "adapt", "paged", "paged_write"} <= fields
    assert not registry.backend_info("numpy").torch_ops and not registry.backend_info("numba").torch_ops
    assert registry.paged_factory("numpy", "oscar") is None  # no paged kernels: the ops fall back to torch's


def test_torch_backends_hold_one_torchmethod_per_method() -> None:
    pytest.importorskip("torch")
    from kvq_core.torch_ops import calls, torch_kernels
    from kvq_torch.common import TorchMethod
    from kvq_torch.intcodes import IntCodesTorch
    from kvq_torch.paged import PagedTorch

    assert registry.kernel_factory("torch", "oscar") is IntCodesTorch
    assert not hasattr(torch_kernels, "TorchMethod") and not hasattr(calls, "op_backend")
    assert all(registry.backend_info(b).torch_ops for b in ("torch", "torch-compiled", "triton"))
    for method in registry.backend_info("torch").kernels:
        assert issubclass(registry.kernel_factory("torch", method), TorchMethod), method
    assert registry.paged_factory("torch", "fp16") is PagedTorch  # "*": every method torch serves
    spec = kvq_core.make_spec("oscar", head_dim=64)
    q = kvq_core.get_quantizer("oscar", backend="torch", head_dim=64)
    assert isinstance(q.kernels, calls.OpKernels) and q.kernels.backend == "torch" and q.spec == spec
    compiled = registry.kernel_factory("torch-compiled", "oscar")(spec)  # adapt: the same class, compiled
    assert type(compiled).__name__ == "CompiledMethod" and type(compiled.impl) is IntCodesTorch
