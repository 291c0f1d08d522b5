"""The conformance suite: prove a backend equal to the NumPy reference, method by method.

For each drawn :class:`~kvq_core.testing.strategies.Case` (spec, shape, dtype, value regime)
it checks, against the reference backend (``"numpy"`` unless told otherwise):

1. **codes** - every code field, unpacked with the layout's bit rule, equals the reference's,
   except at *tie-ambiguous* elements (the tie rule below); the packed bytes of the backend are
   exactly the layout's packing of its own codes (bit order and zero padding);
2. **side fields** (scales, offsets, norms) - within :data:`FIELD_RTOL` of the reference, or
   inside the envelope the tie rule's perturbed reference encodings span;
3. **decode** - the backend decodes the *reference's* packed block to the reference's decoded
   values within :func:`decode_tolerance`;
4. **cross-decoding** - the reference decodes the *backend's* packed block to what the backend
   decodes from it (packed blocks travel both ways: NumPy -> backend in 3, backend -> NumPy here);
5. **attend** - the backend's ``attend`` over the reference's packed block matches the
   reference's output and log-sum-exp within :func:`attend_tolerance`;
   **per token** - for per-token layouts (:func:`~kvq_core.tokens.token_separable`), the block's
   tokens encoded in two parts and joined (:func:`~kvq_core.tokens.concat_tokens`) pass checks
   1-2 against the reference's whole block: a sliding-flush cache packs one token at a time;
**exact ties** - for methods with an integer code grid (:data:`~kvq_core.testing.strategies.TIE_SPECS`:
   OScaR, KIVI, QuaRot), a fixed block whose every group spans [-3, 3] at 2 bits (step exactly
   2, half the codes exact .5 ties) must give the reference's codes exactly: round-half-to-even
   is checked by design on every backend, not left to the draw or to ``exact_codes``;
6. **typed errors** - bad input (rank, head_dim, empty, an integer, object or str dtype, NaN/Inf, wrong packed
   kind, foreign spec, bad GQA ratio, bad scale) raises the documented :class:`KVQError` subclass;
   input whose stored fields would overflow (|x| ~ 1e6 past float16) raises InputError or decodes finite;
   nonzero input whose stored fields would underflow (|x| ~ 1e-30) raises InputError or decodes nonzero;
7. **tampered blocks** (:func:`check_tampered`, part of 6) - a block declaring a head_dim its fields
   lack, zero tokens or kv heads, NaN/Inf in a stored float field, a bad dtype name, a negative or
   foreign layer, malformed ``PackedKV.from_dict`` input, and an attend scale that overflows float32
   raise LayoutError / InputError on decode and attend, before any kernel reads the block.

A drawn case whose spec the backend's ``supports(spec, device)`` refuses (e.g. a compiled backend
that serves only power-of-two layouts) is skipped and counted in ``MethodReport.unsupported``;
a method of which no case is served fails.

Tie rule (how "the pre-rounding value lies within the tie tolerance of a decision boundary" is
decided, for every method alike, including normalising codecs where a global rescale changes
nothing): the reference encodes :data:`TIE_RUNS` copies of the input, each element multiplied by
``1 + TIE_RTOL * r`` with independent ``r`` uniform in [-1, 1]. A backend code that differs from
the reference is accepted iff the reference produced that same code at that element for one of
those perturbed inputs, i.e. iff some input within relative distance ``TIE_RTOL`` (1e-4) per
element yields it. Backends that compute in float32 differ from the reference by ~1e-7
relative, so a code they flip sits within ~1e-7 of a boundary, which a 1e-4 perturbation crosses
with probability ~1/2 per run (miss probability ~2**-TIE_RUNS per flipped element), also for
values exactly on a boundary by symmetry (equal coordinates, integer inputs) since independent
continuous factors break the symmetry. A genuinely wrong code (off by a step, a bad bit order,
a bad threshold) is not produced by any perturbation and fails. Limits, stated plainly: a value
*exactly* at a boundary is a tie by this definition, so the rule alone accepts either rounding
of an exact .5; backends that mirror the reference's arithmetic pass ``exact_codes=True``,
which turns the rule off and pins round-half-to-even (the ``integers`` regime makes many exact
.5s). And a group whose codes are pure rounding noise (values ~1e-7 of the group's own scale)
is covered only statistically. The perturbed runs are made only when something mismatches.

What is drawn besides shapes, dtypes and regimes: the spec's secondary parameters
(:data:`~kvq_core.testing.strategies.SPEC_PARAMS`) and the layer (constants such as rotation
signs differ per layer). Fixed edge cases run on the default spec and on a non-default one
(:data:`~kvq_core.testing.strategies.EDGE_SPECS`), some at a non-zero layer, so every kernel
path a parameter selects is reached whatever the draw; a compiled backend that bounds its
draw with ``spec_params={}`` names the specs of its edge cases with ``fixed_specs``.

Tolerances are relative to the data (see the functions below); all are stated as constants.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvq_core import registry
from kvq_core.api import Quantizer
from kvq_core.errors import InputError, KVQError, LayoutError
from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.packed import PackedKV
from kvq_core.tokens import concat_tokens, token_separable
from kvq_core.testing.strategies import (
    DTYPES,
    EDGE_SPECS,
    HEAD_DIMS,
    LAYERS,
    REGIMES,
    TIE_REGIME,
    TIE_SPECS,
    Case,
    case_arrays,
    cases,
    make_spec_or_none,
    token_counts,
)

REFERENCE = "numpy"
#: Relative per-element perturbation of the tie rule.
TIE_RTOL = 1e-4
#: Perturbed reference encodings made when codes mismatch.
TIE_RUNS = 16
#: Side fields (float16 / float32 scales, offsets, norms): relative tolerance by stored dtype.
FIELD_RTOL = {"float16": 2.0**-10, "float32": 2e-5}
#: Decoded values: relative to the block's largest magnitude, by output dtype (float32 compute
#: differences ~1e-6; float16/bfloat16 outputs add their rounding).
DECODE_RTOL = {"float32": 2e-5, "float64": 2e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}
#: Attention: logits err by ~ ATTEND_LOGIT_RTOL * L with L = scale * max|q| * max|k| (row norms).
ATTEND_LOGIT_RTOL = 4e-6
ATTEND_RTOL = 2e-5


class ConformanceError(AssertionError):
    """A backend disagreed with the reference; the message names the case and the check."""


@dataclasses.dataclass
class MethodReport:
    """What :func:`check_method` saw for one method on one backend."""

    backend: str
    method: str
    examples: int = 0
    codes_compared: int = 0
    tie_mismatches: int = 0
    max_decode_err: float = 0.0
    max_attend_err: float = 0.0
    unsupported: int = 0
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def line(self) -> str:
        status = "ok" if self.ok else "FAIL"
        return (f"{self.backend:>16} {self.method:<16} {status:4} examples={self.examples:<4} "
                f"codes={self.codes_compared:<9} ties={self.tie_mismatches:<5} "
                f"decode_err={self.max_decode_err:.2e} attend_err={self.max_attend_err:.2e} "
                f"unsupported={self.unsupported}")


@dataclasses.dataclass
class ConformanceReport:
    """Per-method reports of one backend; ``raise_for_failures`` turns failures into an error."""

    backend: str
    methods: list[MethodReport]

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.methods)

    def summary(self) -> str:
        return "\n".join(m.line() for m in self.methods)

    def raise_for_failures(self) -> None:
        bad = [m for m in self.methods if not m.ok]
        if bad:
            raise ConformanceError("\n\n".join(f"{m.backend}/{m.method}: {m.failure}" for m in bad))


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def methods_for(backend: str, reference: str = REFERENCE) -> list[str]:
    """Methods the backend implements that the reference implements too (sorted)."""
    ours = registry.backend_info(backend).kernels
    ref = registry.backend_info(reference).kernels
    return sorted(m for m in ours if m in ref)


def _f32(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def decode_tolerance(ref: np.ndarray, dtype: str) -> np.ndarray:
    """Allowed |backend - reference| per element of a decoded block."""
    rtol = DECODE_RTOL.get(dtype, 2e-5)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return rtol * scale + rtol * np.abs(ref) + 1e-30


def attend_tolerance(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, dtype: str) -> tuple[float, float]:
    """(out tolerance, lse tolerance) for attention over decoded ``k``, ``v`` (float32 arrays)."""
    qn = float(np.max(np.linalg.norm(q.astype(np.float64), axis=-1))) if q.size else 0.0
    kn = float(np.max(np.linalg.norm(k.astype(np.float64), axis=-1))) if k.size else 0.0
    logit_err = ATTEND_LOGIT_RTOL * scale * qn * kn + 1e-6
    vmax = float(np.max(np.abs(v))) if v.size else 0.0
    out_tol = vmax * (4 * logit_err + ATTEND_RTOL + DECODE_RTOL.get(dtype, 0.0)) + 1e-6
    return out_tol, 2 * logit_err + 1e-5


class _Pair:
    """The backend and reference quantizers of one spec, with array conversion between them."""

    def __init__(self, backend: str, reference: str, case: Case, to_backend: Callable[[np.ndarray], Any] | None) -> None:
        self.qb = Quantizer(case.spec, backend, case.layer)
        self.qr = Quantizer(case.spec, reference, case.layer)
        self.ab = self.qb.arrays
        self._to_backend = to_backend

    def to_backend(self, a: np.ndarray, dtype: str | None = None) -> Any:
        x = self._to_backend(np.ascontiguousarray(a)) if self._to_backend else self.ab.asarray(np.ascontiguousarray(a))
        return self.ab.cast(x, dtype) if dtype else x

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(self.ab.to_numpy(x))

    def packed_to_numpy(self, p: PackedKV) -> PackedKV:
        return PackedKV.from_dict(p.to_dict())

    def packed_to_backend(self, p: PackedKV) -> PackedKV:
        return p.map_fields(lambda a: self.to_backend(np.asarray(a)))


def _fail(case: Case, check: str, detail: str) -> ConformanceError:
    return ConformanceError(f"{check} failed for {case!r}:\n  {detail}")


# ------------------------------------------------------------------------------------------------
# the checks of one case
# ------------------------------------------------------------------------------------------------
def _perturbed(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    r = rng.uniform(-1.0, 1.0, x.shape).astype(np.float32)
    return (x.astype(np.float32) * (np.float32(1) + np.float32(TIE_RTOL) * r)).astype(np.float32)


def _compare_block(pair: _Pair, case: Case, kind: str, xr: np.ndarray, pb: PackedKV, pr: PackedKV,
                   report: MethodReport, exact_codes: bool = False, label: str | None = None) -> None:
    """Checks 1 and 2 for one packed block (keys or values); ``label`` names it in failures."""
    encode = pair.qr.encode_keys if kind == "keys" else pair.qr.encode_values
    what = label or kind
    layout = pr.layout
    runs: list[PackedKV] | None = None

    def perturbed_runs() -> list[PackedKV]:
        nonlocal runs
        if runs is None:
            rng = np.random.default_rng(case.seed ^ 0x5EED)
            runs = [encode(_perturbed(xr, rng)) for _ in range(TIE_RUNS)]
        return runs

    for name, field in layout.items():
        b = pair.to_numpy(pb.fields[name])
        r = np.asarray(pr.fields[name])
        if field.is_codes:
            cb = unpack_codes(b, field.bits, field.count)
            cr = unpack_codes(r, field.bits, field.count)
            repacked = pack_codes(cb, field.bits)
            if not np.array_equal(repacked, b):
                bad = np.argwhere(repacked != b)[:5].tolist()
                raise _fail(case, f"{what} field {name!r} packing",
                            f"bytes differ from the layout's packing of the backend's own codes "
                            f"(bit order or nonzero padding) at {bad}")
            report.codes_compared += cb.size
            diff = cb != cr
            if diff.any() and exact_codes:
                i = tuple(np.argwhere(diff)[0])
                raise _fail(case, f"{what} codes {name!r} (exact)",
                            f"{int(diff.sum())} of {cb.size} codes differ; the backend promised bit-identical codes: "
                            f"at {i} backend {cb[i]} reference {cr[i]}")
            if diff.any():
                allowed = np.zeros_like(diff)
                for run in perturbed_runs():
                    allowed |= unpack_codes(np.asarray(run.fields[name]), field.bits, field.count) == cb
                bad = diff & ~allowed
                if bad.any():
                    idx = np.argwhere(bad)[:5]
                    detail = "; ".join(f"at {tuple(i)}: backend {cb[tuple(i)]} reference {cr[tuple(i)]}" for i in idx)
                    raise _fail(case, f"{what} codes {name!r}",
                                f"{int(bad.sum())} of {cb.size} codes differ and are not ties "
                                f"(no input within relative {TIE_RTOL:g} gives them): {detail}")
                report.tie_mismatches += int(diff.sum())
        else:
            bf, rf = _f32(b), _f32(r)
            rtol = FIELD_RTOL.get(field.dtype, 2e-5)
            mag = float(np.max(np.abs(rf))) if rf.size else 0.0
            tol = rtol * np.abs(rf) + rtol * 1e-3 * mag + 1e-30
            bad = ~(np.abs(bf - rf) <= tol)
            if bad.any():
                runs_f = [_f32(run.fields[name]) for run in perturbed_runs()]
                lo = np.minimum.reduce([rf, *runs_f])
                hi = np.maximum.reduce([rf, *runs_f])
                inside = (bf >= lo - tol) & (bf <= hi + tol)
                bad &= ~inside
                if bad.any():
                    i = tuple(np.argwhere(bad)[0])
                    raise _fail(case, f"{what} field {name!r}",
                                f"{int(bad.sum())} of {bf.size} values differ: at {i} backend {bf[i]!r} "
                                f"reference {rf[i]!r} (tolerance {tol[i]:.3g}, perturbed range [{lo[i]!r}, {hi[i]!r}])")


def _close(case: Case, check: str, got: np.ndarray, want: np.ndarray, tol: Any) -> float:
    got, want = _f32(got), _f32(want)
    if got.shape != want.shape:
        raise _fail(case, check, f"shape {list(got.shape)}, reference {list(want.shape)}")
    if not np.isfinite(got).all() and np.isfinite(want).all():
        raise _fail(case, check, "backend produced NaN/Inf where the reference is finite")
    err = np.abs(got - want)
    bad = ~(err <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        t = tol[i] if np.ndim(tol) else tol
        raise _fail(case, check, f"{int(bad.sum())} of {got.size} elements off: at {i} backend {got[i]!r} "
                                 f"reference {want[i]!r} (|diff| {err[i]:.3g} > tolerance {t:.3g})")
    return float(err.max()) if err.size else 0.0


def check_case(backend: str, case: Case, *, reference: str = REFERENCE,
               to_backend: Callable[[np.ndarray], Any] | None = None, report: MethodReport | None = None,
               exact_codes: bool = False) -> MethodReport:
    """Run checks 1-5 for one case; raise :class:`ConformanceError` on the first failure.

    ``exact_codes``: the backend claims bit-identical codes (no tie excuses), e.g. because its
    float32 arithmetic mirrors the reference op for op; this also pins the rounding mode at
    exact .5 ties (the ``integers`` regime makes many)."""
    report = report or MethodReport(backend, case.spec.method)
    pair = _Pair(backend, reference, case, to_backend)
    k32, v32, q32 = case_arrays(case)
    kb, vb, qb = (pair.to_backend(a, case.dtype) for a in (k32, v32, q32))
    # what the reference sees: the backend's input values exactly (bfloat16 widened to float32)
    kr, vr, qr = (pair.to_numpy(x) for x in (kb, vb, qb))

    pkr, pvr = pair.qr.encode_keys(kr), pair.qr.encode_values(vr)
    pkb, pvb = pair.qb.encode_keys(kb), pair.qb.encode_values(vb)
    # 1-2: codes and side fields
    _compare_block(pair, case, "keys", kr, pkb, pkr, report, exact_codes)
    _compare_block(pair, case, "values", vr, pvb, pvr, report, exact_codes)
    # 3: the backend decodes the reference's blocks
    out_dtype = case.dtype
    for kind, pr, dec_b, dec_r in (("keys", pkr, pair.qb.decode_keys, pair.qr.decode_keys),
                                   ("values", pvr, pair.qb.decode_values, pair.qr.decode_values)):
        want = _f32(dec_r(pr))
        got = pair.to_numpy(dec_b(pair.packed_to_backend(pr)))
        err = _close(case, f"decode {kind} (reference block on the backend)", got, want, decode_tolerance(want, out_dtype))
        report.max_decode_err = max(report.max_decode_err, err / (float(np.max(np.abs(want))) + 1e-30))
    # 4: the reference decodes the backend's blocks
    for kind, pb, dec_b, dec_r in (("keys", pkb, pair.qb.decode_keys, pair.qr.decode_keys),
                                   ("values", pvb, pair.qb.decode_values, pair.qr.decode_values)):
        own = pair.to_numpy(dec_b(pb))
        cross = _f32(dec_r(pair.packed_to_numpy(pb)))
        _close(case, f"cross-decode {kind} (backend block on the reference)", own, cross, decode_tolerance(cross, out_dtype))
    # 5: attention over the reference's blocks
    scale = 1.0 / math.sqrt(case.spec.head_dim)
    out_r, lse_r = pair.qr.attend(qr, pkr, pvr, return_lse=True)
    out_b, lse_b = pair.qb.attend(qb, pair.packed_to_backend(pkr), pair.packed_to_backend(pvr), return_lse=True)
    out_tol, lse_tol = attend_tolerance(_f32(qr), _f32(pair.qr.decode_keys(pkr)), _f32(pair.qr.decode_values(pvr)),
                                        scale, out_dtype)
    err = _close(case, "attend output", pair.to_numpy(out_b), _f32(out_r), out_tol)
    _close(case, "attend lse", pair.to_numpy(lse_b), _f32(lse_r), lse_tol)
    vmax = float(np.max(np.abs(_f32(pair.qr.decode_values(pvr))))) + 1e-30
    report.max_attend_err = max(report.max_attend_err, err / vmax)
    _check_per_token(pair, case, {"keys": (kb, kr), "values": (vb, vr)}, {"keys": pkr, "values": pvr}, report)
    report.examples += 1
    return report


def _check_per_token(pair: _Pair, case: Case, xs: dict[str, tuple[Any, np.ndarray]], refs: dict[str, PackedKV],
                     report: MethodReport) -> None:
    """Per-token layouts: the block encoded in two parts and joined passes checks 1-2 against
    the reference's whole-block encoding (a sliding-flush cache packs one token at a time)."""
    t = case.shape[2]
    for kind, (xb, xr) in xs.items():
        if t < 2 or not token_separable(case.spec, kind):
            continue
        encode = pair.qb.encode_keys if kind == "keys" else pair.qb.encode_values
        cut = t // 2
        joined = concat_tokens([encode(xb[:, :, :cut]), encode(xb[:, :, cut:])], pair.qb.arrays)
        _compare_block(pair, case, kind, xr, joined, refs[kind], report, label=f"{kind} encoded in two parts, joined")


