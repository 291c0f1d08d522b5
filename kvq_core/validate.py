"""Input checks at the API boundary: typed errors that name the value and what was expected."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvq_core.errors import InputError, LayoutError
from kvq_core.host_arrays import dtype_name as _dtype_name
from kvq_core.contract import ArrayAdapter
from kvq_core.packed import PackedKV
from kvq_core.spec import MethodSpec

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


def _dims(shape: Any) -> tuple[Any, ...]:
    """Shape entries as ints; symbolic sizes (torch SymInts under torch.compile / torch.export)
    are kept as they are, since ``int()`` would specialise a dynamic dimension to a constant."""
    if len(shape) == 4:  # a K/V array's usual shape (NumPy's tuple, torch's Size) of plain ints: one test
        b, h, t, d = shape
        if type(b) is int and type(h) is int and type(t) is int and type(d) is int:
            return tuple(shape) if type(shape) is not tuple else shape
    if type(shape) is tuple and all(type(s) is int for s in shape):  # NumPy's shapes: nothing to convert
        return shape
    return tuple(s if isinstance(s, int) or type(s).__name__ == "SymInt" else int(s) for s in shape)


def dtype_name(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    return type(x).__name__ if dtype is None else _dtype_name(dtype)  # cached: str() of a dtype costs ~5 us


#: The dimension order of K/V arrays and of queries, as errors name it.
KV_DIMS = "[batch, kv_heads, tokens, head_dim]"
QUERY_DIMS = "[batch, q_heads, q_len, head_dim]"


def check_float_array(x: Any, what: str, dims: str) -> None:
    """Reject, before any backend converts it, what is not an array of a float dtype: a list (ragged
    or not), or an array of dtype object, str, bytes, bool or int, named in the error."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or getattr(x, "shape", None) is None:
        raise InputError(f"{what}: got {type(x).__name__}; expected a float array {dims}")
    name = _dtype_name(dtype)
    if name not in _FLOAT_NAMES:
        raise InputError(f"{what}: dtype {name} is not supported; expected one of {', '.join(_FLOAT_NAMES)}")


def check_kv(x: Any, spec: MethodSpec, arrays: ArrayAdapter, what: str = "keys") -> tuple[tuple[int, int, int, int], Any]:
    """Check a K/V array ``[batch, kv_heads, tokens, head_dim]`` and convert it once (``arrays.asarray``);
    return its shape and the converted array (the finiteness test and the kernel read it)."""
    check_float_array(x, what, KV_DIMS)
    shape = _dims(x.shape)
    if len(shape) != 4:
        raise InputError(f"{what}: got rank {len(shape)} shape {list(shape)}; expected rank 4 {KV_DIMS}")
    if min(shape) < 1:
        raise InputError(f"{what}: got empty shape {list(shape)}; every dimension must be >= 1")
    if shape[3] != spec.head_dim:
        raise InputError(f"{what}: head_dim {shape[3]} does not match the spec's head_dim={spec.head_dim}")
    data = arrays.asarray(x)
    _check_finite(data, arrays, what)
    return shape, data  # type: ignore[return-value]


def _check_finite(data: Any, arrays: ArrayAdapter, what: str) -> None:
    if not arrays.all_finite(data):
        raise InputError(f"{what}: contains NaN or Inf; kvq rejects non-finite input rather than store garbage codes")


#: Blocks whose largest |value| is below float16's smallest normal (2**-14) are checked for
#: underflow: there every float16 field that stores a magnitude is subnormal or zero.
UNDERFLOW_PEAK = 2.0**-14
#: A tiny block is rejected when it decodes to all zeros, or with a relative error above this
#: factor times that of the same block scaled up by a power of four (where nothing underflows)
UNDERFLOW_ERROR_FACTOR = 1.5
#: ... plus this much (relative error): a float16 field a little past its normal range costs
#: ~0.1% and is kept.
UNDERFLOW_ERROR_SLACK = 0.01


