"""The plugin registry: a pluggy PluginManager that collects methods and backends.

Built-in plugins (``DEFAULT_PLUGINS``) register through the same hooks as third-party ones,
which load from the ``kvq.plugins`` entry-point group unless ``KVQ_DISABLE_PLUGINS=1``.
A plugin that fails to import, or implements a misspelt hook, is recorded as unavailable with
its error; it never breaks ``import kvq_core``.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import pluggy

from kvq_core import hookspecs
from kvq_core.errors import (
    BackendUnavailableError,
    KVQError,
    PluginError,
    SpecError,
    UnknownBackendError,
    UnknownMethodError,
)
from kvq_core.spec import MethodSpec

# (plugin name, module) of the built-ins; backends whose imports fail are listed unavailable.
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("kvq-methods", "kvq_core.methods"),
    ("numpy", "kvq_numpy.plugin"),
    ("torch", "kvq_torch.plugin"),
    ("numba", "kvq_numba.plugin"),
)
DISABLE_ENV = "KVQ_DISABLE_PLUGINS"


class ArrayAdapter(Protocol):
    """How the core talks to a backend's array type without importing it."""

    def asarray(self, x: Any) -> Any:
        """Convert a NumPy array (or the backend's own array) to the backend's array type."""

    def to_numpy(self, x: Any) -> Any:
        """Convert a backend array to NumPy."""

    def all_finite(self, x: Any) -> bool:
        """True when no element is NaN or infinite."""

    def cast(self, x: Any, dtype: str) -> Any:
        """``x`` in the floating dtype named ``dtype`` (e.g. "float16", "bfloat16"), where it exists."""

    # Optional: ``concat(xs, axis)`` joins backend arrays; without it the core joins packed
    # blocks through NumPy (:func:`kvq_core.layout.concat_tokens`).


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """A method: its name, spec class and one-line summary."""

    name: str
    spec_cls: type[MethodSpec]
    summary: str = ""


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """A backend: a table from method name to kernel class (called with the spec).

    ``is_available`` returns ``(True, None)`` or ``(False, reason)``; it is asked lazily.
    """

    name: str
    kernels: Mapping[str, Callable[[MethodSpec], Any]]
    arrays: ArrayAdapter
    is_available: Callable[[], tuple[bool, str | None]] = lambda: (True, None)
    summary: str = ""


@dataclasses.dataclass(frozen=True)
class Record:
    """What ``list_methods`` / ``list_backends`` / ``list_plugins`` return."""

    name: str
    available: bool
    reason: str | None
    origin: str
    detail: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _State:
    pm: pluggy.PluginManager
    methods: dict[str, tuple[MethodInfo, str]]
    backends: dict[str, tuple[BackendInfo, str]]
    plugins: list[Record]


_lock = threading.Lock()
_state: _State | None = None


def _origin_of(plugin_name: str, dist: str | None) -> str:
    return f"plugin {plugin_name} ({dist})" if dist else f"built-in {plugin_name}"


def _load() -> _State:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    plugins: list[Record] = []
    pm.register(sys.modules[__name__], name="kvq-core")

    def try_register(name: str, load: Callable[[], Any], origin: str) -> None:
        try:
            module = load()
            pm.register(module, name=name)
        except Exception as exc:  # any import/validation failure leaves the plugin unavailable
            plugins.append(Record(name, False, f"{type(exc).__name__}: {exc}", origin))
            return
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            pm.unregister(name=name)
            plugins.append(Record(name, False, f"PluginValidationError: {exc}", origin))
            return
        plugins.append(Record(name, True, None, origin))

    for name, module in DEFAULT_PLUGINS:
        try_register(name, lambda m=module: importlib.import_module(m), _origin_of(name, None))
    if os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes"):
        for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.value
            try_register(ep.name, ep.load, _origin_of(ep.name, dist))

    methods: dict[str, tuple[MethodInfo, str]] = {}
    backends: dict[str, tuple[BackendInfo, str]] = {}
    for plugin_name, plugin in pm.list_name_plugin():
        origin = next((r.origin for r in plugins if r.name == plugin_name), "built-in kvq-core")
        for hook, table, kind in (
            (plugin and getattr(plugin, "kvq_register_methods", None), methods, MethodInfo),
            (plugin and getattr(plugin, "kvq_register_backends", None), backends, BackendInfo),
        ):
            if hook is None:
                continue

            def register(info: Any, table: dict = table, kind: type = kind, origin: str = origin) -> None:
                if not isinstance(info, kind):
                    raise PluginError(f"{origin} registered {info!r}; expected a {kind.__name__}")
                if info.name in table:
                    raise PluginError(f"{origin} registers {kind.__name__} {info.name!r}, already from {table[info.name][1]}")
                table[info.name] = (info, origin)

            try:
                hook(register=register)
            except Exception as exc:
                plugins[:] = [
                    Record(r.name, False, f"{type(exc).__name__}: {exc}", r.origin) if r.name == plugin_name else r
                    for r in plugins
                ]
    return _State(pm, methods, backends, plugins)