# ------------------------------------------------------------------------------------------------
# typed errors
# ------------------------------------------------------------------------------------------------
def _expect(where: str, exc: type[KVQError], what: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except exc:
        return
    except Exception as other:  # noqa: BLE001
        raise ConformanceError(f"{where}: {what} raised {type(other).__name__}: {other}; expected {exc.__name__}") from other
    raise ConformanceError(f"{where}: {what} raised nothing; expected {exc.__name__}")


def check_errors(backend: str, method: str, *, to_backend: Callable[[np.ndarray], Any] | None = None,
                 head_dim: int = 64) -> None:
    """Check 6: bad input raises the documented typed error on ``backend``."""
    spec = registry.make_spec(method, head_dim=head_dim)
    q = Quantizer(spec, backend)
    conv = to_backend or q.arrays.asarray
    rng = np.random.default_rng(0)
    good = rng.standard_normal((1, 2, 8, head_dim)).astype(np.float32)

    def expect(exc: type[KVQError], what: str, fn: Callable[[], Any]) -> None:
        _expect(f"{backend}/{method}", exc, what, fn)

    nan = good.copy()
    nan[0, 1, 3, 5] = np.nan
    inf = good.copy()
    inf[0, 0, 0, 0] = -np.inf
    expect(InputError, "a rank-3 array", lambda: q.encode_keys(conv(good[0])))
    expect(InputError, "a head_dim mismatch", lambda: q.encode_values(conv(np.zeros((1, 2, 4, head_dim * 2), np.float32))))
    expect(InputError, "an empty token axis", lambda: q.encode_keys(conv(np.zeros((1, 2, 0, head_dim), np.float32))))
    expect(InputError, "an integer dtype", lambda: q.encode_keys(conv(np.ones((1, 2, 4, head_dim), np.int32))))
    expect(InputError, "NaN keys", lambda: q.encode_keys(conv(nan)))
    expect(InputError, "-Inf values", lambda: q.encode_values(conv(inf)))
    expect(InputError, "a list instead of an array", lambda: q.encode_keys([[1.0, 2.0]]))
    expect(InputError, "a NumPy array of dtype object", lambda: q.encode_keys(good.astype(object)))
    expect(InputError, "a NumPy array of strings", lambda: q.encode_values(good.astype(str)))
    pk, pv = q.encode_keys(conv(good)), q.encode_values(conv(good))
    expect(InputError, "decoding keys as values", lambda: q.decode_values(pk))
    other = None
    for change in ({"head_dim": head_dim * 2},):
        try:
            other = Quantizer(spec.replace(**change), backend)
        except KVQError:
            continue
    if other is not None:
        expect(LayoutError, "a block of another spec", lambda: other.decode_keys(pk))
    qbad = conv(rng.standard_normal((1, 3, 1, head_dim)).astype(np.float32))
    expect(InputError, "3 query heads over 2 KV heads", lambda: q.attend(qbad, pk, pv))
    qok = conv(rng.standard_normal((1, 4, 1, head_dim)).astype(np.float32))
    expect(InputError, "a negative scale", lambda: q.attend(qok, pk, pv, scale=-1.0))
    qnan = rng.standard_normal((1, 4, 1, head_dim)).astype(np.float32)
    qnan[0, 0, 0, 0] = np.nan
    expect(InputError, "a NaN query", lambda: q.attend(conv(qnan), pk, pv))
    expect(InputError, "a query of dtype object", lambda: q.attend(np.ones((1, 4, 1, head_dim), object), pk, pv))
    try:  # past float16 range: a stored field may overflow, which must raise rather than store Inf
        huge = q.encode_keys(conv(good * 1e6))
    except InputError:
        pass
    else:
        if not np.isfinite(np.asarray(q.arrays.to_numpy(q.decode_keys(huge)), dtype=np.float64)).all():
            raise ConformanceError(f"{backend}/{method}: keys of magnitude 1e6 encoded without error but decode to NaN/Inf")
    check_tampered(backend, method, to_backend=to_backend, head_dim=head_dim)
    for kind, encode, decode in (("keys", q.encode_keys, q.decode_keys), ("values", q.encode_values, q.decode_values)):
        try:  # far below float16 range: stored fields may underflow, which must raise rather than store zeros
            tiny = encode(conv(good * np.float32(1e-30)))
        except InputError:
            continue
        if not np.any(np.asarray(q.arrays.to_numpy(decode(tiny)), dtype=np.float64) != 0):
            raise ConformanceError(f"{backend}/{method}: nonzero {kind} of magnitude 1e-30 encoded without error "
                                   "but decode to all zeros")


def check_tampered(backend: str, method: str, *, to_backend: Callable[[np.ndarray], Any] | None = None,
                   head_dim: int = 64) -> None:
    """Check 7: a block from anywhere (another process, a file: :meth:`PackedKV.from_dict`) is
    validated before any kernel reads it. Blocks built from valid ones by tampering (a declared
    head_dim its fields do not have, zero tokens or kv heads, NaN/Inf in a stored float field, a
    bad dtype name, a negative or foreign layer, malformed ``from_dict`` input) and an attend scale
    that overflows float32 raise the documented typed error on decode and attend."""
    where = f"{backend}/{method}"
    spec = registry.make_spec(method, head_dim=head_dim)
    q = Quantizer(spec, backend)
    conv = to_backend or q.arrays.asarray
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 8, head_dim)).astype(np.float32)
    pk, pv = q.encode_keys(conv(x)), q.encode_values(conv(x))
    qry = conv(rng.standard_normal((1, 4, 1, head_dim)).astype(np.float32))
    calls = {
        "keys": (lambda p: q.decode_keys(p), lambda p: q.attend(qry, p, pv)),
        "values": (lambda p: q.decode_values(p), lambda p: q.attend(qry, pk, p)),
    }

    def rejects(exc: type[KVQError], what: str, block: PackedKV) -> None:
        for name, call in zip(("decode", "attend"), calls[block.kind]):
            _expect(where, exc, f"{name} of {block.kind} with {what}", lambda: call(block))

    for p in (pk, pv):
        b, h, t, d = p.shape
        rejects(InputError, "zero tokens", dataclasses.replace(p, shape=(b, h, 0, d)))
        rejects(InputError, "zero kv heads", dataclasses.replace(p, shape=(b, 0, t, d)))
        rejects(LayoutError, f"a declared head_dim {2 * d} its fields lack", dataclasses.replace(p, shape=(b, h, t, 2 * d)))
        for bad in ("int8", "bool", "complex64", "float8"):
            rejects(LayoutError, f"dtype {bad!r}", dataclasses.replace(p, dtype=bad))
        rejects(LayoutError, "layer -3", dataclasses.replace(p, layer=-3))
        rejects(LayoutError, "layer 3 (the quantizer's is 0)", dataclasses.replace(p, layer=3))
        for name, field in p.layout.items():
            if field.dtype not in ("float16", "float32"):
                continue
            for value in (np.nan, np.inf, -np.inf):
                a = np.array(q.arrays.to_numpy(p.fields[name]), copy=True)
                a.reshape(-1)[a.size // 2] = value
                rejects(InputError, f"{value} in its stored {name!r}",
                        PackedKV(p.spec, p.kind, p.shape, {**p.fields, name: conv(a)}, p.layer, p.dtype))
    # the crafted block of the report: head_dim 2d declared by spec and shape, fields of head_dim d
    try:
        wide = Quantizer(spec.replace(head_dim=2 * head_dim), backend)
    except KVQError:
        wide = None
    if wide is not None:  # (a layout that does not depend on head_dim, e.g. QJL keys, is a valid block)
        forged = dataclasses.replace(pk, spec=wide.spec, shape=(*pk.shape[:3], 2 * head_dim))
        forged_v = dataclasses.replace(pv, spec=wide.spec, shape=(*pv.shape[:3], 2 * head_dim))
        keys_differ, values_differ = (dict(f.layout) != dict(p.layout) for f, p in ((forged, pk), (forged_v, pv)))
        if keys_differ:
            _expect(where, LayoutError, "decode of a head_dim-2d block with head_dim-d fields",
                    lambda: wide.decode_keys(forged))
        if keys_differ or values_differ:
            qwide = conv(rng.standard_normal((1, 4, 1, 2 * head_dim)).astype(np.float32))
            _expect(where, LayoutError, "attend over head_dim-2d blocks with head_dim-d fields",
                    lambda: wide.attend(qwide, forged, forged_v))
    # an explicit layer= decodes a block of that layer as that layer's quantizer does
    p3 = q.encode_keys(conv(x), layer=3)
    own = Quantizer(spec, backend, 3)
    got, want = (np.asarray(q.arrays.to_numpy(a), np.float64) for a in (q.decode_keys(p3, layer=3), own.decode_keys(p3)))
    if not np.array_equal(got, want):
        raise ConformanceError(f"{where}: decode_keys(block, layer=3) differs from layer 3's quantizer")
    _expect(where, InputError, "layer=-1", lambda: q.decode_keys(p3, layer=-1))
    # malformed from_dict input
    plain = pk.to_dict()
    malformed = {
        "a list": [1, 2],
        "no fields": {k: v for k, v in plain.items() if k != "fields"},
        "shape 'abc'": {**plain, "shape": "abc"},
        "shape of three": {**plain, "shape": [1, 2, 8]},
        "fields as a list": {**plain, "fields": [1, 2]},
        "a ragged field": {**plain, "fields": {**plain["fields"], next(iter(plain["fields"])): [[1, 2], [3]]}},
        "an object field": {**plain, "fields": {**plain["fields"], next(iter(plain["fields"])): [object()]}},
        "layer 'x'": {**plain, "layer": "x"},
        "dtype 7": {**plain, "dtype": 7},
        "a spec list": {**plain, "spec": [1]},
        "a spec with a bad parameter": {**plain, "spec": {**plain["spec"], "head_dim": "wide"}},
        "kind 'queries'": {**plain, "kind": "queries"},
        "zero kv heads": {**plain, "shape": [1, 0, 8, head_dim]},
    }
    for what, data in malformed.items():
        _expect(where, KVQError, f"from_dict of {what}", lambda: PackedKV.from_dict(data))
    # scales: beyond float32, and finite ones whose scaled logits overflow float32
    loud = conv(1e3 * rng.standard_normal((1, 4, 1, head_dim)).astype(np.float32))
    for scale in (1e300, float("inf"), 1e-300):
        _expect(where, InputError, f"attend scale={scale}", lambda: q.attend(qry, pk, pv, scale=scale))
    _expect(where, InputError, "attend scale=1e36 over logits ~1e3", lambda: q.attend(loud, pk, pv, scale=1e36))


# ------------------------------------------------------------------------------------------------
# drivers
# ------------------------------------------------------------------------------------------------
#: Fixed edge cases run on every method before the random ones; the i-th runs on the i-th of
#: the fixed specs (cyclically), so with two specs each gets a layer-0 and a non-zero-layer case.
EDGE_CASES: tuple[dict[str, Any], ...] = (
    dict(tokens=1, regime="gaussian", dtype="float32", layer=0),
    dict(tokens=33, regime="zeros", dtype="float16", layer=0),
    dict(tokens=17, regime="constant", dtype="bfloat16", layer=3),
    dict(tokens=45, regime="integers", dtype="float32", layer=5),
    dict(tokens=40, regime="gaussian", dtype="float32", layer=5),
)
#: The block of the tie check: tokens a multiple of every tie spec's token group.
TIE_TOKENS = 64


def fixed_spec_list(method: str, head_dim: int, spec_params: Mapping[str, Sequence[Any]] | None,
                    fixed_specs: Sequence[Mapping[str, Any]] | None) -> list[Any]:
    """The specs the edge cases run on: ``fixed_specs`` (parameter dicts) when given, else the
    first choice of every ``spec_params`` entry (the default spec for ``{}``) and, when drawing
    the built-in choices (``spec_params=None``), the method's :data:`EDGE_SPECS` entry.
    Parameter sets invalid at ``head_dim`` are skipped."""
    if fixed_specs is not None:
        params = [dict(p) for p in fixed_specs]
    else:
        params = [{name: tuple(choices)[0] for name, choices in (spec_params or {}).items()}]
        if spec_params is None and method in EDGE_SPECS:
            params.append(EDGE_SPECS[method])
    found = [make_spec_or_none(method, {**p, "head_dim": head_dim}) for p in params]
    specs = [s for s in found if s is not None]
    return specs or [registry.make_spec(method, head_dim=head_dim)]


def check_ties(backend: str, method: str, *, reference: str = REFERENCE,
               to_backend: Callable[[np.ndarray], Any] | None = None, head_dim: int = 64,
               kv_heads: int = 2, gqa: int = 2, q_len: int = 1, report: MethodReport | None = None) -> MethodReport:
    """The exact-tie check (see the module docstring) for a method listed in :data:`TIE_SPECS`;
    a no-op for other methods."""
    report = report or MethodReport(backend, method)
    spec = make_spec_or_none(method, {**TIE_SPECS.get(method, {}), "head_dim": head_dim})
    if method not in TIE_SPECS or spec is None:
        return report
    case = Case(spec, batch=1, kv_heads=kv_heads, tokens=TIE_TOKENS, gqa=gqa, q_len=q_len, dtype="float32",
                regime=TIE_REGIME, seed=4321, layer=1)
    return check_case(backend, case, reference=reference, to_backend=to_backend, report=report, exact_codes=True)


def check_method(
    backend: str,
    method: str,
    *,
    max_examples: int = 25,
    reference: str = REFERENCE,
    to_backend: Callable[[np.ndarray], Any] | None = None,
    head_dims: Sequence[int] = HEAD_DIMS,
    batches: Sequence[int] = (1, 2),
    kv_heads: Sequence[int] = (1, 2, 3),
    gqa: Sequence[int] = (1, 2, 3, 4),
    q_lens: Sequence[int] = (1, 2, 5),
    max_tokens: int = 160,
    tokens: Sequence[int] | None = None,
    dtypes: Sequence[str] = DTYPES,
    regimes: Sequence[str] = REGIMES,
    spec_params: Mapping[str, Sequence[Any]] | None = None,
    fixed_specs: Sequence[Mapping[str, Any]] | None = None,
    layers: Sequence[int] = LAYERS,
    edge_cases: bool = True,
    ties: bool = True,
    errors: bool = True,
    exact_codes: bool = False,
    derandomize: bool = True,
) -> MethodReport:
    """Conformance of one method on ``backend``: raises :class:`ConformanceError` on failure.

    ``max_examples`` random cases (hypothesis, derandomized by default so CI is reproducible),
    plus, with ``edge_cases``, fixed ones (1 token, zero blocks, constant groups, integer
    values). The keyword arguments restrict what is drawn, e.g. a compiled backend may pass
    one head_dim, one batch and ``spec_params={}`` (default spec only) to bound recompiles.
    ``to_backend`` converts a NumPy array to the backend's input (default: its adapter's
    ``asarray``; pass e.g. ``lambda a: torch.from_numpy(a).cuda()`` for a device).
    ``exact_codes=True`` turns the tie rule off (see :func:`check_case`). ``fixed_specs``
    (parameter dicts) names the specs of the edge cases (see :func:`fixed_spec_list`);
    ``layers`` the layers drawn; ``ties`` runs :func:`check_ties`. ``gqa`` includes 3 so that query
    tiles of 1, 2, 3 and 4 rows all occur with the default ``q_lens`` (CPU kernels compile a copy per
    row count).
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    ok, why = registry.backend_status(backend)
    if not ok:
        raise ConformanceError(f"backend {backend!r} is unavailable: {why}")
    report = MethodReport(backend, method)
    if errors:
        check_errors(backend, method, to_backend=to_backend, head_dim=head_dims[0])
    token_strategy = st.sampled_from(tuple(tokens)) if tokens is not None else None
    strategy = cases(method, head_dims=head_dims, batches=batches, kv_heads=kv_heads, gqa=gqa, q_lens=q_lens,
                     tokens=token_strategy if token_strategy is not None else token_counts(max_tokens),
                     dtypes=dtypes, regimes=regimes, spec_params=spec_params, layers=layers)
    if ties:
        check_ties(backend, method, reference=reference, to_backend=to_backend, head_dim=head_dims[0],
                   kv_heads=kv_heads[-1], gqa=gqa[-1], q_len=q_lens[0], report=report)
    device = _device_of(backend, to_backend)

    def served(case: Case) -> bool:
        """Cases whose spec the backend's ``supports`` refuses are counted, not checked."""
        ok = registry.supports(backend, case.spec, device)[0]
        report.unsupported += not ok
        return ok

    if edge_cases:
        specs = fixed_spec_list(method, head_dims[0], spec_params, fixed_specs)
        for i, ex in enumerate(EDGE_CASES):
            if ex["dtype"] not in dtypes or ex["regime"] not in regimes:
                continue
            t = ex["tokens"] if tokens is None else tokens[i % len(tokens)]
            case = Case(specs[i % len(specs)], batch=batches[0], kv_heads=kv_heads[-1], tokens=t, gqa=gqa[-1],
                        q_len=q_lens[0], dtype=ex["dtype"], regime=ex["regime"], seed=1234 + i, layer=ex["layer"])
            if served(case):
                check_case(backend, case, reference=reference, to_backend=to_backend, report=report,
                           exact_codes=exact_codes)
    if max_examples > 0:
        @settings(max_examples=max_examples, deadline=None, derandomize=derandomize, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  print_blob=True)
        @given(case=strategy)
        def run(case: Case) -> None:
            if served(case):
                check_case(backend, case, reference=reference, to_backend=to_backend, report=report,
                           exact_codes=exact_codes)

        run()
    if report.examples == 0 and (edge_cases or max_examples > 0):
        raise ConformanceError(f"{backend}/{method}: the backend's supports() refused all {report.unsupported} "
                               "drawn cases; nothing was checked (restrict the draw to what it serves)")
    return report


def _device_of(backend: str, to_backend: Callable[[np.ndarray], Any] | None) -> str | None:
    """The device type the suite's inputs land on for ``backend`` (None: host arrays)."""
    arrays = registry.backend_info(backend).arrays
    device_of = getattr(arrays, "device_of", None)
    if device_of is None:
        return None
    probe = np.zeros((1, 1, 1, 16), np.float32)
    return device_of(to_backend(probe) if to_backend else arrays.asarray(probe))


def check_backend(backend: str, methods: Iterable[str] | None = None, **kwargs: Any) -> ConformanceReport:
    """Conformance of every method (default: all the backend and the reference implement);
    stops at the first failing method and raises :class:`ConformanceError`. Keyword arguments
    go to :func:`check_method`."""
    names = list(methods) if methods is not None else methods_for(backend, kwargs.get("reference", REFERENCE))
    report = ConformanceReport(backend, [])
    for method in names:
        report.methods.append(check_method(backend, method, **kwargs))
    return report


def run_conformance(backend: str, methods: Iterable[str] | None = None, *, raise_on_failure: bool = True,
                    **kwargs: Any) -> ConformanceReport:
    """Like :func:`check_backend` but runs every method, collecting failures in the report
    (raised together at the end unless ``raise_on_failure=False``)."""
    names = list(methods) if methods is not None else methods_for(backend, kwargs.get("reference", REFERENCE))
    report = ConformanceReport(backend, [])
    for method in names:
        try:
            report.methods.append(check_method(backend, method, **kwargs))
        except (ConformanceError, KVQError, Exception) as exc:  # noqa: BLE001 - reported, not swallowed
            report.methods.append(MethodReport(backend, method, failure=f"{type(exc).__name__}: {exc}"))
    if raise_on_failure:
        report.raise_for_failures()
    return report


__all__ = [
    "ATTEND_LOGIT_RTOL", "ATTEND_RTOL", "DECODE_RTOL", "EDGE_CASES", "FIELD_RTOL", "REFERENCE", "TIE_RTOL", "TIE_RUNS",
    "TIE_TOKENS", "ConformanceError", "ConformanceReport", "MethodReport", "attend_tolerance", "check_backend",
    "check_case", "check_errors", "check_method", "check_ties", "decode_tolerance", "fixed_spec_list", "methods_for",
    "run_conformance",
]