def check_stored_finite(packed: PackedKV, x: Any, arrays: ArrayAdapter, what: str) -> None:
    """Reject a freshly encoded block whose float fields overflowed (e.g. a float16 scale for
    |x| > 65504): its codes would decode to Inf/NaN, so nothing is returned instead. Likewise
    a block so small that its fields underflow (:func:`check_stored_precise`)."""
    for name, field in packed.layout.items():
        if field.dtype in _FLOAT_NAMES and not arrays.all_finite(packed.fields[name]):
            peak = float(np.abs(np.asarray(arrays.to_numpy(x), dtype=np.float64)).max())
            raise InputError(
                f"{what}: {packed.spec.method} stores {name!r} as {field.dtype}, which overflows for this input "
                f"(largest |value| {peak:.4g}; float16 holds up to 65504); scale the input down, or use the "
                "method's float32 storage option where it has one"
            )
    check_stored_precise(packed, x, arrays, what)


def _max_abs(x: Any, arrays: ArrayAdapter) -> float | None:
    """Largest |x| through the adapter's optional ``max_abs`` (None: not checkable here, e.g.
    under torch.compile), else through NumPy."""
    fn = getattr(arrays, "max_abs", None)
    if fn is not None:
        return fn(x)
    a = np.asarray(arrays.to_numpy(x))
    # two reductions in the input's own dtype (|max| and |min| are exact): no float64 copy, which
    # took longer than a compiled encode of the block
    return float(max(abs(float(a.max())), abs(float(a.min()))))


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    want64 = want.astype(np.float64)
    return float(np.linalg.norm(got.astype(np.float64) - want64) / np.linalg.norm(want64))


def check_stored_precise(packed: PackedKV, x: Any, arrays: ArrayAdapter, what: str) -> None:
    """Reject a nonzero block whose stored fields underflow (e.g. keys scaled by 1e-30: float16
    scales and float32 sums of squares become 0), so that it would decode to all zeros, or far
    worse than the same block at a normal magnitude. Blocks whose largest |value| is at least
    :data:`UNDERFLOW_PEAK` skip the check after one max-abs reduction; tiny ones are decoded by
    the NumPy reference (which conformance makes equal to every backend) and compared with the
    same block scaled up by a power of four, which the methods encode exactly equivariantly."""
    peak = _max_abs(x, arrays)
    if peak is None or peak == 0.0 or peak >= UNDERFLOW_PEAK:
        return
    from kvq_core.api import Quantizer  # the reference backend, only on this rare path

    spec = packed.spec
    ref = Quantizer(spec, "numpy", packed.layer)
    encode = ref.encode_keys if packed.kind == "keys" else ref.encode_values
    decode = ref.decode_keys if packed.kind == "keys" else ref.decode_values
    xr = np.asarray(arrays.to_numpy(x), dtype=np.float32)
    mine = packed.map_fields(lambda f: np.asarray(arrays.to_numpy(f)))
    got = np.asarray(decode(mine), dtype=np.float32)
    lift = np.float32(4.0 ** int(np.ceil(-np.log(peak) / np.log(4.0))))  # brings the peak into [1/4, 1)
    lifted = encode(xr * lift)
    err, err_lifted = _relative_error(got, xr), _relative_error(np.asarray(decode(lifted), np.float32) / lift, xr)
    if np.any(got != 0) and err <= UNDERFLOW_ERROR_FACTOR * err_lifted + UNDERFLOW_ERROR_SLACK:
        return
    floats = [n for n, f in packed.layout.items() if f.dtype in _FLOAT_NAMES]
    lost = [n for n in floats if not np.allclose(np.asarray(mine.fields[n], np.float64) * float(lift),
                                                 np.asarray(lifted.fields[n], np.float64), rtol=1e-2)]
    named = ", ".join(f"{n!r} ({packed.layout[n].dtype})" for n in (lost or floats))
    raise InputError(
        f"{what}: {spec.method} stores {named}, which underflow for this input (largest |value| {peak:.4g}; "
        f"float16 fields go subnormal below 6.1e-05, float32 squares vanish below ~1e-19): it would decode "
        + ("to all zeros" if not np.any(got != 0) else f"with relative error {err:.3g} (scaled up: {err_lifted:.3g})")
        + "; scale the input up (by a power of two), or use the method's float32 storage option where it has one"
    )


