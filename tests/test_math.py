"""Tests of kvq_core.math primitives: Hadamard, signs, octahedral map and densities."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_core.errors import InputError, SpecError
from kvq_core.math import (
    fwht,
    hadamard_block,
    is_power_of_two,
    oct_decode,
    oct_density,
    oct_encode,
    oct_point_norm,
    octahedral_coordinate_pdf,
    polar_angle_pdf,
    polar_angle_support,
    random_signs,
    sphere_coordinate_pdf,
    splitmix64,
    sylvester_hadamard,
    triplet_norm_pdf,
)

POWERS = [2**k for k in range(11)]


# ---------------------------------------------------------------- Hadamard


@pytest.mark.parametrize("d", POWERS)
def test_hadamard_orthonormal_symmetric_pm(d: int) -> None:
    h = sylvester_hadamard(d)
    assert h.dtype == np.float64 and h.shape == (d, d)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_array_equal(np.abs(h) * np.sqrt(d), np.ones((d, d)))


def test_hadamard_natural_order_and_cached_readonly() -> None:
    h = sylvester_hadamard(128)
    i, j = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    popcount = np.vectorize(lambda v: bin(v).count("1"))(i & j)
    np.testing.assert_array_equal(h * np.sqrt(128), (-1.0) ** popcount)
    assert sylvester_hadamard(128) is h
    assert not h.flags.writeable
    with pytest.raises(ValueError):
        h[0, 0] = 0.0


@pytest.mark.parametrize("bad", [0, -4, 2.0, "8", True, None])
def test_hadamard_bad_d(bad: object) -> None:
    with pytest.raises(SpecError) as exc:
        sylvester_hadamard(bad)  # type: ignore[arg-type]
    assert exc.value.param == "d"


@pytest.mark.parametrize(("d", "block"), [(80, 16), (96, 32), (112, 16), (160, 32), (192, 64), (128, 128), (6, 2)])
def test_block_hadamard_of_non_power_of_two(d: int, block: int) -> None:
    """d = m * B (B the largest power of two dividing d): I_m (x) H_B, orthonormal, symmetric,
    the fast transform equal to the matrix, and every block mixing all of its B coordinates."""
    assert hadamard_block(d) == block
    h = sylvester_hadamard(d)
    np.testing.assert_array_equal(h, np.kron(np.eye(d // block), sylvester_hadamard(block)))
    np.testing.assert_allclose(h @ h, np.eye(d), atol=1e-12)
    x = np.random.default_rng(d).standard_normal((3, d))
    np.testing.assert_allclose(fwht(x), x @ h, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(fwht(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    e = fwht(np.eye(d)[block - 1])  # a unit vector spreads over exactly its block
    assert np.count_nonzero(e) == block and np.allclose(np.abs(e[:block]), block**-0.5)


def test_is_power_of_two() -> None:
    assert [n for n in range(-2, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]
    assert is_power_of_two(np.int64(256)) and not is_power_of_two(True) and not is_power_of_two(4.0)


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, 10),
    batch=st.lists(st.integers(0, 3), max_size=3),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_fwht_matches_dense(k: int, batch: list[int], dtype: type, seed: int) -> None:
    d = 2**k
    x = np.random.default_rng(seed).standard_normal((*batch, d)).astype(dtype)
    y = fwht(x)
    assert y.dtype == dtype and y.shape == x.shape
    ref = x.astype(np.float64) @ sylvester_hadamard(d)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(y, ref, atol=tol * max(1, np.sqrt(k)))
    np.testing.assert_allclose(fwht(y), x, atol=tol * max(1, np.sqrt(k)))


def test_fwht_dtypes_and_errors() -> None:
    assert fwht(np.ones(8, dtype=np.float16)).dtype == np.float32
    assert fwht(np.arange(8)).dtype == np.float64
    x = np.ones((2, 4))
    fwht(x)
    np.testing.assert_array_equal(x, np.ones((2, 4)))  # input untouched
    with pytest.raises(SpecError):
        fwht(np.ones((2, 0)))
    with pytest.raises(InputError):
        fwht(np.float64(1.0))
    with pytest.raises(InputError):
        fwht(np.ones(4, dtype=np.complex128))


# ---------------------------------------------------------------- signs


def _reference_sign(seed: int, layer: int, h: int, i: int) -> float:
    """Pure-Python transcription of the formula in random_signs' docstring."""
    mask = 2**64 - 1

    def sm(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    key = sm(sm(sm(seed) ^ layer) ^ h)
    return 1.0 if sm(key ^ i) >> 63 == 0 else -1.0


def test_splitmix64_known_value() -> None:
    # First output of the reference SplitMix64 generator seeded with 0.
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF


def test_signs_match_documented_formula() -> None:
    s = random_signs(2**64 - 1, 7, 3, 40)
    ref = [[_reference_sign(2**64 - 1, 7, h, i) for i in range(40)] for h in range(3)]
    np.testing.assert_array_equal(s, ref)


def test_signs_properties() -> None:
    s = random_signs(0, 0, 8, 1024)
    assert s.dtype == np.float32 and s.shape == (8, 1024)
    assert set(np.unique(s)) == {-1.0, 1.0}
    assert abs(s.mean()) < 0.1
    assert not s.flags.writeable
    np.testing.assert_array_equal(random_signs(0, 0, 8, 1024), s)
    # Prefix-consistent: independent of how many heads / coordinates are asked for.
    np.testing.assert_array_equal(random_signs(0, 0, 2, 100), s[:2, :100])
    assert np.mean(s[0] != s[1]) > 0.4
    assert np.mean(random_signs(0, 1, 8, 1024) != s) > 0.4
    assert np.mean(random_signs(1, 0, 8, 1024) != s) > 0.4


@pytest.mark.parametrize(
    "args,param",
    [((-1, 0, 1, 8), "seed"), ((0, -1, 1, 8), "layer"), ((0, 0, 0, 8), "kv_heads"),
     ((0, 0, 1, 0), "dim"), ((2**64, 0, 1, 8), "seed"), ((0.5, 0, 1, 8), "seed")],
)
def test_signs_bad_args(args: tuple, param: str) -> None:
    with pytest.raises(SpecError) as exc:
        random_signs(*args)
    assert exc.value.param == param


# ---------------------------------------------------------------- octahedral map


def _unit(v: list[float]) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    return a / np.linalg.norm(a)


FIXED_POINTS = [
    ([0, 0, 1], (0, 0)),
    ([0, 0, -1], (1, 1)),
    ([1, 0, 0], (1, 0)),
    ([-1, 0, 0], (-1, 0)),
    ([0, 1, 0], (0, 1)),
    ([0, -1, 0], (0, -1)),
    ([1, 1, 1], (1 / 3, 1 / 3)),
    ([1, 1, -1], (2 / 3, 2 / 3)),
    ([1, -2, -3], (2 / 3, -5 / 6)),
    ([-3, 2, -1], (-2 / 3, 1 / 2)),
    ([0.5, 0, -1], (1, 2 / 3)),
]


@pytest.mark.parametrize("n,e", FIXED_POINTS)
def test_oct_fixed_points(n: list[float], e: tuple[float, float]) -> None:
    np.testing.assert_allclose(oct_encode(_unit(n)), e, atol=1e-15)
    np.testing.assert_allclose(oct_decode(np.asarray(e, dtype=np.float64)), _unit(n), atol=1e-15)


def test_oct_zero_vector() -> None:
    np.testing.assert_array_equal(oct_encode(np.zeros((2, 3))), np.zeros((2, 2)))


def test_oct_round_trip_and_half_in_diamond() -> None:
    n = np.random.default_rng(1).standard_normal((100_000, 3))
    n /= np.linalg.norm(n, axis=1, keepdims=True)
    e = oct_encode(n)
    assert e.shape == (100_000, 2) and np.all(np.abs(e) <= 1)
    assert np.max(np.abs(oct_decode(e) - n)) < 1e-12
    assert abs(np.mean(np.abs(e).sum(axis=1) <= 1) - 0.5) < 0.01
    n32 = n.astype(np.float32)
    e32 = oct_encode(n32)
    d32 = oct_decode(e32)
    assert e32.dtype == np.float32 and d32.dtype == np.float32
    assert np.max(np.abs(d32 - n32)) < 1e-6


def test_oct_fold_continuity() -> None:
    corners = np.array([[1, 1], [1, -1], [-1, 1], [-1, -1]], dtype=np.float64)
    np.testing.assert_allclose(oct_decode(corners), np.tile([0, 0, -1], (4, 1)), atol=1e-15)
    t = np.linspace(-1, 1, 101)
    ones = np.ones_like(t)
    np.testing.assert_allclose(oct_decode(np.stack([ones, t], -1)), oct_decode(np.stack([ones, -t], -1)), atol=1e-15)
    np.testing.assert_allclose(oct_decode(np.stack([t, ones], -1)), oct_decode(np.stack([-t, ones], -1)), atol=1e-15)
    np.testing.assert_allclose(oct_decode(np.array([1.0, 0.3])), [0.919145, 0, -0.393919], atol=1e-6)
    equator = np.stack([t, 1 - np.abs(t)], -1)
    np.testing.assert_allclose(oct_decode(equator)[:, 2], 0, atol=1e-15)


def test_oct_bad_shapes() -> None:
    with pytest.raises(InputError):
        oct_encode(np.ones((4, 2)))
    with pytest.raises(InputError):
        oct_decode(np.ones(3))


def test_oct_density_ratio_and_integral() -> None:
    assert oct_density(1 / 3, 1 / 3) / oct_density(0.0, 0.0) == pytest.approx(3 * np.sqrt(3), rel=1e-12)
    assert oct_point_norm(1.0, 1.0) == pytest.approx(1.0)
    m = 1000
    g = (np.arange(m) + 0.5) / m * 2 - 1
    xi, eta = np.meshgrid(g, g)
    dens = oct_density(xi, eta)
    assert dens.sum() * (2 / m) ** 2 == pytest.approx(1.0, abs=1e-5)
    lattice = np.linspace(-1, 1, 601)  # contains 0, +-1/3 and +-1
    dens = oct_density(*np.meshgrid(lattice, lattice))
    assert dens.max() / dens.min() == pytest.approx(3 * np.sqrt(3), rel=1e-12)
    assert oct_density(np.float32(0.2), np.float32(0.1)).dtype == np.float32


# ---------------------------------------------------------------- densities


_GL_X, _GL_W = np.polynomial.legendre.leggauss(20)


def _integral(f, lo: float, hi: float, k: int = 0, points: list[float] | None = None) -> float:
    """Integral of x^k f(x) on [lo, hi]: 20-point Gauss-Legendre on 400 panels per piece between
    ``points``, after x = a + (b - a) sin^2(pi t / 2) on each piece (tames end singularities)."""
    edges = [lo, *sorted(p for p in (points or []) if lo < p < hi), hi]
    total = 0.0
    for a, b in zip(edges[:-1], edges[1:]):
        t0 = np.arange(400)[:, None] / 400
        t = t0 + (_GL_X + 1) / 800
        x = a + (b - a) * np.sin(np.pi * t / 2) ** 2
        dx = (b - a) * np.pi / 2 * np.sin(np.pi * t) * (_GL_W / 800)
        total += float(np.sum(x**k * f(x) * dx))
    return total


def test_octahedral_marginal_values() -> None:
    dens = octahedral_coordinate_pdf()
    f = dens.pdf
    assert (dens.lo, dens.hi) == (-1.0, 1.0)
    np.testing.assert_allclose(f(np.array([0.0, 1.0, -1.0])), 1 / np.pi, rtol=1e-14)
    np.testing.assert_allclose(f(np.array([1, 2, -1, -2]) / 3), 0.5694, atol=5e-5)
    # The spec's "peaks at +-1/3, +-2/3" is not right: the global maximum is at +-1/2.
    x = np.linspace(-1, 1, 20001)
    assert abs(abs(x[np.argmax(f(x))]) - 0.5) < 1e-3 and f(0.5) == pytest.approx(0.60021, abs=1e-5)
    np.testing.assert_allclose(f(x[x >= 0]), f(1 - x[x >= 0]), rtol=1e-13)  # mirror about 1/2
    pts = [-0.5, 0.0, 0.5]
    assert _integral(f, -1, 1, 0, pts) == pytest.approx(1.0, abs=1e-10)
    assert _integral(f, -1, 1, 2, pts) == pytest.approx(0.3201, abs=5e-5)
    assert f(1.5) == 0.0


@pytest.mark.parametrize("xi", [0.0, 0.1, 0.37, 0.5, 0.8, -0.6, 1.0])
def test_octahedral_marginal_is_integral_of_density(xi: float) -> None:
    kinks = sorted({0.0, 1 - abs(xi), abs(xi) - 1})
    ref = _integral(lambda e: oct_density(xi, e), -1, 1, 0, kinks)
    assert octahedral_coordinate_pdf().pdf(xi) == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize("d", [2, 3, 16, 128, 1024])
def test_sphere_coordinate_pdf(d: int) -> None:
    f = sphere_coordinate_pdf(d).pdf
    assert _integral(f, -1, 1) == pytest.approx(1.0, abs=1e-8)
    assert _integral(f, -1, 1, 2, [0.0]) == pytest.approx(1 / d, rel=1e-8)


@pytest.mark.parametrize("d", [4, 8, 64, 128, 256])
def test_triplet_norm_pdf(d: int) -> None:
    dens = triplet_norm_pdf(d)
    assert (dens.lo, dens.hi) == (0.0, 1.0)
    assert _integral(dens.pdf, 0, 1) == pytest.approx(1.0, abs=1e-8)
    assert _integral(dens.pdf, 0, 1, 2) == pytest.approx(3 / d, abs=1e-6)


def test_triplet_norm_mean_d128() -> None:
    assert _integral(triplet_norm_pdf(128).pdf, 0, 1, 1) == pytest.approx(0.14132, abs=5e-6)


def test_polar_angle_pdf() -> None:
    assert polar_angle_support(1) == (0.0, 2 * np.pi)
    assert polar_angle_support(3) == (0.0, np.pi / 2)
    f1 = polar_angle_pdf(1).pdf
    np.testing.assert_allclose(f1(np.array([0.0, 3.0, 6.0])), 1 / (2 * np.pi))
    for level in (2, 3, 4, 8):
        f = polar_angle_pdf(level).pdf
        assert _integral(f, 0, np.pi / 2, 0, [np.pi / 4]) == pytest.approx(1.0, abs=1e-10)
        psi = np.linspace(0, np.pi / 4, 50)
        np.testing.assert_allclose(f(psi), f(np.pi / 2 - psi), rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(polar_angle_pdf(2).pdf(np.array([0.3])), np.sin(0.6))


@pytest.mark.parametrize(
    "call,param",
    [(lambda: sphere_coordinate_pdf(1), "d"), (lambda: triplet_norm_pdf(3), "d"),
     (lambda: polar_angle_pdf(0), "level"), (lambda: polar_angle_support(17), "level"),
     (lambda: sphere_coordinate_pdf(64.0), "d")],
)
def test_density_bad_args(call, param: str) -> None:
    with pytest.raises(SpecError) as exc:
        call()
    assert exc.value.param == param


@settings(max_examples=30, deadline=None)
@given(k=st.integers(4, 9), seed=st.integers(0, 2**31))
def test_scores_invariant_under_rotation(k: int, seed: int) -> None:
    """(Rq)·(Rk) = q·k for the plain and the random-sign Hadamard (specs/oscar.md 6.2)."""
    from kvq_core.math.signs import random_signs

    d = 2**k
    rng = np.random.default_rng(seed)
    q, keys = rng.standard_normal(d), rng.standard_normal((5, d))
    exact = keys @ q
    np.testing.assert_allclose(fwht(keys) @ fwht(q), exact, atol=1e-12 * d)
    s = random_signs(seed, 3, 1, d)[0].astype(np.float64)
    np.testing.assert_allclose(fwht(keys * s) @ fwht(q * s), exact, atol=1e-12 * d)
