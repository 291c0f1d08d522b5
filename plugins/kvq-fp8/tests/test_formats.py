"""The exact FP8 rounding of the NumPy reference against two independent implementations."""
from __future__ import annotations

import numpy as np
import pytest

from kvq_fp8.formats import FORMATS


def _probe_values(name: str) -> np.ndarray:
    """Every representable value, every midpoint between neighbours and the float32 on either
    side of it, values past the largest finite one, and 400k random magnitudes; both signs."""
    f = FORMATS[name]
    m = f.magnitudes
    mids = ((m[1:] + m[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    xs = np.concatenate([
        m.astype(np.float32), mids,
        np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)),
        np.float32([f.max * 1.03, f.max * 1.07, f.max * 4, 3e38, 1e-30, 0.0]),
        rng.uniform(0, f.max, 200_000).astype(np.float32),
        np.exp(rng.uniform(-25, np.log(f.max), 200_000)).astype(np.float32),
    ])
    return np.concatenate([xs, -xs])


def test_the_formats_are_the_ocp_ones() -> None:
    e4, e5 = FORMATS["e4m3"], FORMATS["e5m2"]
    assert (e4.max, e4.magnitudes[1], len(e4.magnitudes)) == (448.0, 2.0**-9, 127)
    assert (e5.max, e5.magnitudes[1], len(e5.magnitudes)) == (57344.0, 2.0**-16, 124)
    assert np.all(np.diff(e4.magnitudes) > 0) and np.all(np.diff(e5.magnitudes) > 0)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_rounding_is_nearest_ties_to_even_and_saturating(name: str) -> None:
    f = FORMATS[name]
    m = f.magnitudes
    # 1.5 * 2**-k style ties: the midpoint of codes 8 and 9 goes to the even code 8, of 9 and 10 to 10
    assert f.encode(np.float32((m[8] + m[9]) / 2)) == 8 and f.encode(np.float32((m[9] + m[10]) / 2)) == 10
    assert f.encode(np.float32(f.max * 1.5)) == f.max_code  # saturates, no Inf/NaN code
    assert f.encode(np.float32(-f.max * 1.5)) == 0x80 | f.max_code
    assert f.encode(np.float32(-0.0)) == 0x80 and f.encode(np.float32(0.0)) == 0
    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) <= f.max_code
    assert np.array_equal(f.encode(f.decode(codes[finite])), codes[finite])  # decode then encode is the identity
    assert np.isnan(f.decode(codes[~finite])).all()


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_reference_equals_ml_dtypes(name: str) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    f = FORMATS[name]
    dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[name]
    xs = _probe_values(name)
    theirs = np.clip(xs, -f.max, f.max).astype(dtype)  # ml_dtypes does not saturate: clip first
    ours = f.encode(xs)
    assert np.array_equal(ours, theirs.view(np.uint8)), int((ours != theirs.view(np.uint8)).sum())
    assert np.array_equal(f.decode(ours), theirs.astype(np.float32))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_reference_equals_torch(name: str) -> None:
    torch = pytest.importorskip("torch")
    from kvq_fp8.torch_kernels import DTYPES

    f = FORMATS[name]
    xs = _probe_values(name)
    theirs = torch.clamp(torch.from_numpy(xs), -f.max, f.max).to(DTYPES[name])
    ours = f.encode(xs)
    assert np.array_equal(ours, theirs.view(torch.uint8).numpy())
    assert np.array_equal(f.decode(ours), theirs.float().numpy())
