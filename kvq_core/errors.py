"""Typed errors: every error kvq raises derives from :class:`KVQError`.

Errors are raised at the API boundary and name the offending value and what was expected,
so nothing fails deep inside a kernel with an index error.
"""
from __future__ import annotations

from typing import Any


class KVQError(Exception):
    """Base of every kvq error."""


class SpecError(KVQError, ValueError):
    """A method parameter is unknown or out of range."""

    def __init__(self, method: str, param: str, value: Any, expected: str) -> None:
        self.method, self.param, self.value, self.expected = method, param, value, expected
        super().__init__(f"{method}: parameter {param}={value!r} is invalid; expected {expected}")


class InputError(KVQError, ValueError):
    """An array handed to a quantizer has the wrong rank, shape, dtype or contents."""


class UnknownMethodError(KVQError, LookupError):
    """No registered method has this name."""


class UnknownBackendError(KVQError, LookupError):
    """No registered backend has this name."""


class BackendUnavailableError(KVQError, RuntimeError):
    """The backend is registered but cannot run here (missing package, no GPU, ...)."""


class LayoutError(KVQError, ValueError):
    """A packed block does not match the layout its spec defines."""


class PluginError(KVQError, RuntimeError):
    """A plugin registered something inconsistent (duplicate name, bad record)."""


class MethodUnavailableError(KVQError, RuntimeError):
    """The method is registered but cannot be used here (its module failed to import, ...)."""


class ExportError(KVQError, RuntimeError):
    """A method, graph or opset has no export path to the requested format (e.g. ONNX)."""


class PlanError(KVQError, ValueError):
    """A tuned plan file is unreadable, of a newer format, or made for another model."""
