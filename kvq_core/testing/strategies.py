"""Hypothesis strategies for the conformance suite: shapes, dtypes, value regimes and specs.

A :class:`Case` is everything one conformance example needs; :func:`cases` draws them. The
K/V/query arrays are generated with NumPy from the case's seed (:func:`case_arrays`), so a
failing example prints as a short, reproducible :class:`Case`.

Value regimes (:data:`REGIMES`):

- ``gaussian``: i.i.d. N(0, 1);
- ``outliers``: keys with a few large, biased outlier channels per head (x10 to x30);
- ``sinks``: token-norm imbalance: sink tokens scaled x0.05, a massive token x40, loud tokens x3;
- ``zeros``: whole tokens, whole heads, or (for small blocks) the whole block set to zero;
- ``constant``: keys constant over runs of 16 tokens per channel, values constant over runs of
  16 channels per token, and some tokens constant over the whole head (constant groups);
- ``large``: magnitudes around 1e3 (x3e3 for a few tokens);
- ``integers``: small integers in [-3, 3], which put many pre-rounding values exactly on .5
  (tests round-half-to-even) and many groups' ranges on exact binary fractions.

Not drawn, used by the fixed tie check (:data:`TIE_SPECS`): ``ties``: ``x[t, c] = (t + c + r)
mod 7 - 3`` (``r`` random per batch and head), so every group of >= 7 consecutive tokens or
channels spans exactly [-3, 3]: at 2 bits the step is exactly 2 and half the codes are exact
.5 ties, computed exactly by any correct float32 arithmetic.

Layers (:data:`LAYERS`) are drawn too: seeded methods draw their rotation signs per layer, so
a kernel that reads another layer's constants fails every case but layer 0's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - hypothesis is a test dependency
    raise ImportError("kvq_core.testing needs hypothesis (pip install 'kvq-core[dev]' or pip install hypothesis)") from exc

from kvq_core import registry
from kvq_core.errors import SpecError
from kvq_core.spec import MethodSpec

REGIMES = ("gaussian", "outliers", "sinks", "zeros", "constant", "large", "integers")
#: The regime of the tie check (not drawn at random; see the module docstring).
TIE_REGIME = "ties"
#: Layers drawn (0 and two others: a kernel using layer 0's constants fails on the others).
LAYERS = (0, 1, 5)
DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = (64, 128)
#: Token counts always worth trying: 1, around every power-of-two group size, and odd ones.
SPECIAL_TOKENS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129)

#: Parameter choices per built-in method (each drawn independently; invalid combinations are
#: skipped). Methods not listed are checked with their default spec only; plugin authors can
#: pass their own ``spec_params`` to :func:`specs` / the conformance functions.
SPEC_PARAMS: dict[str, dict[str, Sequence[Any]]] = {
    "fp16": {"storage": ("float16", "float32")},
    "oscar": {"bits": (2, 3, 4, 8), "key_group": (None, 16, 128), "value_group": (None, 16),
              "token_scaling": (True, False), "rotation": (True, False)},
    "kivi": {"bits": (1, 2, 3, 4, 8), "group": (16, 32, 64)},
    "quarot": {"bits": (2, 3, 4, 8), "rotation": (True, False), "clip_ratio": (1.0, 0.9)},
    "octopus": {"bits": (2, 3, 4), "xi_bits": (None, 2, 4), "eta_bits": (None, 3), "rho_bits": (None, 2),
                "rounding": ("joint", "plain"), "values": ("octopus", "fp16"), "seed": (0, 7), "tail": ("pad", "scalar")},
    "turboquant": {"bits": (1, 2, 3, 4), "rotation": ("hadamard", "haar"), "norm_correction": (False, True),
                   "high_bits_coords": (0, 16), "seed": (0, 3)},
    "turboquant_prod": {"bits": (2, 3, 4), "rotation": ("hadamard", "haar"), "sketch": ("gaussian", "orthogonal"),
                        "values": ("prod", "mse"), "seed": (0, 3)},
    "qjl": {"sketch_dim": (64, 256), "sketch": ("gaussian", "orthogonal"), "value_bits": (2, 4), "value_group": (None, 16),
            "seed": (0, 3)},
    "polarquant": {"level_bits": ((4, 2, 2, 2), (3, 2), (2, 2, 2)), "radius_dtype": ("float16", "float32"),
                   "rotation": ("hadamard", "none"), "seed": (0, 3)},
}

#: A non-default spec per built-in method that the fixed edge cases run on besides the default
#: one, so every kernel branch a parameter selects is reached deterministically, whatever the
#: random draw (e.g. OCTOPUS with xi and eta codebooks of different sizes; OScaR's other bit
#: width, groups and switches). Invalid at some head_dim: skipped there.
EDGE_SPECS: dict[str, dict[str, Any]] = {
    "fp16": {"storage": "float32"},
    "oscar": {"bits": 4, "key_group": 16, "value_group": 16, "token_scaling": False, "rotation": False},
    "kivi": {"bits": 3, "group": 16},
    "quarot": {"bits": 3, "rotation": False, "clip_ratio": 0.9},
    "octopus": {"bits": 3, "xi_bits": 2, "eta_bits": 5, "rounding": "joint", "seed": 7},
    "turboquant": {"bits": 3, "rotation": "haar", "norm_correction": True, "high_bits_coords": 16, "seed": 3},
    "turboquant_prod": {"bits": 3, "rotation": "haar", "sketch": "orthogonal", "values": "mse", "seed": 3},
    "qjl": {"sketch_dim": 64, "sketch": "orthogonal", "value_bits": 4, "value_group": 16, "seed": 3},
    "polarquant": {"level_bits": (3, 2), "radius_dtype": "float32", "rotation": "none", "seed": 3},
}

#: Specs whose codes are an integer grid with a step of exactly 2 on the :data:`TIE_REGIME`
#: data (2 bits over a range of 6, no rotation or norm scaling): the tie check compares their
#: codes exactly, pinning round-half-to-even on every backend without the tie rule's excuse.
TIE_SPECS: dict[str, dict[str, Any]] = {
    "oscar": {"bits": 2, "key_group": 32, "value_group": 16, "token_scaling": False, "rotation": False},
    "kivi": {"bits": 2, "group": 32},
    "quarot": {"bits": 2, "rotation": False},
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance example: a spec, a K/V block shape, the query shape, dtype, regime and
    the layer the quantizers are built for (its constants, e.g. rotation signs)."""

    spec: MethodSpec
    batch: int
    kv_heads: int
    tokens: int
    gqa: int
    q_len: int
    dtype: str
    regime: str
    seed: int
    layer: int = 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.tokens, self.spec.head_dim)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads * self.gqa, self.q_len, self.spec.head_dim)

    def __repr__(self) -> str:
        return (f"Case({self.spec.describe()}, shape={list(self.shape)}, q_shape={list(self.q_shape)}, "
                f"dtype={self.dtype!r}, regime={self.regime!r}, seed={self.seed}, layer={self.layer})")


