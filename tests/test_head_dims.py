"""Head dims that are multiples of 16 but not powers of two (Phi-3 has 96, GPT-NeoX
/Pythia 80): every method builds a spec, quantizes with honest bits, and every built-in backend
stays conformant with the NumPy reference there (block-diagonal Hadamard rotations, OCTOPUS's
scalar-coded tail, channel groups that divide head_dim)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import kvq_core
from kvq_core import testing
from kvq_core.errors import SpecError
from kvq_core.spec import channel_group

HEAD_DIMS = (96, 80)
HAS_TORCH = importlib.util.find_spec("torch") is not None
METHODS = testing.methods_for("numpy")


def _params():
    for backend in ("torch", "torch-compiled"):
        marks = [pytest.mark.compile] if backend == "torch-compiled" else []
        if not HAS_TORCH:
            marks.append(pytest.mark.skip(reason="torch is not installed"))
        # compiled: the eager code under inductor, at one non-power-of-two head dim (~40 s of cold compile a case)
        for d in HEAD_DIMS if backend == "torch" else HEAD_DIMS[1:]:
            for method in METHODS:
                yield pytest.param(backend, method, d, marks=marks, id=f"{backend}-{method}-{d}")


@pytest.mark.parametrize(("backend", "method", "head_dim"), list(_params()))
def test_conformance_at_head_dim(backend: str, method: str, head_dim: int) -> None:
    if backend == "torch":
        kwargs = dict(max_examples=4)
    else:  # one compiled graph per kernel, as in test_conformance
        kwargs = dict(max_examples=1, batches=(1,), kv_heads=(2,), gqa=(2,), q_lens=(1,), tokens=(45,),
                      spec_params={}, errors=False)
    report = testing.check_method(backend, method, head_dims=(head_dim,), **kwargs)
    assert report.examples > 0


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("head_dim", [64, 128, 112])
def test_octopus_scalar_tail_conformance(head_dim: int) -> None:
    """The scalar tail at power-of-two head dims too (opt-in there: ``tail="scalar"``). Not in
    the suite's default draw, which plugin backends run and need not support it."""
    params = {"tail": ("scalar",), "bits": (2, 3, 4), "rounding": ("joint", "plain"), "values": ("octopus", "fp16")}
    report = testing.check_method("torch", "octopus", max_examples=4, head_dims=(head_dim,), spec_params=params)
    assert report.examples > 0


def _round_trip(method: str, head_dim: int) -> tuple[float, float]:
    """(relative MSE of keys, bits per element) of the default spec on Gaussian keys."""
    q = kvq_core.get_quantizer(method, backend="numpy", head_dim=head_dim)
    x = np.random.default_rng(head_dim).standard_normal((1, 2, 64, head_dim)).astype(np.float32)
    pk = q.encode_keys(x)
    return float(((q.decode_keys(pk) - x) ** 2).sum() / (x**2).sum()), q.bits_per_element(pk)


@pytest.mark.parametrize("head_dim", HEAD_DIMS + (112, 160))
@pytest.mark.parametrize("method", METHODS)
def test_every_method_quantizes_at_head_dim(method: str, head_dim: int) -> None:
    """Default spec: key error within 10% of the same method's worst at head_dim 64/128/256,
    and a real compression (the layout's bytes, under 5 bits per element). QJL is excluded from
    the error bound: its fixed 256-row sketch gets relatively coarser as head_dim grows."""
    rel, bits = _round_trip(method, head_dim)
    if method == "fp16":
        assert rel < 1e-6 and bits == 16
        return
    assert bits < 5, (method, bits)
    if method != "qjl":
        assert rel < 1.1 * max(_round_trip(method, d)[0] for d in (64, 128, 256)), (method, rel)


def test_octopus_scalar_tail_saves_the_padded_triplet() -> None:
    """At d=112 (d mod 3 = 1) the scalar tail stores 37 triplets + 1 scalar code instead of 38
    triplets: fewer bytes and a lower MSE than padding (a 1-coordinate 'triplet' fits the
    triplet-norm codebook badly); at power-of-two d the paper's padding stays the default."""
    assert kvq_core.make_spec("octopus", head_dim=128).tail == "pad"
    assert kvq_core.make_spec("octopus", head_dim=112).tail == "scalar"
    x = np.random.default_rng(0).standard_normal((1, 2, 1000, 112)).astype(np.float32)
    out = {}
    for tail in ("pad", "scalar"):
        q = kvq_core.get_quantizer("octopus", backend="numpy", head_dim=112, bits=3, tail=tail)
        pk = q.encode_keys(x)
        out[tail] = (q.bits_per_element(pk), float(((q.decode_keys(pk) - x) ** 2).sum() / (x**2).sum()))
    # bytes per row: ceil((38 * 10) / 8) = 48 vs ceil((37 * 10 + 3) / 8) = 47, plus the fp32 norm
    assert out["pad"][0] == pytest.approx((48 + 4) * 8 / 112)
    assert out["scalar"][0] == pytest.approx((47 + 4) * 8 / 112)
    assert out["scalar"][1] < out["pad"][1]


