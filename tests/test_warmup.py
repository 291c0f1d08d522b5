"""``kvq warmup`` exercises encode, decode and attend of each method, with a progress line per step,
so the Numba kernels a cache uses are compiled (or loaded from the disk cache) before first use."""
from __future__ import annotations

import pytest

from kvq_core.tools.cli import main
from kvq_core.tools.warmup import parse_method


def test_parse_method_reads_typed_parameters() -> None:
    assert parse_method("oscar:bits=4,key_group=64") == ("oscar", {"bits": 4, "key_group": 64})
    assert parse_method("octopus:rounding=joint") == ("octopus", {"rounding": "joint"})
    with pytest.raises(SystemExit):
        parse_method("oscar:bits")


def test_warmup_reports_each_step(capsys) -> None:
    assert main(["warmup", "oscar:bits=2", "kivi", "--backend", "numpy", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    for step in ("encode", "decode", "attend"):
        assert out.count(f": {step} ...") == 2, out
    assert "oscar:bits=2 ready in" in out and "kivi ready in" in out and "done in" in out


def test_warmup_compiles_the_numba_kernels_a_cache_runs() -> None:
    pytest.importorskip("numba")
    from kvq_numba.cpu import intquant, rotation

    assert main(["warmup", "oscar:bits=2", "--head-dim", "64"]) == 0
    for kernel in (intquant.encode_token_groups, intquant.encode_channel_groups, rotation.unit_keys,
                   intquant.decode_token_groups, intquant.decode_channel_groups):
        assert kernel.signatures, kernel  # compiled or loaded from the disk cache in this process


def test_warmup_compiles_octopus_encode_for_blocks_and_for_one_token() -> None:
    pytest.importorskip("numba")
    from kvq_numba.cpu import octopus_codes

    assert main(["warmup", "octopus:bits=3", "--head-dim", "64"]) == 0
    for kernel in (octopus_codes.encode_serial, octopus_codes._triplet_codes, octopus_codes.signed_units):  # a decode step's token; a prefill
        assert kernel.signatures, kernel