def make_spec_or_none(method: str, params: Mapping[str, Any]) -> MethodSpec | None:
    """The spec, or None when the parameter combination is invalid (e.g. a group that does not
    divide head_dim)."""
    try:
        return registry.make_spec(method, **params)
    except SpecError:
        return None


@st.composite
def specs(
    draw: Any,
    method: str,
    head_dims: Sequence[int] = HEAD_DIMS,
    spec_params: Mapping[str, Sequence[Any]] | None = None,
) -> MethodSpec:
    """A valid spec of ``method``: head_dim from ``head_dims``, other parameters from
    ``spec_params`` (default :data:`SPEC_PARAMS` for built-ins; ``{}`` gives the default spec)."""
    options = SPEC_PARAMS.get(method, {}) if spec_params is None else spec_params
    for _ in range(50):
        params = {"head_dim": draw(st.sampled_from(tuple(head_dims)))}
        for name, choices in options.items():
            params[name] = draw(st.sampled_from(tuple(choices)))
        spec = make_spec_or_none(method, params)
        if spec is not None:
            return spec
    spec = make_spec_or_none(method, {"head_dim": head_dims[0]})
    if spec is None:  # pragma: no cover
        raise SpecError(method, "head_dim", head_dims[0], "a head_dim the method accepts")
    return spec


def token_counts(max_tokens: int = 160) -> st.SearchStrategy[int]:
    """Token counts: 1, values around the usual group sizes, and any count up to ``max_tokens``."""
    special = tuple(t for t in SPECIAL_TOKENS if t <= max_tokens)
    return st.one_of(st.sampled_from(special), st.integers(1, max_tokens))


