"""The kernel table: ``(backend, method) -> kernel class`` for the ``kvq::`` ops.

A torch-tensor backend adds entries with :func:`register_kernel` (a class or a lazy
``"module:Attr"`` reference, called with the spec) and nothing else; the op bodies
(:mod:`kvq_core.dispatch.run`) look kernels up here by the backend name the op carries.
"""
from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from typing import Any

from kvq_core.errors import BackendUnavailableError
from kvq_core.kernels import resolve
from kvq_core.registry import spec_from_dict

_table: dict[tuple[str, str], Any] = {}
_paged: dict[tuple[str, str], Any] = {}
_paged_write: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()

#: the backend whose paged kernels serve a backend that has none for a method (``kvq_torch.paged``)
PAGED_FALLBACK = "torch"


def register_kernel(backend: str, method: str, factory: "str | Callable[[Any], Any]") -> None:
    """Serve ``method`` on ``backend`` through the ``kvq::`` ops with ``factory(spec)``.

    Registering the same (backend, method) again replaces the entry (a plugin reloaded)."""
    with _lock:
        _table[(backend, method)] = factory
        kernel.cache_clear()


@functools.lru_cache(maxsize=1024)
def spec_from_json(spec_json: str) -> Any:
    """The spec a ``kvq::`` op's ``spec_json`` string names (cached per string)."""
    return spec_from_dict(json.loads(spec_json))


def methods(backend: str) -> tuple[str, ...]:
    """The methods ``backend`` has table entries for (sorted)."""
    return tuple(sorted(m for b, m in _table if b == backend))


@functools.lru_cache(maxsize=1024)
def kernel(backend: str, spec_json: str) -> Any:
    """The kernel object of ``backend`` for the spec ``spec_json`` names (cached)."""
    spec = spec_from_json(spec_json)
    ref = _table.get((backend, spec.method))
    if ref is None:
        raise BackendUnavailableError(
            f"kvq ops: backend {backend!r} has no kernel for method {spec.method!r}; it has {list(methods(backend))}")
    return resolve(ref)(spec)


def register_paged_kernel(backend: str, method: str, factory: "str | Callable[[Any], Any]") -> None:
    """Serve ``kvq::attend_paged`` for ``method`` on ``backend`` with ``factory(spec)``, an object with
    ``attend_paged(layer, q, pages, block_table, code_lens, query_start_loc, scale, tail_k, tail_v,
    tail_slot, tail_lens, head_offset) -> (out, lse)`` on torch tensors (:mod:`kvq_core.paged`)."""
    with _lock:
        _paged[(backend, method)] = factory
        paged_kernel.cache_clear()


def _paged_entry(table: dict, op: str, backend: str, spec_json: str) -> Any:
    """``table``'s kernel of ``backend`` for the spec, else :data:`PAGED_FALLBACK`'s, built for the spec."""
    spec = spec_from_json(spec_json)  # loads the registry: every backend's entries are in
    ref = table.get((backend, spec.method)) or table.get((PAGED_FALLBACK, spec.method))
    if ref is None:
        raise BackendUnavailableError(
            f"kvq::{op}: neither {backend!r} nor {PAGED_FALLBACK!r} has a kernel for {spec.method!r}")
    return resolve(ref)(spec)


@functools.lru_cache(maxsize=1024)
def paged_kernel(backend: str, spec_json: str) -> Any:
    """The paged-attention kernel of ``backend`` for the spec, else :data:`PAGED_FALLBACK`'s (cached)."""
    return _paged_entry(_paged, "attend_paged", backend, spec_json)


def register_paged_writer(backend: str, method: str, factory: "str | Callable[[Any], Any]") -> None:
    """Serve ``kvq::write_paged`` for ``method`` on ``backend`` with ``factory(spec)``, an object with
    ``write_paged(layer, key, value, pages, slot_mapping, head_offset) -> None`` on torch tensors (:mod:`kvq_core.paged`)."""
    with _lock:
        _paged_write[(backend, method)] = factory
        paged_writer.cache_clear()


@functools.lru_cache(maxsize=1024)
def paged_writer(backend: str, spec_json: str) -> Any:
    """The paged-write kernel of ``backend`` for the spec, else :data:`PAGED_FALLBACK`'s (cached)."""
    return _paged_entry(_paged_write, "write_paged", backend, spec_json)
