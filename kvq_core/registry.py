"""The plugin registry: a pluggy PluginManager that collects methods, backends and kernels.

Every plugin, built-in or third-party, is a module named in the ``kvq.plugins`` entry-point
group. kvq's own entries (``pyproject.toml``: the method catalogue, numpy, torch, triton, numba) are
the built-ins, always loaded (:func:`builtin_plugins` says where they are read from); other
distributions' entries load unless ``KVQ_DISABLE_PLUGINS=1``. Hooks run in two passes: every
plugin's methods and backends, then every plugin's kernels for backends registered by others
(``kvq_register_kernels``), so a plugin may add kernels to any backend whatever the load order.
Each backend's table here is the only kernel table: kernels another plugin adds are stored in
it as given and get the backend's treatment (``BackendInfo.adapt``, ``torch_ops``) like its own.

A failure stays where it happens:

- a plugin that fails to import, implements a misspelt hook, or raises in a hook (a duplicate
  name, say) is recorded as unavailable with its error, and *none* of its registrations are
  kept (a hook's registrations count only when the hook finishes);
- a method's spec class and each entry of a backend's kernel table may be lazy
  ``"module:Attr"`` references, resolved separately on first use: a failing import makes only
  that method, or that backend's kernels for it, unavailable, with the reason.

Nothing here ever breaks ``import kvq_core``.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq_core.errors import (
    BackendUnavailableError,
    MethodUnavailableError,
    PluginError,
    SpecError,
    UnknownBackendError,
    UnknownMethodError,
)
from kvq_core.contract import ALL_METHODS, ArrayAdapter, BackendInfo, MethodInfo, resolve
from kvq_core.packed import set_spec_resolver
from kvq_core.spec import MethodSpec

if TYPE_CHECKING:  # pragma: no cover
    import importlib.metadata

    import pluggy

# pluggy, importlib.metadata and tomllib are imported when the registry loads (first use), not
# with kvq_core: ``import kvq_core`` stays cheap.

#: The distribution whose ``kvq.plugins`` entry points are the built-ins (``pip install kvq-core``;
#: the import name is ``kvq_core``, the command ``kvq``).
KVQ_DIST = "kvq-core"
DISABLE_ENV = "KVQ_DISABLE_PLUGINS"
#: Names users pass as ``backend=`` that are devices: the hint says to pass them as ``device=``.
DEVICE_NAMES = ("cuda", "cpu", "gpu", "mps", "xpu")


def normalized(dist: str) -> str:
    """A distribution name as PEP 503 compares them (``kvq_core`` and ``KVQ-Core`` are ``kvq-core``)."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def install_hint(extra: str | None = None) -> str:
    """The pip command that installs kvq with ``extra``: ``pip install 'kvq-core[torch]'``, or from
    the source checkout kvq runs from, ``pip install -e '.[torch]'`` (its path when not the cwd)."""
    found = _checkout_project()
    if found is None:
        return f"pip install '{KVQ_DIST}[{extra}]'" if extra else f"pip install {KVQ_DIST}"
    root = found[1].parent
    where = "." if root == Path.cwd().resolve() else str(root)
    return f"pip install -e '{where}[{extra}]'" if extra else f"pip install -e '{where}'"


@dataclasses.dataclass(frozen=True)
class Record:
    """What ``list_methods`` / ``list_backends`` / ``list_plugins`` return.

    ``detail`` lists the backends of a method, the methods a backend serves, or what a plugin
    registered (``"method fp8"``, ``"kernels numpy/fp8"``); ``problems`` the parts that failed
    (``"name: reason"``), e.g. one method's kernels that did not import, or a plugin's kernels
    for a backend that is not registered here.
    """

    name: str
    available: bool
    reason: str | None
    origin: str
    detail: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Lazy:
    """A lazily resolved reference and the outcome of resolving it (value or reason); ``adapt``,
    when given, is applied to the resolved value (a backend's ``BackendInfo.adapt``)."""

    __slots__ = ("ref", "adapt", "_value", "_error", "_done")

    def __init__(self, ref: Any, adapt: Callable[[Any], Any] | None = None) -> None:
        self.ref, self.adapt, self._value, self._error, self._done = ref, adapt, None, None, False

    def get(self) -> tuple[Any, str | None]:
        if not self._done:
            try:
                value = resolve(self.ref)
                self._value = value if self.adapt is None else self.adapt(value)
            except Exception as exc:  # any import failure stays with this entry
                self._error = _why(exc)
            self._done = True
        return self._value, self._error