@st.composite
def cases(
    draw: Any,
    method: str,
    *,
    head_dims: Sequence[int] = HEAD_DIMS,
    batches: Sequence[int] = (1, 2),
    kv_heads: Sequence[int] = (1, 2, 3),
    gqa: Sequence[int] = (1, 2, 3, 4),
    q_lens: Sequence[int] = (1, 2, 5),
    tokens: st.SearchStrategy[int] | None = None,
    dtypes: Sequence[str] = DTYPES,
    regimes: Sequence[str] = REGIMES,
    spec_params: Mapping[str, Sequence[Any]] | None = None,
    layers: Sequence[int] = LAYERS,
) -> Case:
    """A :class:`Case` of ``method``; every argument restricts what is drawn."""
    return Case(
        spec=draw(specs(method, head_dims, spec_params)),
        batch=draw(st.sampled_from(tuple(batches))),
        kv_heads=draw(st.sampled_from(tuple(kv_heads))),
        tokens=draw(tokens if tokens is not None else token_counts()),
        gqa=draw(st.sampled_from(tuple(gqa))),
        q_len=draw(st.sampled_from(tuple(q_lens))),
        dtype=draw(st.sampled_from(tuple(dtypes))),
        regime=draw(st.sampled_from(tuple(regimes))),
        seed=draw(st.integers(0, 2**31 - 1)),
        layer=draw(st.sampled_from(tuple(layers))),
    )


def regime_kv(regime: str, shape: Sequence[int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values (float32) of one value regime (see the module docstring)."""
    b, h, t, d = shape
    k = rng.standard_normal((b, h, t, d), dtype=np.float32)
    v = rng.standard_normal((b, h, t, d), dtype=np.float32)
    if regime == "outliers":
        for head in range(h):
            ch = rng.choice(d, 4, replace=False)
            gain = rng.uniform(10, 30, 4).astype(np.float32)
            bias = rng.uniform(-1, 1, 4).astype(np.float32)
            k[:, head][..., ch] = gain * (0.5 * k[:, head][..., ch] + bias)
    elif regime == "sinks":
        s = np.ones(t, np.float32)
        s[8::16] = 3.0
        s[0] = 40.0 if t > 1 else 1.0
        for tok in (1, 4):
            if tok < t:
                s[tok] = 0.05
        k *= s[None, None, :, None]
        v *= s[None, None, :, None] ** 0.5
    elif regime == "zeros":
        if t <= 2 or rng.random() < 0.2:
            k[:] = 0
            v[:] = 0
        else:
            zt = rng.random(t) < 0.3
            k[:, :, zt] = 0
            v[:, :, zt] = 0
            if h > 1:
                k[:, rng.integers(h)] = 0
    elif regime == "constant":
        run = 16
        kv = rng.standard_normal((b, h, -(-t // run), d), dtype=np.float32)
        k = np.repeat(kv, run, axis=2)[:, :, :t].copy()
        vv = rng.standard_normal((b, h, t, d // run), dtype=np.float32)
        v = np.repeat(vv, run, axis=3).copy()
        flat = rng.random(t) < 0.25
        k[:, :, flat] = rng.standard_normal((b, h, 1, 1), dtype=np.float32)
        v[:, :, flat] = 1.5
    elif regime == "large":
        k *= np.float32(1e3)
        v *= np.float32(1e3)
        loud = rng.random(t) < 0.1
        k[:, :, loud] *= np.float32(3)
    elif regime == "integers":
        k = rng.integers(-3, 4, (b, h, t, d)).astype(np.float32)
        v = rng.integers(-3, 4, (b, h, t, d)).astype(np.float32)
    elif regime == TIE_REGIME:
        r = rng.integers(0, 7, (b, h, 1, 1))
        grid = np.arange(t)[:, None] + np.arange(d)[None, :]
        k = ((grid + r) % 7 - 3).astype(np.float32)
        v = ((grid + r + 3) % 7 - 3).astype(np.float32)
    elif regime != "gaussian":
        raise ValueError(f"unknown regime {regime!r}; expected one of {(*REGIMES, TIE_REGIME)}")
    return k, v


def case_arrays(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float32 keys, values and queries of ``case`` (deterministic in ``case.seed``)."""
    rng = np.random.default_rng(case.seed)
    k, v = regime_kv(case.regime, case.shape, rng)
    q = rng.standard_normal(case.q_shape, dtype=np.float32)
    return k, v, q


__all__ = [
    "Case", "DTYPES", "EDGE_SPECS", "HEAD_DIMS", "LAYERS", "REGIMES", "SPECIAL_TOKENS", "SPEC_PARAMS", "TIE_REGIME",
    "TIE_SPECS", "case_arrays", "cases", "make_spec_or_none", "regime_kv", "specs", "token_counts",
]
