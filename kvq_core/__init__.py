"""kvq: compressed key/value caches for transformer inference (OScaR, OCTOPUS and baselines).

Start with :func:`get_quantizer`; :func:`list_methods` and :func:`list_backends` say what is
installed and why something is unavailable. Modules that moved in 0.2 still import from their old
paths until 0.3, with a DeprecationWarning (:mod:`kvq_core.moved`).
"""
from __future__ import annotations

from kvq_core import moved
from kvq_core.api import Quantizer, get_quantizer
from kvq_core.errors import (
    BackendUnavailableError,
    InputError,
    KVQError,
    LayoutError,
    PluginError,
    SpecError,
    UnknownBackendError,
    UnknownMethodError,
)
from kvq_core.packed import PackedKV, bits_per_element
from kvq_core.registry import list_backends, list_methods, list_plugins, make_spec, spec_from_dict
from kvq_core.spec import MethodSpec
from kvq_core.window_plan import WindowPlan

moved.install()

__all__ = [
    "BackendUnavailableError", "InputError", "KVQError", "LayoutError", "MethodSpec", "PackedKV",
    "PluginError", "Quantizer", "SpecError", "UnknownBackendError", "UnknownMethodError", "WindowPlan",
    "bits_per_element", "get_quantizer", "list_backends", "list_methods", "list_plugins",
    "make_spec", "spec_from_dict", "__version__",
]


def __getattr__(name: str) -> str:
    """``__version__``: the kvq being imported (:func:`kvq_core.registry.version`), read on first use."""
    if name == "__version__":
        from kvq_core.registry import version

        return version()
    raise AttributeError(f"module 'kvq_core' has no attribute {name!r}")
