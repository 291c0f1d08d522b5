"""The contract between the core and plugins: what a plugin registers and what kernels receive.

Plain data types only (no registry, no API), so every layer above can import them:

- :class:`MethodInfo` / :class:`BackendInfo`: what a plugin's hooks register. A method's spec
  class and each entry of a backend's kernel tables may be a lazy ``"module:Attr"`` reference,
  resolved on first use and separately, so a failing import makes only that method (or that
  backend's kernels for it) unavailable, with the reason;
- :class:`ArrayAdapter`: how the core talks to a backend's array type without importing it;
- :class:`KernelContext` / :class:`MethodKernels`: what a kernel call receives and implements.

A backend's kernel table maps a method name to its kernel class (any callable taking the method's
spec). The registry holds it, the only kernel table there is. The core validates inputs, computes the constants, and hands kernels backend arrays plus a
:class:`KernelContext`; kernels return plain dicts of fields matching the spec's layout.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from kvq_core.spec import MethodSpec

#: ``supports(spec, device) -> (ok, reason)``; ``device`` is None for NumPy input, else a device
#: type such as ``"cpu"`` or ``"cuda"`` (the registry strips an index: "cuda:0" is asked as "cuda").
Supports = Callable[["MethodSpec", "str | None"], "tuple[bool, str | None]"]


#: A key of ``BackendInfo.paged`` / ``paged_write``: the entry for every method the backend has kernels for.
ALL_METHODS = "*"


def resolve(ref: Any) -> Any:
    """``ref`` itself, or the object a ``"package.module:Attr"`` string names (imported now)."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"lazy reference {ref!r}; expected 'package.module:Attr'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """A method: its name, spec class (or a ``"module:Attr"`` reference to it) and a one-line summary."""

    name: str
    spec_cls: "type[MethodSpec] | str"
    summary: str = ""


def _always_available() -> tuple[bool, str | None]:
    return True, None


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """A backend: its kernel table, from method name to kernel class (any callable taking the
    spec), or to a ``"module:Attr"`` reference to one.

    ``is_available()`` returns ``(True, None)`` or ``(False, reason)`` for the whole backend (a
    missing package or device); ``supports(spec, device)`` the same per spec and device (head_dim,
    bit width, device type). Both are asked lazily.

    ``arrays`` may be a ``"module:Attr"`` reference to the adapter (an instance or a class),
    imported on first use, so registering the backend imports nothing heavy (e.g. torch).

    ``torch_ops``: the kernel classes work on torch tensors with a
    :class:`~kvq_core.torch_ops.torch_kernels.TorchContext` (``kvq_torch.common.TorchMethod``
    subclasses) and every call runs through the ``kvq::`` custom ops carrying this backend's
    name, so ``torch.compile`` and ``torch.export`` see one opaque node per call. False: the
    Quantizer calls the classes directly with a :class:`KernelContext`.

    ``adapt(cls)``: applied to every kernel class resolved on this backend, kernels another plugin
    adds (hook ``kvq_register_kernels``) included, e.g. ``torch-compiled`` compiles each class's
    functions; None: the classes as given.

    ``paged`` / ``paged_write``: method -> the class serving ``kvq::attend_paged`` /
    ``kvq::write_paged`` for it (called with the spec; :mod:`kvq_core.paged`), key
    :data:`ALL_METHODS` for every method this backend has kernels for; a method without one falls
    back to the ``torch`` backend's.

    ``compiled``: for a backend whose kernels compile on first use into a disk cache, the
    :class:`CompileCache` that says whether a spec's are there (or a ``"module:Attr"`` reference to
    it); ``backend="auto"`` in a ``KVQCache`` then serves a spec whose kernels are not compiled yet
    from the next backend while these compile in the background (:mod:`kvq_core.compile_ahead`).
    None: nothing compiles ahead of use.
    """

    name: str
    kernels: Mapping[str, Any]
    arrays: "ArrayAdapter | str"
    is_available: Callable[[], tuple[bool, str | None]] = _always_available
    summary: str = ""
    supports: Supports | None = None
    torch_ops: bool = False
    adapt: Callable[[Any], Any] | None = None
    paged: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    paged_write: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compiled: "CompileCache | str | None" = None


