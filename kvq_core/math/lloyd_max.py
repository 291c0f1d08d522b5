"""Scalar codebooks: the 1-D Lloyd-Max (MSE-optimal) quantiser of an exact density.

Conditions at the fixed point: every threshold is the midpoint of its two centroids and every
centroid is the conditional mean of its cell. The cell integrals come from a high-order
quadrature table, so the codebooks match the spec's reference numbers to 5+ digits.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvq_core.errors import InputError, KVQError, SpecError
from kvq_core.math.densities import Density, int_param

__all__ = ["Codebook", "lloyd_max", "uniform_codebook"]

_PANELS = 2**17
_GL_X, _GL_W = np.polynomial.legendre.leggauss(4)
_GL_X = (_GL_X + 1) / 2  # Gauss-Legendre nodes and weights on [0, 1]
_GL_W = _GL_W / 2


@dataclass(frozen=True, eq=False)
class Codebook:
    """A scalar quantiser: ascending ``centroids`` and the midpoints between them.

    ``mse`` is the expected squared error per scalar under the density it was fitted to.
    Arrays are float64 and read-only.
    """

    centroids: np.ndarray
    thresholds: np.ndarray
    mse: float
    name: str

    def __post_init__(self) -> None:
        c = np.array(self.centroids, dtype=np.float64).reshape(-1)
        t = np.array(self.thresholds, dtype=np.float64).reshape(-1)
        if c.size < 1 or t.size != c.size - 1:
            raise InputError(f"Codebook {self.name}: need K >= 1 centroids and K-1 thresholds")
        if np.any(np.diff(c) <= 0) or np.any(t <= c[:-1]) or np.any(t >= c[1:]):
            raise InputError(f"Codebook {self.name}: centroids/thresholds not strictly interleaved")
        c.flags.writeable = False
        t.flags.writeable = False
        object.__setattr__(self, "centroids", c)
        object.__setattr__(self, "thresholds", t)
        object.__setattr__(self, "mse", float(self.mse))

    @property
    def levels(self) -> int:
        """Number of centroids K."""
        return int(self.centroids.size)

    @property
    def bits(self) -> int:
        """Bits needed to store one index: ceil(log2 K)."""
        return (self.levels - 1).bit_length()

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Index (np.intp) of the nearest centroid of each value.

        A value exactly on a threshold goes to the upper cell (``searchsorted(side='right')``);
        values beyond the outer centroids clamp to the end cells; NaN maps to the last cell.
        """
        return np.searchsorted(self.thresholds, np.asarray(x), side="right")

    def dequantize(self, idx: np.ndarray) -> np.ndarray:
        """Centroid values (float64) for integer indices in ``[0, levels)``."""
        i = np.asarray(idx)
        if i.dtype.kind not in "iu":
            raise InputError(f"Codebook {self.name}: indices must be integers, got {i.dtype}")
        if i.size and (i.min() < 0 or i.max() >= self.levels):
            raise InputError(f"Codebook {self.name}: indices must lie in [0, {self.levels})")
        return self.centroids[i]


def uniform_codebook(lo: float, hi: float, levels: int, name: str) -> Codebook:
    """Uniform grid on ``[lo, hi)``: cell midpoints, mse = width^2/12 of a uniform density.

    Used for PolarQuant's level-1 angle, which is uniform on [0, 2 pi).
    """
    levels = int_param("uniform_codebook", "levels", levels, 1)
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise SpecError("uniform_codebook", "hi", hi, f"finite and > lo={lo!r}")
    width = (hi - lo) / levels
    centroids = lo + width * (np.arange(levels) + 0.5)
    return Codebook(centroids, (centroids[:-1] + centroids[1:]) / 2, width**2 / 12, name)