def state() -> _State:
    """The loaded registry (loaded once, lazily, on first use)."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
        return _state


def reload() -> None:
    """Forget the loaded registry (tests, or after installing a plugin at run time)."""
    global _state
    with _lock:
        _state = None


def method_info(name: str) -> MethodInfo:
    try:
        return state().methods[name][0]
    except KeyError:
        raise UnknownMethodError(f"unknown method {name!r}; registered: {', '.join(sorted(state().methods))}") from None


def backend_info(name: str) -> BackendInfo:
    try:
        return state().backends[name][0]
    except KeyError:
        known = sorted(state().backends)
        failed = [f"{r.name} ({r.reason})" for r in state().plugins if not r.available]
        extra = f"; plugins that failed to load: {'; '.join(failed)}" if failed else ""
        raise UnknownBackendError(f"unknown backend {name!r}; registered: {', '.join(known)}{extra}") from None


def backend_status(name: str) -> tuple[bool, str | None]:
    info = backend_info(name)
    try:
        return info.is_available()
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"


def make_spec(method: str, **params: Any) -> MethodSpec:
    """The validated spec of ``method`` with ``params`` (unknown ones raise SpecError)."""
    return method_info(method).spec_cls.from_params(params)


def spec_from_dict(data: Mapping[str, Any]) -> MethodSpec:
    """Inverse of ``MethodSpec.to_dict()``."""
    if not isinstance(data, Mapping) or "method" not in data:
        raise SpecError("spec", "method", data, "a dict with a 'method' key")
    params = {k: v for k, v in data.items() if k != "method"}
    return make_spec(str(data["method"]), **params)


def select_backend(method: str, device: str | None = None) -> str:
    """Resolve ``backend="auto"`` through the firstresult hook ``kvq_select_backend``."""
    candidates = [n for n, (info, _) in state().backends.items() if method in info.kernels and backend_status(n)[0]]
    if not candidates:
        raise BackendUnavailableError(f"no available backend implements method {method!r}")
    chosen = state().pm.hook.kvq_select_backend(method=method, device=device, candidates=candidates)
    if chosen not in candidates:
        raise BackendUnavailableError(f"backend selection returned {chosen!r}; candidates were {candidates}")
    return chosen


def list_methods() -> list[Record]:
    """One record per method; available when some available backend implements it."""
    out = []
    for name, (info, origin) in sorted(state().methods.items()):
        backends = tuple(b for b, (bi, _) in sorted(state().backends.items()) if name in bi.kernels)
        usable = [b for b in backends if backend_status(b)[0]]
        reason = None if usable else "no available backend implements it"
        out.append(Record(name, bool(usable), reason, origin, backends))
    return out


def list_backends() -> list[Record]:
    """One record per backend, plus one per plugin that failed to load (unavailable, with why)."""
    out = []
    for name, (info, origin) in sorted(state().backends.items()):
        ok, reason = backend_status(name)
        out.append(Record(name, ok, reason, origin, tuple(sorted(info.kernels))))
    registered = {r.origin for r in out}
    for rec in state().plugins:
        if not rec.available and rec.origin not in registered:
            out.append(rec)
    return out


def list_plugins() -> list[Record]:
    return list(state().plugins)


@hookspecs.hookimpl(trylast=True)
def kvq_select_backend(method: str, device: str | None, candidates: list[str]) -> str | None:
    """Last resort: the NumPy reference when it can serve, else the first candidate."""
    return "numpy" if "numpy" in candidates else candidates[0]


__all__ = [
    "ArrayAdapter", "BackendInfo", "MethodInfo", "Record", "KVQError", "DEFAULT_PLUGINS",
    "list_methods", "list_backends", "list_plugins", "make_spec", "spec_from_dict", "select_backend",
]
