"""Built-in methods: each module holds one spec class; this plugin registers them all.

The catalogue names each spec class by a lazy ``"module:Attr"`` reference, so a method whose
module fails to import (a missing optional dependency, say) is unavailable with the reason and
every other method still works.
"""
from __future__ import annotations

from collections.abc import Callable

from kvq_core.hookspecs import hookimpl
from kvq_core.contract import MethodInfo

#: (name, spec class reference, one-line summary) per built-in method.
BUILTIN_METHODS: tuple[tuple[str, str, str], ...] = (
    ("fp16", "kvq_core.methods.fp16:Fp16Spec",
     "identity codec: K/V stored as float16 (or float32); the exactness baseline"),
    ("kivi", "kvq_core.methods.kivi:KiviSpec",
     "KIVI: asymmetric INT-b, keys per channel over token groups, values per token over channel groups"),
    ("octopus", "kvq_core.methods.octopus:OctopusSpec",
     "OCTOPUS: Hadamard rotation, triplets in octahedral polar form, Lloyd-Max codebooks"),
    ("oscar", "kvq_core.methods.oscar:OscarSpec",
     "OScaR: per-head Hadamard rotation + omni-token key norm, asymmetric INT-b groups (K over tokens, V over channels)"),
    ("polarquant", "kvq_core.methods.polarquant:PolarQuantSpec",
     "PolarQuant: randomized Hadamard rotation, recursive polar transform, per-level angle codebooks"),
    ("qjl", "kvq_core.methods.qjl:QJLSpec",
     "QJL: 1-bit signs of a random sketch of each key plus its norm; per-token INT values"),
    ("quarot", "kvq_core.methods.quarot:QuaRotSpec",
     "QuaRot-KV: per-head Hadamard rotation, per-token asymmetric INT-b (group = head_dim)"),
    ("turboquant", "kvq_core.methods.turboquant:TurboQuantSpec",
     "TurboQuant (MSE): random rotation, per-coordinate Lloyd-Max codebook, float32 norm"),
    ("turboquant_prod", "kvq_core.methods.turboquant:TurboQuantProdSpec",
     "TurboQuant (prod): (b-1)-bit TurboQuant + 1-bit QJL on the residual, unbiased inner products"),
)


@hookimpl
def kvq_register_methods(register: Callable[[MethodInfo], None]) -> None:
    for name, ref, summary in BUILTIN_METHODS:
        register(MethodInfo(name, ref, summary))