def test_channel_groups_follow_head_dim() -> None:
    assert [channel_group(32, d) for d in (64, 80, 96, 112, 128, 16)] == [32, 16, 32, 16, 32, 16]
    assert channel_group(128, 80) == 80 and channel_group(128, 96) == 96 and channel_group(128, 160) == 32
    assert kvq_core.make_spec("kivi", head_dim=80).group == 16
    assert kvq_core.make_spec("oscar", head_dim=80).value_group == 16
    assert kvq_core.make_spec("qjl", head_dim=96).value_group == 32
    with pytest.raises(SpecError, match="group=32.*divisor of head_dim=80"):
        kvq_core.make_spec("kivi", head_dim=80, group=32)


def test_fidelity_bench_reports_the_rotation_cost_at_96(tmp_path) -> None:
    from kvq_core.tools.bench import fidelity

    fidelity.main(["--tokens", "64", "--kv-heads", "2", "--head-dims", "96", "128", "--bits", "2", "--no-plot",
                   "--out", str(tmp_path)])
    md = (tmp_path / "fidelity.md").read_text()
    section = md.split("## Block-diagonal rotation: head_dim 96 against 128", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| 2 |")]
    assert {r.split(" | ")[1] for r in rows} >= {"octopus", "oscar", "turboquant", "polarquant", "quarot"}
    ratios = [float(x) for r in rows for x in r.strip(" |").split(" | ")[3:]]
    assert len(ratios) == 6 * len(rows) and all(0.3 < x < 3 for x in ratios)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_octopus_short_code_rows_conform_on_numba(head_dim: int) -> None:
    """Numba reads OCTOPUS codes with 8-byte loads, the last ones moved back to end with the row, and
    rows under 8 bytes byte by byte: small head dims exercise all three (16 at b=2: 6-byte rows; at b=3:
    exactly 8; 32: the moved-back tail loads; 64 and 128 are in the suite's draw)."""
    report = testing.check_method("numba", "octopus", max_examples=12, head_dims=(head_dim,),
                                  spec_params={"bits": (2, 3, 4), "values": ("octopus", "fp16")})
    assert report.examples > 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_octopus_grouped_code_loads_conform_on_numba(head_dim: int) -> None:
    """Numba decodes the default triplet splits in groups with constant shifts (b=3: four 10-bit codes per five
    bytes, one load; b=2: eight 7-bit codes per seven; b=4: eight 13-bit codes per 13 bytes, two loads), every
    triplet one 16-byte move spilling past the row's end: the suite's draw at the model head dims with those
    splits pinned, so every grouped path runs."""
    report = testing.check_method("numba", "octopus", max_examples=8, head_dims=(head_dim,),
                                  spec_params={"bits": (2, 3, 4), "xi_bits": (None,), "eta_bits": (None,),
                                               "rho_bits": (None,), "values": ("octopus",)})
    assert report.examples > 0


def test_turboquant_grouped_code_loads_conform_on_numba() -> None:
    """TurboQuant's three coordinate codes per triplet (6, 9 and 12 bits at b=2/3/4) take the same grouped
    loads as OCTOPUS's triplets: the suite's draw at head_dim 64 with every width."""
    report = testing.check_method("numba", "turboquant", max_examples=6, head_dims=(64,),
                                  spec_params={"bits": (2, 3, 4)})
    assert report.examples > 0


def test_group_plans_place_every_code() -> None:
    """Each grouped width's plan reads code ``k`` of a group from bit ``k * bits`` of the group, inside one of
    at most two 8-byte loads, over whole bytes."""
    from kvq_numba.cpu.octopus_codes import GROUPED_WIDTHS, group_plan

    for bits in GROUPED_WIDTHS:
        n, nb, loads, sel, shifts = group_plan(bits)
        assert n * bits == 8 * nb and 1 <= n <= 8 and len(sel) == len(shifts) == n
        for k in range(n):
            assert 8 * loads[sel[k]] + shifts[k] == k * bits and 0 <= shifts[k] and shifts[k] + bits <= 64
    assert group_plan(10)[:3] == (4, 5, (0, 0)) and group_plan(9)[:3] == (8, 9, (0, 7))
