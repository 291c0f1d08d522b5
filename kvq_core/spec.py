"""Method specs: frozen, validated, JSON-round-trippable dataclasses, one per method.

A spec is pure data. It also defines, once for every backend, the packed layout of a key or
value block (:meth:`MethodSpec.key_layout`) and the constants a kernel needs
(:meth:`MethodSpec.constants`), so kernels hold no math constants of their own.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from kvq_core.errors import SpecError
from kvq_core.layout import Layout
from kvq_core.math.hadamard import is_power_of_two

#: Upper bounds on the spec parameters that set sizes, so that a block's work and memory stay
#: proportional to its bytes (a block is untrusted data; its spec comes with it):
#:
#: - ``head_dim`` <= MAX_HEAD_DIM: every per-vector transform is O(d log d) (the Hadamard is
#:   applied by the fast transform, never as a d x d matrix) and per-head constants are O(d);
#: - a dense per-(layer, kv head) matrix (TurboQuant's ``rotation="haar"``, QJL's and
#:   TurboQuant_prod's sketches) holds at most MAX_DENSE_ENTRIES entries (4 MiB in float32);
#:   one drawn by QR (Haar blocks: ``rotation="haar"``, ``sketch="orthogonal"``) is at most
#:   MAX_DENSE_DIM square, since QR costs O(d^3) (0.1 s at d = 1024 where d = 8192 took 250 s);
#: - codebooks have at most ``kvq_core.math.codebooks.MAX_BITS`` (8) bits, integer codes at most 8
#:   bits (OScaR, KIVI, QuaRot), and group sizes are bounded by head_dim or by the token count.
MAX_HEAD_DIM = 1 << 16
MAX_DENSE_DIM = 1 << 10
MAX_DENSE_ENTRIES = MAX_DENSE_DIM * MAX_DENSE_DIM


def channel_group(preferred: int, head_dim: int) -> int:
    """The default size of a group of channels: ``min(preferred, head_dim)`` when it divides
    head_dim, else ``gcd(preferred, head_dim)`` (e.g. 16 for 32 at head_dim 80), so a method's
    paper default still works on head dims that are multiples of 16 but not of its group."""
    size = min(preferred, head_dim)
    return size if head_dim % size == 0 else math.gcd(preferred, head_dim)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """Base of every method spec. Subclasses are frozen dataclasses with defaults for all fields.

    ``method`` names the method in the registry; ``default_residual`` is the number of recent
    tokens a cache keeps in full precision by default, and ``default_flush`` how it packs older
    ones (the method paper's protocol): "block" packs the window whole once it holds
    ``residual`` tokens (token-group codecs: OScaR, KIVI); "sliding" packs each token as it
    leaves the window, so every query sees exactly its ``residual`` most recent tokens exact
    (per-token codecs under the OCTOPUS protocol, specs/octopus.md 1.11).
    """

    method: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    default_residual: ClassVar[int] = 0
    default_flush: ClassVar[str] = "block"

    head_dim: int = 128

    def __post_init__(self) -> None:
        self.validate()

    # -- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`SpecError` for any out-of-range field. Subclasses extend this."""
        self.validate_head_dim()

    def power_of_two_gap(self) -> str | None:
        """Why kernels written for power-of-two head dims (one Hadamard block per head, no
        layout parts that exist only at other head dims) cannot serve this spec, or None.

        Compiled backends that support only the power-of-two layout answer ``supports`` with it."""
        if not is_power_of_two(self.head_dim):
            return f"head_dim={self.head_dim} is not a power of two (block-diagonal rotation)"
        return None

    def validate_head_dim(self) -> None:
        """head_dim: a multiple of 16 (the rotations are Hadamard blocks of >= 16 coordinates,
        :mod:`kvq_core.math.hadamard`). Codecs without such structure override this."""
        self._check_int("head_dim", 16, MAX_HEAD_DIM)
        if self.head_dim % 16:
            raise SpecError(self.method, "head_dim", self.head_dim, "a multiple of 16 (64, 80, 96, 128, ...)")

    def check_dense(self, param: str, rows: int, cols: int, qr: bool) -> None:
        """Bound a dense per-head matrix of ``rows`` x ``cols`` that ``param`` sets (MAX_DENSE_ENTRIES
        entries; square blocks of at most MAX_DENSE_DIM when drawn by QR); SpecError naming ``param``."""
        if rows * cols > MAX_DENSE_ENTRIES or (qr and cols > MAX_DENSE_DIM):
            limit = f"head_dim <= {MAX_DENSE_DIM} (a Haar block is drawn by QR, O(head_dim^3))" if qr and cols > MAX_DENSE_DIM \
                else f"rows x head_dim <= {MAX_DENSE_ENTRIES} for its {rows} x {cols} matrix per kv head"
            self._fail(param, f"a value whose dense matrix stays bounded: {limit}")

    def _fail(self, param: str, expected: str) -> None:
        raise SpecError(self.method, param, getattr(self, param), expected)

    def _check_int(self, param: str, lo: int, hi: int) -> None:
        value = getattr(self, param)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
            self._fail(param, f"an integer in [{lo}, {hi}]")
        object.__setattr__(self, param, int(value))  # NumPy integers become plain ints (JSON)

    def _check_choice(self, param: str, choices: Iterable[Any]) -> None:
        choices = tuple(choices)
        if getattr(self, param) not in choices:
            self._fail(param, "one of " + ", ".join(repr(c) for c in choices))

    def _check_bool(self, param: str) -> None:
        if not isinstance(getattr(self, param), bool):
            self._fail(param, "True or False")

    def _set(self, param: str, value: Any) -> None:
        """Resolve a defaulted field (e.g. ``None`` -> a bits-dependent group size) in __post_init__.

        The field is remembered as derived, so :meth:`replace` derives it again from the new values.
        """
        object.__setattr__(self, param, value)
        object.__setattr__(self, "_derived", getattr(self, "_derived", frozenset()) | {param})

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form: ``{"method": name, **fields}`` (tuples become lists)."""
        out: dict[str, Any] = {"method": self.method}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "MethodSpec":
        """Build a spec from keyword parameters, naming any unknown parameter in the error."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in params:
            if key not in names:
                raise SpecError(cls.method, key, params[key], "one of the parameters " + ", ".join(sorted(names)))
        fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
        return cls(**fixed)

    def replace(self, **changes: Any) -> "MethodSpec":
        """A copy with ``changes``; fields derived from defaults are derived again."""
        derived = getattr(self, "_derived", frozenset())
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in derived}
        return type(self).from_params({**kept, **changes})

    # -- layout and constants (overridden per method) ---------------------------------------
    def key_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """The packed fields of a key block of shape ``[batch, kv_heads, tokens, head_dim]``."""
        raise NotImplementedError(f"{type(self).__name__}.key_layout")

    def value_layout(self, batch: int, kv_heads: int, tokens: int) -> Layout:
        """The packed fields of a value block of shape ``[batch, kv_heads, tokens, head_dim]``."""
        raise NotImplementedError(f"{type(self).__name__}.value_layout")

    def constants(self, kv_heads: int, layer: int) -> dict[str, np.ndarray]:
        """Arrays a kernel needs besides the data (rotations, signs, codebooks), computed in core."""
        return {}

    def describe(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "method")
        return f"{self.method}({params})"