class CompileCache(Protocol):
    """Where a backend keeps its compiled kernels, per spec: ready or not, and marked ready once a warm-up
    has compiled them (the marks go when the compiled code does)."""

    def ready(self, spec: "MethodSpec", device: str | None) -> bool:
        """True when ``spec``'s kernels on ``device`` run without compiling first."""

    def mark_ready(self, spec: "MethodSpec") -> None:
        """Record that a warm-up of ``spec`` on the CPU has compiled its kernels into the disk cache."""

    def directory(self) -> "Path":
        """The folder the disk cache lives in (a background compile keeps its lock and log there)."""


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

    # Optional: ``concat(xs, axis)`` joins backend arrays (else the core joins through NumPy,
    # :func:`kvq_core.tokens.concat_tokens`); ``device_of(x)`` names the device of an input
    # (None for host arrays) so the registry can ask ``supports(spec, device)`` per call;
    # ``max_abs(x) -> float | None`` is the largest |x| for the underflow check (None: skip it;
    # without the method the core goes through ``to_numpy``).


@dataclasses.dataclass(frozen=True)
class KernelContext:
    """What a kernel call needs besides the data: the spec, the layer, the K/V block shape
    ``(batch, kv_heads, tokens, head_dim)`` and the spec's constants (NumPy, read-only)."""

    spec: "MethodSpec"
    layer: int
    shape: tuple[int, int, int, int]
    consts: Mapping[str, np.ndarray]


class MethodKernels(Protocol):
    """Kernels of one method on one backend. Arrays are the backend's own type.

    Decoded K/V and attention outputs are float32 in the original (un-rotated) domain;
    ``attend`` returns ``(out [b, q_heads, q_len, d], lse [b, q_heads, q_len])`` where lse is
    the natural-log sum of exp(scaled logits), so partial attentions can be merged.
    """

    def encode_keys(self, k: Any, ctx: KernelContext) -> dict[str, Any]: ...

    def decode_keys(self, fields: dict[str, Any], ctx: KernelContext) -> Any: ...

    def encode_values(self, v: Any, ctx: KernelContext) -> dict[str, Any]: ...

    def decode_values(self, fields: dict[str, Any], ctx: KernelContext) -> Any: ...

    def attend(
        self, q: Any, kfields: dict[str, Any], vfields: dict[str, Any], ctx: KernelContext, scale: float
    ) -> tuple[Any, Any]: ...

    # Optional: ``fake_quant(kind, x, ctx)`` returns ``decode(encode(x))`` in x's dtype in one
    # differentiable call (the torch-tensor backends' ``kvq::fake_quant`` op); without it
    # :meth:`kvq_core.Quantizer.fake_quant` composes the two kernels (no gradient).
    # Optional: ``fuses_window(q) -> bool`` and ``attend_window(q, blocks, window_k, window_v, ctx,
    # scale) -> (out, lse)``: attention over several blocks (``[(kfields, vfields, tokens), ...]``,
    # in token order; ``ctx.shape`` counts their tokens together) then an exact window whose last
    # ``q_len`` tokens are the queries' own, in one call (:meth:`kvq_core.Quantizer.attend_window`).
    # ``blocks`` is a :class:`KernelBlocks`: its ``memo`` lives as long as those blocks (a cache
    # layer reuses them over many decode steps), so a kernel may keep there, under a key of its
    # own, what it derives from the blocks alone (converted buffers, descriptors), once;
    # ``blocks.block_memos[i]`` likewise for block ``i`` alone, kept over plans that share the block.


class KernelBlocks(list):  # type: ignore[type-arg]
    """The blocks of a fused window call, ``[(kfields, vfields, tokens), ...]`` in token order;
    ``memo``: a dict for what a kernel derives from these blocks together (read-only, never from the
    queries or the window), which lives as long as they do (:class:`kvq_core.window_plan.WindowPlan`);
    ``block_memos``: one dict per block for what a kernel derives from that block alone, which lives
    as long as the block holds the fields it was checked with (:meth:`kvq_core.PackedKV.kernel_memo`),
    so a plan of one new block and older ones derives only the new one's (a sliding flush's decode step)."""

    __slots__ = ("memo", "block_memos")

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.memo: dict[Any, Any] = {}
        self.block_memos: list[dict[Any, Any]] = [{} for _ in self]

    def add(self, kfields: dict[str, Any], vfields: dict[str, Any], tokens: int, memo: dict[Any, Any]) -> None:
        """Append a block with its per-block memo."""
        self.append((kfields, vfields, tokens))
        self.block_memos.append(memo)


__all__ = ["ALL_METHODS", "ArrayAdapter", "BackendInfo", "KernelBlocks", "KernelContext", "MethodInfo", "MethodKernels", "Supports", "resolve"]
