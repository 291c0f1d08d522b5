"""Built-in methods: each module holds one spec class; this plugin registers them all."""
from __future__ import annotations

from collections.abc import Callable

from kvq_core.hookspecs import hookimpl
from kvq_core.methods.fp16 import Fp16Spec
from kvq_core.methods.kivi import KiviSpec
from kvq_core.methods.octopus import OctopusSpec
from kvq_core.methods.oscar import OscarSpec
from kvq_core.methods.polarquant import PolarQuantSpec
from kvq_core.methods.qjl import QJLSpec
from kvq_core.methods.quarot import QuaRotSpec
from kvq_core.methods.turboquant import TurboQuantProdSpec, TurboQuantSpec
from kvq_core.registry import MethodInfo
from kvq_core.spec import MethodSpec

BUILTIN_SPECS: tuple[type[MethodSpec], ...] = (
    Fp16Spec,
    KiviSpec,
    OctopusSpec,
    OscarSpec,
    PolarQuantSpec,
    QJLSpec,
    QuaRotSpec,
    TurboQuantSpec,
    TurboQuantProdSpec,
)


@hookimpl
def kvq_register_methods(register: Callable[[MethodInfo], None]) -> None:
    for cls in BUILTIN_SPECS:
        register(MethodInfo(cls.method, cls, cls.summary))
