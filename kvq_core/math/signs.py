"""Counter-based random sign vectors for the randomised Hadamard rotation R = H diag(s).

Signs are a pure function of (seed, layer, kv_head, coordinate), so nothing has to be stored and
any backend (NumPy, Triton, C, ...) can regenerate the same rotation bit for bit.
"""
from __future__ import annotations

import functools
import operator

import numpy as np

from kvq_core.errors import SpecError

__all__ = ["splitmix64", "random_signs"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_U64_MAX = 2**64 - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 output function on a uint64 array (all arithmetic modulo 2**64).

    ``z = x + 0x9E3779B97F4A7C15; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return z ^ (z >> 31)``.
    """
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def _check(param: str, value: int, lo: int) -> int:
    if isinstance(value, bool):
        raise SpecError("signs", param, value, f"an integer in [{lo}, 2**64)")
    try:
        v = operator.index(value)
    except TypeError:
        raise SpecError("signs", param, value, f"an integer in [{lo}, 2**64)") from None
    if not lo <= v <= _U64_MAX:
        raise SpecError("signs", param, value, f"an integer in [{lo}, 2**64)")
    return v


def random_signs(seed: int, layer: int, kv_heads: int, dim: int) -> np.ndarray:
    """Return the read-only float32 ``(kv_heads, dim)`` array of +-1 signs for one layer.

    Exact definition (uint64 arithmetic modulo 2**64, ``^`` = xor, ``sm`` = :func:`splitmix64`)::

        key(h)        = sm(sm(sm(seed) ^ layer) ^ h)
        mix(s, l, h, i) = key(h) ^ i
        sign[h, i]    = +1 if (sm(mix(seed, layer, h, i)) >> 63) == 0 else -1

    Each entry depends only on its four integers, never on call order or array shape.
    """
    return _random_signs(
        _check("seed", seed, 0), _check("layer", layer, 0),
        _check("kv_heads", kv_heads, 1), _check("dim", dim, 1),
    )


@functools.lru_cache(maxsize=256)
def _random_signs(seed: int, layer: int, kv_heads: int, dim: int) -> np.ndarray:
    s = splitmix64(np.full((kv_heads, 1), seed, dtype=np.uint64))
    s = splitmix64(s ^ np.uint64(layer))
    key = splitmix64(s ^ np.arange(kv_heads, dtype=np.uint64)[:, None])
    z = splitmix64(key ^ np.arange(dim, dtype=np.uint64)[None, :])
    out = np.where((z >> np.uint64(63)) == 0, np.float32(1.0), np.float32(-1.0))
    out.flags.writeable = False
    return out
