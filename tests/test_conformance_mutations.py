"""The conformance suite is not vacuous: single realistic kernel bugs, applied to the torch
backend with monkeypatch, each make it raise ConformanceError.

The bug classes are those a mutation study of the torch backend found surviving the suite
before it drew layers, secondary spec parameters and non-default compiled specs, plus a
rounding-mode bug that only the exact-tie check (not ``exact_codes``) must catch:

- ``attend`` built with layer 0's constants (a kernel that caches constants per spec only);
- an OCTOPUS direction index striding by the xi codebook's size instead of eta's (equal at
  the default bits, wrong whenever ``xi_bits != eta_bits``);
- OScaR's packed-code ``attend``, which runs only under ``torch.compile``, with its code mask
  written for the default 2 bits;
- round half away from zero instead of half to even in the integer-grid quantizer.

Each check runs the suite's fixed cases only (``max_examples=0``), so it is fast and does not
depend on what the random draw happens to contain.
"""
from __future__ import annotations

import inspect
import textwrap
from typing import Any

import numpy as np
import pytest

from kvq_core import registry, testing

torch = pytest.importorskip("torch")

FIXED_ONLY = dict(max_examples=0, errors=False)


def mutate(fn: Any, old: str, new: str, occurrences: int = 1, **extra: Any) -> Any:
    """``fn`` recompiled from its source with ``old`` replaced by ``new`` (``old`` must occur
    exactly ``occurrences`` times), in its module's globals plus ``extra``."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == occurrences, f"mutation target {old!r} not found {occurrences}x in {fn.__qualname__}"
    scope = {**fn.__globals__, **extra}
    exec(compile(src.replace(old, new), inspect.getsourcefile(fn), "exec"), scope)  # noqa: S102
    return scope[fn.__name__]


def layer0_attend(orig: Any) -> Any:
    """``attend`` that reads layer 0's constants whatever the layer (the kernel's only bug)."""

    def attend(self, q, kfields, vfields, ctx, scale):
        consts = {n: torch.from_numpy(np.array(a)).to(q.device) for n, a in self.spec.constants(ctx.shape[1], 0).items()}
        return orig(self, q, kfields, vfields, ctx._replace(consts=consts), scale)

    return attend


@pytest.mark.parametrize(("method", "module", "cls"), [
    ("octopus", "kvq_torch.octopus", "OctopusTorch"),
    ("polarquant", "kvq_torch.polarquant", "PolarQuantTorch"),
    ("qjl", "kvq_torch.qjl", "QJLTorch"),
    ("turboquant", "kvq_torch.turboquant", "TurboQuantTorch"),
    ("turboquant_prod", "kvq_torch.turboquant", "TurboQuantProdTorch"),
])
def test_wrong_layer_constants_in_attend_fail(monkeypatch, method: str, module: str, cls: str) -> None:
    import importlib

    klass = getattr(importlib.import_module(module), cls)
    testing.check_method("torch", method, **FIXED_ONLY)  # the unmutated kernel passes
    monkeypatch.setattr(klass, "attend", layer0_attend(klass.attend))
    with pytest.raises(testing.ConformanceError, match="attend"):
        testing.check_method("torch", method, **FIXED_ONLY)


def test_octopus_uneven_bits_stride_fails(monkeypatch) -> None:
    import kvq_torch.octopus as octopus

    bad = mutate(octopus.direction_index, 'consts["eta_codebook"].shape[0]', 'consts["xi_codebook"].shape[0]')
    monkeypatch.setattr(octopus, "direction_index", bad)
    testing.check_method("torch", "octopus", spec_params={}, fixed_specs=[{}], **FIXED_ONLY)  # survives at default bits
    with pytest.raises(testing.ConformanceError, match="codes"):
        testing.check_method("torch", "octopus", **FIXED_ONLY)


@pytest.mark.compile
def test_compiled_only_attend_path_fails_off_the_default_spec(monkeypatch) -> None:
    from kvq_torch.intcodes import IntCodesTorch

    ok, why = registry.backend_status("torch-compiled")
    if not ok:
        pytest.skip(why)
    bad = mutate(IntCodesTorch._attend_packed, "per, mask = 8 // bits, (1 << bits) - 1", "per, mask = 8 // bits, 3")
    monkeypatch.setattr(IntCodesTorch, "_attend_packed", bad)
    # compiled kernels are cached per (spec, kernel, batch, kv_heads): 3 KV heads is a shape no
    # other test compiles, so the mutated code is compiled afresh
    settings = dict(FIXED_ONLY, head_dims=(64,), batches=(1,), kv_heads=(3,), gqa=(1,), q_lens=(1,), tokens=(45,),
                    spec_params={}, ties=False)
    with pytest.raises(testing.ConformanceError, match="attend"):
        testing.check_method("torch-compiled", "oscar", fixed_specs=[testing.EDGE_SPECS["oscar"]], **settings)


def round_half_away(x: Any) -> Any:
    return torch.sign(x) * torch.floor(torch.abs(x) + 0.5)


@pytest.mark.parametrize("method", ["oscar", "kivi", "quarot"])
def test_round_half_away_fails_without_exact_codes(monkeypatch, method: str) -> None:
    """The tie check pins round-half-to-even by design: the default settings (tie rule on,
    no ``exact_codes``) catch a quantizer rounding half away from zero."""
    import kvq_torch.common as common
    import kvq_torch.intcodes as mod

    bad = mutate(common.asym_quantize, "torch.round(", "round_half_away(", 3, round_half_away=round_half_away)
    monkeypatch.setattr(mod, "asym_quantize", bad)
    with pytest.raises(testing.ConformanceError, match=r"codes .*\(exact\)"):
        testing.check_method("torch", method, edge_cases=False, **FIXED_ONLY)
