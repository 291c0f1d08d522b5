"""The public conformance suite (kvq_core.testing) run against every registered backend.

The backends come from ``registry.list_backends()`` (kvq's entry points and any installed
plugin's), not a hand-kept list. numpy checks the suite against itself (and the typed errors);
torch (eager kvq:: ops) draws the full strategy; torch-compiled (inductor) uses a few fixed-shape
cases per method so the number of compiled graphs stays bounded (5 per method); others draw
``DEFAULT_SETTINGS``. A backend unavailable here (triton without a GPU or its interpreter) is
skipped with its reason (tests/test_triton.py runs it under the interpreter in a child process);
a backend that is available but fails is a failure.
"""
from __future__ import annotations

import importlib.util

import pytest

from kvq_core import registry, testing

HAS_TORCH = importlib.util.find_spec("torch") is not None
#: every registered backend, available or not (an unavailable one is skipped with its reason)
BACKENDS = [b.name for b in registry.list_backends()]
DEFAULT_SETTINGS = dict(max_examples=10)
#: methods whose torch kernels mirror the reference's float32 arithmetic op for op (no float
#: reductions in a different order), so their codes must match with no tie excuse at all.
EXACT_ON_TORCH = {"fp16", "kivi"}

SETTINGS = {
    "numpy": dict(max_examples=6),
    "torch": dict(max_examples=15),
    # numba's CPU encoders sum in NumPy's pairwise order and mirror the reference's float32
    # arithmetic, so its codes must be bit-identical, ties included
    "numba": dict(max_examples=12, exact_codes=True),
    # one graph per kernel: fixed batch/heads/head_dim/GQA/q_len, default spec, token counts
    # that are neither multiples of any group size nor below one (no size-1 specialisation)
    "torch-compiled": dict(max_examples=2, head_dims=(64,), batches=(1,), kv_heads=(2,), gqa=(2,), q_lens=(1,),
                           tokens=(45, 70, 100), spec_params={}, errors=False, ties=False),
}
#: torch-compiled skips the exact-tie check (5 more graphs per method, ~20 s each to compile
#: here): its encoders are the eager kernels' code, and test_torch_ops checks compiled codes
#: bit-identical to eager ones, which the tie check pins.
#: torch-compiled: the specs of the fixed edge cases per method (default: the default spec).
#: OScaR's packed-code attend runs only under torch.compile, so a second spec (4 bits, groups
#: of 16, no token scaling or rotation) reaches its other branches; 5 more graphs.
COMPILED_FIXED_SPECS = {"oscar": [{}, testing.EDGE_SPECS["oscar"]]}


def _params():
    for backend in BACKENDS:
        marks = [pytest.mark.compile] if backend == "torch-compiled" else []
        ok, reason = registry.backend_status(backend)
        if not ok:
            yield pytest.param(backend, None, marks=pytest.mark.skip(reason=f"{backend} unavailable: {reason}"),
                               id=backend)
            continue
        for method in testing.methods_for(backend):
            yield pytest.param(backend, method, marks=marks, id=f"{backend}-{method}")


def test_reference_backends_are_registered() -> None:
    names = set(BACKENDS)
    assert {"numpy"} <= names and (not HAS_TORCH or {"torch", "torch-compiled"} <= names), names


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_registered(backend: str) -> None:
    ok, reason = registry.backend_status(backend)
    if not ok:
        assert reason, f"{backend} is unavailable without a reason"
        pytest.skip(f"{backend} unavailable: {reason}")
    assert testing.methods_for(backend), f"{backend} implements no method of the reference"


@pytest.mark.parametrize(("backend", "method"), list(_params()))
def test_conformance(backend: str, method: str) -> None:
    kwargs = dict(SETTINGS.get(backend, DEFAULT_SETTINGS))
    if backend == "torch-compiled" and method in COMPILED_FIXED_SPECS:
        kwargs["fixed_specs"] = COMPILED_FIXED_SPECS[method]
    if backend.startswith("torch") and method in EXACT_ON_TORCH:
        kwargs["exact_codes"] = True
    report = testing.check_method(backend, method, **kwargs)
    assert report.examples > 0


def test_spec_params_draw_every_parameter() -> None:
    """Every parameter of every built-in method (but head_dim) is drawn by the suite."""
    import dataclasses

    for method, params in testing.SPEC_PARAMS.items():
        fields = {f.name for f in dataclasses.fields(registry.method_info(method).spec_cls)} - {"head_dim"}
        assert set(params) == fields, f"{method}: SPEC_PARAMS draws {sorted(params)}; the spec has {sorted(fields)}"
    assert set(testing.SPEC_PARAMS) == {m.name for m in registry.list_methods()}


def test_suite_catches_a_wrong_rounding_mode(monkeypatch) -> None:
    """The suite is not vacuous: a backend rounding half away from zero fails on exact ties."""
    pytest.importorskip("torch")
    import torch

    import kvq_torch.common as common

    def round_half_away(x, *a, **k):
        return torch.sign(x) * torch.floor(torch.abs(x) + 0.5)

    monkeypatch.setattr(common.torch, "round", round_half_away)
    try:
        with pytest.raises(testing.ConformanceError, match="codes"):
            testing.check_method("torch", "kivi", max_examples=0, exact_codes=True, errors=False,
                                 regimes=("integers",), dtypes=("float32",))
    finally:
        monkeypatch.undo()


def test_suite_catches_an_off_by_one_code(monkeypatch) -> None:
    """A code off by one step (not a tie) fails even with the tie rule on (the exact-tie check,
    which would catch it first, is off here)."""
    pytest.importorskip("torch")
    import kvq_torch.common as common

    orig = common.pack_codes

    def bad_pack(codes, bits):
        codes = codes.clone()
        flat = codes.reshape(-1)
        flat[0] = (flat[0] + 1) % (1 << bits)
        return orig(codes, bits)

    monkeypatch.setattr("kvq_torch.intcodes.pack_codes", bad_pack)
    with pytest.raises(testing.ConformanceError, match="not ties"):
        testing.check_method("torch", "oscar", max_examples=0, errors=False, ties=False)