class _LazyArrays:
    """A backend's array adapter named by a ``"module:Attr"`` reference (an adapter instance or
    class), imported on first use: registering a torch-tensor backend imports no torch.

    Each attribute is looked up on the adapter once and then kept on this object, so later
    calls cost what calls on the adapter itself cost; an optional method the adapter lacks
    raises AttributeError as it would (``getattr(arrays, "device_of", None)`` works)."""

    def __init__(self, ref: str) -> None:
        self._ref = ref

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        impl = self.__dict__.get("_impl")
        if impl is None:
            obj = resolve(self._ref)
            impl = self.__dict__["_impl"] = obj() if isinstance(obj, type) else obj
        value = getattr(impl, name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return f"<array adapter {self._ref}>"


@dataclasses.dataclass
class _Method:
    info: MethodInfo
    origin: str
    spec: _Lazy


@dataclasses.dataclass
class _Backend:
    info: BackendInfo
    origin: str
    #: method -> kernel class (after ``info.adapt``): the backend's kernel table
    kernels: dict[str, _Lazy]
    #: method (or ``ALL_METHODS``) -> class serving ``kvq::attend_paged`` / ``kvq::write_paged``
    paged: dict[str, _Lazy]
    paged_write: dict[str, _Lazy]
    #: method -> origin of kernels another plugin added (``kvq_register_kernels``)
    added: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, info: BackendInfo, origin: str) -> _Backend:
        """The registry's entry for ``info``: every table entry a lazy reference of its own."""
        return cls(info, origin, {m: _Lazy(ref, info.adapt) for m, ref in info.kernels.items()},
                   {m: _Lazy(ref) for m, ref in info.paged.items()},
                   {m: _Lazy(ref) for m, ref in info.paged_write.items()})


@dataclasses.dataclass
class _State:
    pm: pluggy.PluginManager
    methods: dict[str, _Method]
    backends: dict[str, _Backend]
    plugins: list[Record]


_lock = threading.RLock()
_state: _State | None = None


def _origin_of(plugin_name: str, dist: str | None) -> str:
    return f"plugin {plugin_name} ({dist})" if dist else f"built-in {plugin_name}"


def _dist_name(ep: importlib.metadata.EntryPoint) -> str | None:
    return normalized(ep.dist.name) if ep.dist is not None else None


def _checkout_project() -> tuple[dict[str, Any], Path] | None:
    """The ``[project]`` table of the source checkout ``kvq_core`` sits in, if it is kvq's own."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the built-ins are read from kvq's installed metadata
        return None
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        return None
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    return (project, pyproject) if normalized(str(project.get("name", ""))) == KVQ_DIST else None


def extras() -> tuple[str, ...]:
    """kvq's optional extras (``torch``, ``numba``, ...), from the checkout or the installed metadata."""
    found = _checkout_project()
    if found is not None:
        return tuple(found[0].get("optional-dependencies", {}))
    import importlib.metadata

    try:
        return tuple(importlib.metadata.metadata(KVQ_DIST).get_all("Provides-Extra") or ())
    except importlib.metadata.PackageNotFoundError:
        return ()