class _MomentTable:
    """Cumulative integrals of (x - x0)^k f(x), k = 0, 1, 2, evaluated anywhere to quadrature accuracy.

    The variable change x = lo + (hi - lo) sin^2(pi t / 2) clusters nodes at the support ends,
    which makes integrable end singularities (e.g. the arcsine law at d = 2) harmless. Each of
    the ``_PANELS`` panels in t uses 4-point Gauss-Legendre. Cells left of the median ``x0`` use
    integrals from ``lo``, cells right of it integrals to ``hi``, so tail cells lose no digits.
    """

    def __init__(self, density: Density) -> None:
        self.density = density
        self.lo, self.hi = float(density.lo), float(density.hi)
        n = _PANELS
        self.h = 1.0 / n
        self.t0 = np.arange(n + 1) * self.h
        x, w = self._nodes(self.t0[:-1, None], self.h)
        f = self.density.pdf(x)
        f_w = f * w
        cum0 = np.concatenate(([0.0], np.cumsum(f_w.sum(axis=1))))
        self.x_nodes = self._x(self.t0)
        self.x0 = float(np.interp(0.5 * cum0[-1], cum0, self.x_nodes))
        panel = np.stack([(f_w * (x - self.x0) ** k).sum(axis=1) for k in range(3)])
        zero = np.zeros((3, 1))
        self.left = np.concatenate((zero, np.cumsum(panel, axis=1)), axis=1)
        self.right = np.concatenate((np.cumsum(panel[:, ::-1], axis=1)[:, ::-1], zero), axis=1)
        self.cbrt_cum = np.concatenate(([0.0], np.cumsum((np.cbrt(f) * w).sum(axis=1))))

    def _x(self, t: np.ndarray) -> np.ndarray:
        return self.lo + (self.hi - self.lo) * np.sin(0.5 * np.pi * t) ** 2

    def _nodes(self, start: np.ndarray, length: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """Quadrature abscissae x and weights (including dx/dt) on [start, start + length] in t."""
        t = start + np.multiply(length, _GL_X)
        w = np.multiply(length, _GL_W) * (self.hi - self.lo) * 0.5 * np.pi * np.sin(np.pi * t)
        return self._x(t), w

    def _t(self, x: np.ndarray) -> np.ndarray:
        u = np.clip((x - self.lo) / (self.hi - self.lo), 0.0, 1.0)
        return (2 / np.pi) * np.arctan2(np.sqrt(u), np.sqrt(1 - u))

    def cumulative(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Moments (3, len(x)) from lo to x and from x to hi."""
        tau = self._t(x)
        j = np.minimum((tau / self.h).astype(np.int64), _PANELS - 1)
        xs, w = self._nodes(self.t0[j, None], (tau - self.t0[j])[:, None])
        with np.errstate(invalid="ignore"):  # an end singularity times a zero-length panel
            f_w = np.where(w > 0, self.density.pdf(xs) * w, 0.0)
        part = np.stack([(f_w * (xs - self.x0) ** k).sum(axis=1) for k in range(3)])
        left = self.left[:, j] + part
        right = self.right[:, j] - part
        return left, right

    def cells(self, edges: np.ndarray) -> np.ndarray:
        """Moments (3, K) of the K cells between consecutive ``edges`` (lo, thresholds, hi)."""
        left, right = self.cumulative(edges)
        use_right = edges[:-1] >= self.x0
        return np.where(use_right, right[:, :-1] - right[:, 1:], left[:, 1:] - left[:, :-1])

    def companding_init(self, levels: int) -> np.ndarray:
        """Centroids at the quantiles (k + 1/2)/K of f^(1/3), the high-resolution optimum."""
        q = (np.arange(levels) + 0.5) / levels * self.cbrt_cum[-1]
        return np.interp(q, self.cbrt_cum, self.x_nodes)


@functools.lru_cache(maxsize=64)
def _moment_table(density: Density) -> _MomentTable:
    return _MomentTable(density)


def _solve_tridiagonal(
    lower: np.ndarray, diag: np.ndarray, upper: np.ndarray, rhs: np.ndarray
) -> np.ndarray | None:
    """Thomas algorithm for A x = rhs with A[k, k-1] = lower[k-1], A[k, k] = diag[k] and
    A[k, k+1] = upper[k]; None if a pivot vanishes."""
    n = diag.size
    d, r = diag.astype(np.float64), rhs.astype(np.float64)
    for k in range(1, n):
        if d[k - 1] == 0:
            return None
        m = lower[k - 1] / d[k - 1]
        d[k] -= m * upper[k - 1]
        r[k] -= m * r[k - 1]
    if d[-1] == 0:
        return None
    x = np.empty(n)
    x[-1] = r[-1] / d[-1]
    for k in range(n - 2, -1, -1):
        x[k] = (r[k] - upper[k] * x[k + 1]) / d[k]
    return x


def _newton_lloyd_step(table: _MomentTable, c: np.ndarray) -> np.ndarray:
    """One Newton step on the Lloyd fixed point c = T(c); a plain Lloyd step T(c) if Newton fails.

    T_k(c) is the conditional mean of the cell between the midpoints around c_k.
    """
    edges = np.concatenate(([table.lo], (c[:-1] + c[1:]) / 2, [table.hi]))
    m0, m1, _ = table.cells(edges)
    ok = m0 > 0
    safe = np.where(ok, m0, 1.0)
    t_c = np.where(ok, table.x0 + m1 / safe, (edges[:-1] + edges[1:]) / 2)
    thr = edges[1:-1]
    f_thr = table.density.pdf(thr)
    a = np.zeros_like(c)  # dT_k / d(lower edge of cell k); lo is fixed
    b = np.zeros_like(c)  # dT_k / d(upper edge of cell k); hi is fixed
    a[1:] = np.where(ok[1:], f_thr * (t_c[1:] - thr) / safe[1:], 0.0)
    b[:-1] = np.where(ok[:-1], f_thr * (thr - t_c[:-1]) / safe[:-1], 0.0)
    # Newton on F(c) = T(c) - c: (I - J) delta = T(c) - c with J = dT/dc tridiagonal.
    delta = _solve_tridiagonal(-a[1:] / 2, 1 - (a + b) / 2, -b[:-1] / 2, t_c - c)
    if delta is None or not np.all(np.isfinite(delta)):
        return t_c
    newton = c + delta
    inside = np.all(np.diff(newton) > 0) and newton[0] > table.lo and newton[-1] < table.hi
    return newton if inside else t_c


def lloyd_max(density: Density, levels: int, *, tol: float = 1e-12, max_iter: int = 10000) -> Codebook:
    """MSE-optimal ``levels``-point scalar quantiser of ``density`` (Lloyd-Max fixed point).

    Starts from the f^(1/3) companding quantiles (symmetric for a symmetric density) and
    iterates the Lloyd map with Newton acceleration (its Jacobian is tridiagonal) until no
    centroid moves by more than ``tol * (hi - lo)``. Raises KVQError if that takes more than
    ``max_iter`` steps.
    """
    levels = int_param("lloyd_max", "levels", levels, 1)
    max_iter = int_param("lloyd_max", "max_iter", max_iter, 1)
    if not tol > 0:
        raise SpecError("lloyd_max", "tol", tol, "a positive float")
    table = _moment_table(density)
    c = table.companding_init(levels)
    for _ in range(max_iter):
        new = _newton_lloyd_step(table, c)
        step = np.max(np.abs(new - c))
        c = new
        if step <= tol * (table.hi - table.lo):
            break
    else:
        raise KVQError(f"lloyd_max: {density.name} with {levels} levels did not converge")
    thresholds = (c[:-1] + c[1:]) / 2
    m0, m1, m2 = table.cells(np.concatenate(([table.lo], thresholds, [table.hi])))
    s = c - table.x0
    mse = float(np.sum(m2 - 2 * s * m1 + s * s * m0))
    return Codebook(c, thresholds, mse, f"{density.name}-K{levels}")
