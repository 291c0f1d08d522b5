"""kvq's public conformance suite: prove a backend (built-in or a plugin's) equal to the NumPy
reference. Needs ``hypothesis`` (``pip install 'kvq-core[dev]'``).

Quick start for a plugin author (in your own test suite)::

    import pytest
    from kvq_core import testing

    @pytest.mark.parametrize("method", testing.methods_for("mybackend"))
    def test_conformance(method):
        testing.check_method("mybackend", method, max_examples=25)

or, for a whole backend at once::

    report = testing.run_conformance("mybackend", max_examples=25)   # raises on failure
    print(report.summary())

What is checked, and the tie rule and tolerances, are documented in
:mod:`kvq_core.testing.conformance`; the case generators (shapes, GQA ratios, token counts that
are not multiples of any group size, head_dim 64/128, float32/float16/bfloat16, value regimes)
in :mod:`kvq_core.testing.strategies` (also the layer and every secondary spec parameter;
fixed edge cases on a non-default spec and at non-zero layers; an exact round-half-to-even
tie check for integer-grid methods). Restrict the draw with the keyword arguments of
:func:`check_method` (e.g. ``head_dims=(64,)``, ``spec_params={}`` for default specs only), and
place inputs on a device with ``to_backend=`` (e.g. ``lambda a: torch.from_numpy(a).cuda()``).
"""
from kvq_core.testing.conformance import (
    ATTEND_LOGIT_RTOL,
    ATTEND_RTOL,
    DECODE_RTOL,
    EDGE_CASES,
    FIELD_RTOL,
    REFERENCE,
    TIE_RTOL,
    TIE_RUNS,
    TIE_TOKENS,
    ConformanceError,
    ConformanceReport,
    MethodReport,
    attend_tolerance,
    check_backend,
    check_case,
    check_errors,
    check_method,
    check_tampered,
    check_ties,
    decode_tolerance,
    fixed_spec_list,
    methods_for,
    run_conformance,
)
from kvq_core.testing.strategies import (
    DTYPES,
    EDGE_SPECS,
    HEAD_DIMS,
    LAYERS,
    REGIMES,
    SPEC_PARAMS,
    TIE_SPECS,
    Case,
    case_arrays,
    cases,
    specs,
)

__all__ = [
    "ATTEND_LOGIT_RTOL", "ATTEND_RTOL", "DECODE_RTOL", "DTYPES", "EDGE_CASES", "EDGE_SPECS", "FIELD_RTOL", "HEAD_DIMS",
    "LAYERS", "REFERENCE", "REGIMES", "SPEC_PARAMS", "TIE_RTOL", "TIE_RUNS", "TIE_SPECS", "TIE_TOKENS", "Case",
    "ConformanceError", "ConformanceReport", "MethodReport", "attend_tolerance", "case_arrays", "cases",
    "check_backend", "check_case", "check_errors", "check_method", "check_tampered", "check_ties", "decode_tolerance",
    "fixed_spec_list", "methods_for", "run_conformance", "specs",
]