@functools.cache
def version() -> str:
    """kvq's version: the ``pyproject.toml`` of the source checkout ``kvq_core`` sits in (an editable
    install's metadata may predate it), else the installed distribution's metadata, else ``0+unknown``."""
    found = _checkout_project()
    if found is not None and "version" in found[0]:
        return str(found[0]["version"])
    import importlib.metadata

    try:
        return importlib.metadata.version(KVQ_DIST)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def builtin_plugins() -> tuple[tuple[tuple[str, str], ...], str]:
    """kvq's own ``kvq.plugins`` entry points as ``(name, "module")`` pairs, and where they were read.

    The table of the kvq being imported: the ``pyproject.toml`` of the source checkout that
    ``kvq_core`` sits in (a PYTHONPATH run, or an editable install whose metadata may predate the
    table), else the installed distribution's metadata (a wheel). Adding a backend is one line
    in that table; no core file changes."""
    import importlib.metadata

    from kvq_core import hookspecs

    found = _checkout_project()
    if found is not None:
        table = found[0].get("entry-points", {}).get(hookspecs.ENTRY_POINT_GROUP, {})
        return tuple((str(k), str(v)) for k, v in table.items()), str(found[1])
    eps = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    return tuple((ep.name, ep.value) for ep in eps if _dist_name(ep) == KVQ_DIST), f"the installed {KVQ_DIST} metadata"


def _import_ref(ref: str) -> Any:
    """An entry point's object: a module (``"pkg.mod"``) or an attribute (``"pkg.mod:obj"``)."""
    return resolve(ref) if ":" in ref else importlib.import_module(ref)


def _missing_extra(name: str, exc: BaseException) -> str:
    """The install hint for a built-in plugin that failed to import a package (its extra)."""
    if not isinstance(exc, ImportError):
        return ""
    return f"; install it with {install_hint(name)}" if name in extras() else ""


def _load_plugins(pm: pluggy.PluginManager) -> dict[str, Record]:
    """Register the built-ins, then (unless disabled) every other ``kvq.plugins`` entry point;
    one record per plugin, loaded or failed with the reason."""
    import importlib.metadata

    import pluggy

    from kvq_core import hookspecs

    plugins: dict[str, Record] = {}

    def try_register(name: str, load: Callable[[], Any], origin: str, builtin: bool = False) -> None:
        if name in plugins:  # two distributions chose one entry-point name: keep both records
            name = f"{name} [{origin}]"
        try:
            pm.register(load(), name=name)
        except Exception as exc:  # any import/validation failure leaves the plugin unavailable
            plugins[name] = Record(name, False, _why(exc) + (_missing_extra(name, exc) if builtin else ""), origin)
            return
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            pm.unregister(name=name)
            plugins[name] = Record(name, False, _why(exc), origin)
            return
        plugins[name] = Record(name, True, None, origin)

    table, source = builtin_plugins()
    if not table:
        plugins[KVQ_DIST] = Record(KVQ_DIST, False, f"no built-in plugins: {source} has no [project.entry-points."
                                   f"\"{hookspecs.ENTRY_POINT_GROUP}\"] table; reinstall kvq (pip install -e .)",
                                   f"built-in ({source})")
    for name, ref in table:
        try_register(name, lambda r=ref: _import_ref(r), _origin_of(name, None), builtin=True)
    own = {"kvq_core"} | {ref.split(".")[0].split(":")[0] for _, ref in table}  # kvq's top-level packages
    if os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes"):
        for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            if _dist_name(ep) == KVQ_DIST or ep.value.split(".")[0].split(":")[0] in own:
                continue  # the built-ins, loaded above (or kvq's own modules left by an install under a former name)
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.value
            try_register(ep.name, ep.load, _origin_of(ep.name, dist))
    return plugins


@dataclasses.dataclass
class _Collected:
    """What the hooks registered: methods, backends, and per plugin what it added (its record's detail)."""

    plugins: dict[str, Record]
    methods: dict[str, _Method] = dataclasses.field(default_factory=dict)
    backends: dict[str, _Backend] = dataclasses.field(default_factory=dict)
    registered: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def origin(self, plugin_name: str) -> str:
        record = self.plugins.get(plugin_name)
        return record.origin if record else "built-in kvq-core"

    def fail(self, plugin_name: str, exc: Exception) -> None:
        """The plugin failed: record why and take back everything it registered."""
        for item in self.registered.pop(plugin_name, []):
            kind, _, name = item.partition(" ")
            if kind in ("method", "backend"):
                (self.methods if kind == "method" else self.backends).pop(name, None)
        self.plugins[plugin_name] = Record(plugin_name, False, _why(exc), self.origin(plugin_name))


