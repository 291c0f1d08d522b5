"""pluggy hook specifications: how methods and backends (built-in or third-party) join kvq.

A plugin is a module with ``@hookimpl`` functions of these names. Built-ins are registered
exactly like third-party plugins, which load from the entry-point group ``kvq.plugins``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from kvq_core.contract import BackendInfo, MethodInfo

PROJECT = "kvq"
ENTRY_POINT_GROUP = "kvq.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvq_register_methods(register: "Callable[[MethodInfo], None]") -> None:
    """Call ``register(MethodInfo(...))`` once per method this plugin defines."""


@hookspec
def kvq_register_backends(register: "Callable[[BackendInfo], None]") -> None:
    """Call ``register(BackendInfo(...))`` once per backend this plugin provides."""


@hookspec
def kvq_register_kernels(register: "Callable[[str, str, Any], None]") -> None:
    """Call ``register(backend, method, factory)`` to add kernels for ``method`` to a backend that
    another plugin registers (e.g. the built-in ``"numpy"``, ``"torch"``, ``"torch-compiled"``).

    ``factory`` is what a kernel table holds: a kernel class (a callable taking the spec), or a
    lazy ``"module:Attr"`` reference to one. It is stored in the backend's table as given and
    treated like the backend's own kernels: its ``BackendInfo.adapt`` applies (``torch-compiled``
    compiles it), and a ``torch_ops`` backend (``torch``, ``torch-compiled``, ``triton``) runs it
    through the ``kvq::`` ops, so it is a ``kvq_torch.common.TorchMethod`` subclass there. Runs
    after every plugin's methods and backends are registered. A ``(backend, method)`` pair that already has kernels is an error
    (the plugin then registers nothing); a backend that is not registered here (its package is
    missing, say) is skipped and noted under the plugin in ``kvq list``.
    """


@hookspec(firstresult=True)
def kvq_select_backend(method: str, device: str | None, candidates: Sequence[str]) -> str | None:
    """Pick a backend name for ``backend="auto"``, or return None to let the next plugin choose.

    ``device`` is None for NumPy arrays, else a torch device string such as ``"cpu"`` or
    ``"cuda:0"``; ``candidates`` are the backends that implement ``method`` and are not ruled
    out yet: the registry checks the chosen one (available, kernels load, supports the spec on
    the device) and, if it cannot serve, asks again without it.
    The NumPy reference answers last.
    """