def check_packed(p: Any, spec: MethodSpec, kind: str, layer: int, arrays: ArrayAdapter) -> PackedKV:
    """Check a packed block belongs to this quantizer's spec, holds ``kind`` and was made for
    ``layer``, and validate it once (:meth:`PackedKV.validate`: every field's shape and dtype,
    the block's dims, dtype name and layer, finite stored floats) before any kernel reads it."""
    if not isinstance(p, PackedKV):
        raise InputError(f"expected a PackedKV of {kind}; got {type(p).__name__}")
    if p.kind != kind:
        raise InputError(f"expected packed {kind}; got packed {p.kind}")
    if p.spec is not spec and p.spec != spec:  # identity first: traceable by torch.compile
        raise LayoutError(f"packed block was made with {p.spec.describe()}; this quantizer has {spec.describe()}")
    if not p.is_validated():  # a block this quantizer made, or one checked before, is not checked again
        p.validate(arrays.all_finite)
    if p.layer != layer:
        raise LayoutError(f"packed {kind} record layer {p.layer}; this call decodes with layer {layer}'s constants "
                          f"(pass layer={p.layer} to use that layer's, or use that layer's quantizer)")
    return p


def check_layer(layer: Any, default: int) -> int:
    """``layer=`` of a call: None for the quantizer's own (``default``), else an integer >= 0."""
    if layer is None:
        return default
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise InputError(f"layer={layer!r}; expected an integer >= 0 (or None for the quantizer's layer {default})")
    return int(layer)


def check_scale(scale: Any, head_dim: int) -> float:
    """The attend scale: ``1/sqrt(head_dim)`` by default, else a finite number > 0 whose float32
    rounding is a normal number (the kernels scale in float32; a larger one is inf there)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise InputError(f"scale={scale!r}; expected a finite number > 0")
    value = float(scale)
    if not math.isfinite(value) or not _F32_TINY <= value <= _F32_MAX:
        raise InputError(f"scale={scale!r}; expected a finite number > 0 within float32's normal range "
                         f"[{_F32_TINY:.3g}, {_F32_MAX:.3g}] (the kernels scale logits in float32)")
    return value


def check_attention_finite(lse: Any, arrays: ArrayAdapter, scale: float) -> None:
    """After attend: with finite queries and blocks, a non-finite log-sum-exp can only come from
    scaled logits past float32's range, so raise instead of returning NaN/Inf output."""
    if not arrays.all_finite(lse):
        raise InputError(f"attend: scale={scale!r} times the logits overflows float32 (the log-sum-exp is not "
                         "finite); use a smaller scale (the default is 1/sqrt(head_dim)) or smaller queries")


def check_query(q: Any, pk: PackedKV, pv: PackedKV, arrays: ArrayAdapter) -> tuple[tuple[int, int, int, int], Any]:
    """Check a query ``[batch, q_heads, q_len, head_dim]`` against packed keys and values (:func:`check_query_for`)."""
    if pv.shape != pk.shape:
        raise InputError(f"packed values shape {list(pv.shape)} differs from packed keys shape {list(pk.shape)}")
    return check_query_for(q, pk.shape, arrays)


def check_query_for(q: Any, blocks_shape: tuple[int, int, int, int], arrays: ArrayAdapter) -> tuple[tuple[int, int, int, int], Any]:
    """Check a query ``[batch, q_heads, q_len, head_dim]`` against blocks of shape ``[batch, kv_heads, tokens,
    head_dim]`` (the batch, head_dim and GQA rule), and that it is finite float; convert it once
    (``arrays.asarray``) and return its shape and the converted array."""
    check_float_array(q, "query", QUERY_DIMS)
    shape = q.shape
    if len(shape) != 4:
        raise InputError(f"query: got shape {list(shape)}; expected rank 4 {QUERY_DIMS}")
    if type(q) is not np.ndarray:  # a NumPy shape is a tuple of ints already
        shape = _dims(shape)
    if min(shape) < 1:
        raise InputError(f"query: got empty shape {list(shape)}; every dimension must be >= 1")
    b, hk, _, d = blocks_shape
    if shape[0] != b:
        raise InputError(f"query batch {shape[0]} does not match the cache batch {b}")
    if shape[3] != d:
        raise InputError(f"query head_dim {shape[3]} does not match the cache head_dim {d}")
    if shape[1] % hk:
        raise InputError(f"query heads {shape[1]} is not a multiple of kv_heads {hk} (GQA needs q_heads = g * kv_heads)")
    data = arrays.asarray(q)
    _check_finite(data, arrays, "query")
    return shape, data  # type: ignore[return-value]