def _collect_methods_and_backends(pm: pluggy.PluginManager, got: _Collected) -> None:
    """Pass 1: each plugin's methods and backends, kept only when all its hooks finish."""
    for plugin_name, plugin in pm.list_name_plugin():
        origin = got.origin(plugin_name)
        pending: dict[type, dict[str, Any]] = {MethodInfo: {}, BackendInfo: {}}

        def register(info: Any, kind: type, table: dict, origin: str = origin, pending: dict = pending) -> None:
            if not isinstance(info, kind):
                raise PluginError(f"{origin} registered {info!r}; expected a {kind.__name__}")
            taken = table.get(info.name) or pending[kind].get(info.name)
            if taken is not None:
                raise PluginError(f"{origin} registers {kind.__name__} {info.name!r}, already from {taken.origin}")
            if kind is MethodInfo:
                pending[kind][info.name] = _Method(info, origin, _Lazy(info.spec_cls))
            else:
                if isinstance(info.arrays, str):
                    info = dataclasses.replace(info, arrays=_LazyArrays(info.arrays))
                pending[kind][info.name] = _Backend.of(info, origin)

        try:
            if hasattr(plugin, "kvq_register_methods"):
                plugin.kvq_register_methods(register=lambda i: register(i, MethodInfo, got.methods))
            if hasattr(plugin, "kvq_register_backends"):
                plugin.kvq_register_backends(register=lambda i: register(i, BackendInfo, got.backends))
        except Exception as exc:
            got.fail(plugin_name, exc)
            continue
        got.methods.update(pending[MethodInfo])
        got.backends.update(pending[BackendInfo])
        got.registered[plugin_name] = ([f"method {m}" for m in pending[MethodInfo]]
                                       + [f"backend {b}" for b in pending[BackendInfo]])


def _collect_kernels(pm: pluggy.PluginManager, got: _Collected) -> None:
    """Pass 2: each plugin's kernels for backends any plugin registered (``kvq_register_kernels``),
    stored in the backend's table as given; all or nothing per plugin, its pass-1 work included."""
    for plugin_name, plugin in pm.list_name_plugin():
        if plugin_name not in got.registered or not hasattr(plugin, "kvq_register_kernels"):
            continue
        origin = got.origin(plugin_name)
        added: dict[tuple[str, str], Any] = {}
        skipped: list[str] = []

        def register(backend: str, method: str, factory: Any, origin: str = origin,
                     added: dict = added, skipped: list = skipped) -> None:
            if not (isinstance(backend, str) and isinstance(method, str)):
                raise PluginError(f"{origin} registered kernels for ({backend!r}, {method!r}); expected two names")
            if backend not in got.backends:
                skipped.append(f"kernels {backend}/{method}: backend {backend!r} is not registered here")
                return
            entry = got.backends[backend]
            if method in entry.kernels:
                owner = entry.added.get(method, entry.origin)
                raise PluginError(f"{origin} registers kernels for {method!r} on backend {backend!r}, already from {owner}")
            if (backend, method) in added:
                raise PluginError(f"{origin} registers kernels for {method!r} on backend {backend!r} twice")
            added[(backend, method)] = factory

        try:
            plugin.kvq_register_kernels(register=register)
        except Exception as exc:
            got.fail(plugin_name, exc)
            continue
        for (backend, method), entry in added.items():
            target = got.backends[backend]
            target.kernels[method] = _Lazy(entry, target.info.adapt)
            target.added[method] = origin
            target.info = dataclasses.replace(target.info, kernels={**target.info.kernels, method: entry})
            got.registered[plugin_name].append(f"kernels {backend}/{method}")
        if skipped:
            got.plugins[plugin_name] = dataclasses.replace(got.plugins[plugin_name], problems=tuple(skipped))


def _load() -> _State:
    import pluggy

    from kvq_core import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    hookspecs.hookimpl(trylast=True)(kvq_select_backend)  # marks this module's hook (pluggy is loaded now)
    pm.register(sys.modules[__name__], name="kvq-core")
    got = _Collected(_load_plugins(pm))
    _collect_methods_and_backends(pm, got)
    _collect_kernels(pm, got)
    for plugin_name, items in got.registered.items():
        if plugin_name in got.plugins:
            got.plugins[plugin_name] = dataclasses.replace(got.plugins[plugin_name], detail=tuple(items))
    return _State(pm, got.methods, got.backends, list(got.plugins.values()))


def state() -> _State:
    """The loaded registry (loaded once, lazily, on first use)."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
        return _state


_on_reload: list[Callable[[], None]] = []


def on_reload(clear: Callable[[], None]) -> None:
    """Call ``clear()`` whenever the registry is reloaded: a cache of objects built from it (the
    ``kvq::`` ops' kernel objects) is dropped with it."""
    _on_reload.append(clear)


def reload() -> None:
    """Forget the loaded registry (tests, or after installing a plugin at run time)."""
    global _state
    with _lock:
        _state = None
        for clear in _on_reload:
            clear()


# ------------------------------------------------------------------------------------------------
# methods
# ------------------------------------------------------------------------------------------------
def _did_you_mean(name: Any, known: list[str]) -> str:
    """``"did you mean 'oscar'? "`` for a misspelt name, else ``""``."""
    close = difflib.get_close_matches(str(name).lower(), known, n=2, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


def _failed_plugins() -> str:
    failed = [f"{r.name} ({r.reason})" for r in state().plugins if not r.available]
    return f"; plugins that failed to load: {'; '.join(failed)}" if failed else ""


def _method(name: str) -> _Method:
    try:
        return state().methods[name]
    except KeyError:
        known = sorted(state().methods)
        raise UnknownMethodError(f"unknown method {name!r}; {_did_you_mean(name, known)}"
                                 f"registered: {', '.join(known)}{_failed_plugins()}") from None


def method_status(name: str) -> tuple[bool, str | None]:
    """``(True, None)`` when the method's spec class imports, else ``(False, reason)``."""
    spec_cls, error = _method(name).spec.get()
    return (False, error) if error else (True, None)


def method_info(name: str) -> MethodInfo:
    """The method's record with its spec class resolved; raises MethodUnavailableError with the reason."""
    entry = _method(name)
    spec_cls, error = entry.spec.get()
    if error:
        raise MethodUnavailableError(f"{name} is unavailable: {error}")
    if not (isinstance(spec_cls, type) and issubclass(spec_cls, MethodSpec)):
        raise MethodUnavailableError(f"{name} is unavailable: {entry.info.spec_cls!r} is not a MethodSpec subclass")
    return dataclasses.replace(entry.info, spec_cls=spec_cls)


def make_spec(method: str, **params: Any) -> MethodSpec:
    """The validated spec of ``method`` with ``params`` (unknown ones raise SpecError)."""
    return method_info(method).spec_cls.from_params(params)  # type: ignore[union-attr]


def spec_from_dict(data: Mapping[str, Any]) -> MethodSpec:
    """Inverse of ``MethodSpec.to_dict()``."""
    if not isinstance(data, Mapping) or "method" not in data:
        raise SpecError("spec", "method", data, "a dict with a 'method' key")
    params = {k: v for k, v in data.items() if k != "method"}
    return make_spec(str(data["method"]), **params)


set_spec_resolver(spec_from_dict)


# ------------------------------------------------------------------------------------------------
# backends
# ------------------------------------------------------------------------------------------------
def _backend(name: str) -> _Backend:
    try:
        return state().backends[name]
    except KeyError:
        known = sorted(state().backends)
        if isinstance(name, str) and name.split(":")[0].lower() in DEVICE_NAMES:
            hint = (f"{name!r} is a device, not a backend: pass device={name!r} (with backend='auto', which picks a "
                    f"backend that serves the spec there, or a backend by name); ")
        else:
            hint = _did_you_mean(name, known)
        raise UnknownBackendError(f"unknown backend {name!r}; {hint}registered: {', '.join(known)}"
                                  f"{_failed_plugins()}") from None


def backend_info(name: str) -> BackendInfo:
    """The backend as registered; its ``kernels`` include those other plugins added."""
    return _backend(name).info


def backend_status(name: str) -> tuple[bool, str | None]:
    """Whether the backend as a whole can run here (its ``is_available``)."""
    info = _backend(name).info
    try:
        return info.is_available()
    except Exception as exc:
        return False, _why(exc)


def kernel_factory(backend: str, method: str) -> Callable[[MethodSpec], Any]:
    """The backend's kernel class for ``method`` (after the backend's ``adapt``), called with a
    spec to build the kernels; raises BackendUnavailableError naming why not. On a ``torch_ops``
    backend it works on torch tensors: :class:`kvq_core.Quantizer` calls it through the ``kvq::`` ops."""
    entry = _backend(backend)
    lazy = entry.kernels.get(method)
    if lazy is None:
        raise BackendUnavailableError(
            f"backend {backend!r} has no kernels for method {method!r}; it implements {sorted(entry.kernels)}")
    factory, error = lazy.get()
    if error:
        raise BackendUnavailableError(f"backend {backend!r} cannot serve {method!r}: its kernels failed to load: {error}")
    return factory


def paged_factory(backend: str, method: str, write: bool = False) -> Callable[[MethodSpec], Any] | None:
    """The backend's class serving ``kvq::attend_paged`` (``write``: ``kvq::write_paged``) for
    ``method``: its entry for the method, else its ``ALL_METHODS`` entry when it has kernels for the
    method, else None; raises BackendUnavailableError when the entry fails to import."""
    entry = _backend(backend)
    table = entry.paged_write if write else entry.paged
    lazy = table.get(method) or (table.get(ALL_METHODS) if method in entry.kernels else None)
    if lazy is None:
        return None
    factory, error = lazy.get()
    if error:
        op = "write_paged" if write else "attend_paged"
        raise BackendUnavailableError(f"backend {backend!r} cannot serve kvq::{op} for {method!r}: {error}")
    return factory


def serves(backend: str, method: str) -> tuple[bool, str | None]:
    """Whether ``backend`` is available and its kernels for ``method`` load."""
    ok, reason = backend_status(backend)
    if not ok:
        return False, f"backend {backend!r} is unavailable here: {reason}"
    try:
        kernel_factory(backend, method)
    except BackendUnavailableError as exc:
        return False, str(exc)
    return True, None


def supports(backend: str, spec: MethodSpec, device: str | None) -> tuple[bool, str | None]:
    """Whether ``backend`` can serve ``spec`` on ``device`` (None: NumPy arrays; "cuda:0" is asked
    as "cuda"), with the reason if not."""
    ok, reason = serves(backend, spec.method)
    if not ok:
        return ok, reason
    check = _backend(backend).info.supports
    if check is None:
        return True, None
    device = device.split(":")[0] if device else None  # backends see a device type: "cpu", "cuda"
    try:
        ok, reason = check(spec, device)
    except Exception as exc:
        return False, f"backend {backend!r}: supports() raised {_why(exc)}"
    return (True, None) if ok else (False, f"backend {backend!r} cannot serve {spec.describe()} on "
                                           f"{device or 'NumPy arrays'}: {reason}")


def serving(spec: MethodSpec, device: str | None) -> list[str]:
    """The backends that can serve ``spec`` on ``device`` here (what ``backend="auto"`` chooses among)."""
    return [name for name, entry in sorted(state().backends.items())
            if spec.method in entry.kernels and supports(name, spec, device)[0]]


def alternatives(spec: MethodSpec, device: str | None) -> str:
    """The fix for a backend that cannot serve ``spec``: the backends that can, on this device."""
    where = device or "NumPy arrays"
    names = serving(spec, device)
    if not names:
        return f"; no backend registered here serves {spec.describe()} on {where}"
    return (f"; backends that can serve {spec.describe()} on {where} here: {', '.join(names)} "
            f"(backend='auto' picks among them)")


def select_backend(spec: MethodSpec | str, device: str | None = None, exclude: tuple[str, ...] = ()) -> str:
    """Resolve ``backend="auto"`` through the firstresult hook ``kvq_select_backend``.

    The hook chooses among the backends that implement the method and are not yet ruled out
    (nor in ``exclude``); the registry then checks the choice (available, kernels load, and
    supports the spec on ``device``; ``spec`` may be a method name, then only the first two) and
    asks again without it if not. So only the chosen backend's kernels are imported:
    ``backend="auto"`` on NumPy arrays loads neither torch nor Triton."""
    method = spec if isinstance(spec, str) else spec.method
    why: list[str] = []
    pending = [name for name, entry in state().backends.items() if method in entry.kernels and name not in exclude]
    while pending:
        chosen = state().pm.hook.kvq_select_backend(method=method, device=device, candidates=list(pending))
        if chosen not in pending:
            raise BackendUnavailableError(f"backend selection returned {chosen!r}; candidates were {pending}")
        ok, reason = serves(chosen, method) if isinstance(spec, str) else supports(chosen, spec, device)
        if ok:
            return chosen
        why.append(str(reason))
        pending.remove(chosen)
    ok, reason = method_status(method)
    detail = reason if not ok else ("; ".join(why) or "no backend implements it")
    raise BackendUnavailableError(f"no available backend serves method {method!r}: {detail}")


# ------------------------------------------------------------------------------------------------
# listings
# ------------------------------------------------------------------------------------------------
def list_methods() -> list[Record]:
    """One record per method; available when its spec imports and some available backend serves it."""
    out = []
    for name, entry in sorted(state().methods.items()):
        backends = tuple(b for b, e in sorted(state().backends.items()) if name in e.kernels)
        ok, reason = method_status(name)
        if ok:
            usable = [b for b in backends if serves(b, name)[0]]
            ok, reason = (True, None) if usable else (False, "no available backend serves it")
        out.append(Record(name, ok, reason, entry.origin, backends))
    return out


def list_backends() -> list[Record]:
    """One record per backend: available or why not, the methods it serves, and the ones whose
    kernels failed to load. Plugins that failed before registering anything are in
    :func:`list_plugins`."""
    out = []
    for name, entry in sorted(state().backends.items()):
        ok, reason = backend_status(name)
        if not ok and entry.origin.startswith("built-in") and "not installed" in str(reason) \
                and "pip install" not in str(reason) and name in extras():
            reason = f"{reason}; install it with {install_hint(name)}"
        served, problems = [], []
        for method, lazy in sorted(entry.kernels.items()):
            _, error = lazy.get() if ok else (None, None)
            (problems.append(f"{method}: {error}") if error else served.append(method))
        out.append(Record(name, ok, reason, entry.origin, tuple(served), tuple(problems)))
    return out


def list_plugins() -> list[Record]:
    """One record per plugin (built-in or third-party): loaded, or why not."""
    return list(state().plugins)


def kvq_select_backend(method: str, device: str | None, candidates: list[str]) -> str | None:
    """Last resort: the NumPy reference when it can serve, else the first candidate (a trylast
    hook implementation, marked when the registry loads)."""
    return "numpy" if "numpy" in candidates else candidates[0]


__all__ = [
    "ArrayAdapter", "BackendInfo", "MethodInfo", "Record", "backend_info", "backend_status", "builtin_plugins",
    "alternatives", "extras", "install_hint", "kernel_factory", "list_backends", "list_methods", "list_plugins",
    "make_spec", "method_info", "method_status", "on_reload", "paged_factory", "select_backend", "serves", "serving", "spec_from_dict", "supports",
]
