"""Explicit 8-lane vectors for the Numba CPU kernels: LLVM ``<8 x float>`` / ``<8 x i32>`` values
that live in registers, with the few operations the code-domain attention needs.

LLVM's auto-vectoriser keeps a loop's accumulators in memory when the loop stores into several
rows, and reduces each dot product across lanes; written with these types, a kernel keeps eight
accumulators in registers and unpacks a code byte once for all the query rows that use it. Each
operation is one LLVM instruction (or a short fixed sequence) that any target legalises: AVX2 and
AVX-512 machines run one ymm instruction, SSE-only ones two. Loads and stores are unaligned and
unchecked: the callers index within their arrays.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from kvq_numba.cpu.common import half_to_float

LANES = 8
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F32, LANES)
_VI = ir.VectorType(_I32, LANES)


class F32x8(types.Type):
    """Eight float32 lanes."""

    def __init__(self) -> None:
        super().__init__(name="F32x8")


class I32x8(types.Type):
    """Eight int32 lanes."""

    def __init__(self) -> None:
        super().__init__(name="I32x8")


f32x8 = F32x8()
i32x8 = I32x8()


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001 - numba's model signature
        super().__init__(dmm, fe_type, _VF)


@register_model(I32x8)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001
        super().__init__(dmm, fe_type, _VI)


def _element_ptr(context, builder, arrty, arr, idx, vec):  # noqa: ANN001, ANN202 - llvmlite codegen
    """Pointer to ``arr[idx]`` (a 1-D array) cast to a pointer to the vector type ``vec``."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(builder.gep(ary.data, [idx]), vec.as_pointer())


def _splat(builder, x, vec):  # noqa: ANN001, ANN202
    v = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vec, ir.Undefined), ir.Constant(_VI, [0] * LANES))


def _i32(context, builder, value, ty):  # noqa: ANN001, ANN202
    return context.cast(builder, value, ty, types.int32)


@intrinsic
def vload(typingctx, arr, idx):  # noqa: ANN001, ANN201 - numba intrinsic signature
    """``arr[idx:idx+8]`` of a 1-D float32 array."""
    def codegen(context, builder, sig, args):
        return builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], _VF), align=4)
    return f32x8(arr, idx), codegen


@intrinsic
def vstore(typingctx, arr, idx, v):  # noqa: ANN001, ANN201
    """``arr[idx:idx+8] = v`` for a 1-D float32 array."""
    def codegen(context, builder, sig, args):
        builder.store(args[2], _element_ptr(context, builder, sig.args[0], args[0], args[1], _VF), align=4)
        return context.get_dummy_value()
    return types.void(arr, idx, v), codegen


@intrinsic
def vsplat(typingctx, x):  # noqa: ANN001, ANN201
    """Eight copies of the scalar ``x`` (cast to float32)."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)
    return f32x8(x), codegen


@intrinsic
def vzero(typingctx):  # noqa: ANN001, ANN201
    """Eight zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * LANES)
    return f32x8(), codegen


@intrinsic
def vfma(typingctx, a, b, c):  # noqa: ANN001, ANN201
    """``a * b + c`` lane-wise (``llvm.fmuladd``: fused where the target has FMA)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]),
                                            "llvm.fmuladd.v8f32")
        return builder.call(fn, args)
    return f32x8(a, b, c), codegen


@intrinsic
def vmul(typingctx, a, b):  # noqa: ANN001, ANN201
    """``a * b`` lane-wise."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def vadd(typingctx, a, b):  # noqa: ANN001, ANN201
    """``a + b`` lane-wise."""
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def vhsum(typingctx, a):  # noqa: ANN001, ANN201
    """The sum of the eight lanes (halves added pairwise: 4 + 4, 2 + 2, 1 + 1)."""
    def codegen(context, builder, sig, args):
        v = args[0]
        width = LANES
        while width > 1:
            width //= 2
            mask = ir.VectorType(_I32, width)
            lo = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width, 2 * width))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(a), codegen


@intrinsic
def bytes8(typingctx, arr, idx):  # noqa: ANN001, ANN201
    """``arr[idx:idx+8]`` of a 1-D uint8 array, zero-extended to eight int32 lanes."""
    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), LANES))
        return builder.zext(builder.load(ptr, align=1), _VI)
    return i32x8(arr, idx), codegen


@intrinsic
def plane(typingctx, x, shift, mask, center):  # noqa: ANN001, ANN201
    """``float32((x >> shift) & mask) - center`` lane-wise: one bit field of eight code bytes,
    centred (exact for codes below 2**24 and a half-integer ``center``)."""
    def codegen(context, builder, sig, args):
        sh = _splat(builder, _i32(context, builder, args[1], sig.args[1]), _VI)
        mk = _splat(builder, _i32(context, builder, args[2], sig.args[2]), _VI)
        c = _splat(builder, context.cast(builder, args[3], sig.args[3], types.float32), _VF)
        return builder.fsub(builder.sitofp(builder.and_(builder.lshr(args[0], sh), mk), _VF), c)
    return f32x8(x, shift, mask, center), codegen


@intrinsic
def load_u64(typingctx, buf, idx):  # noqa: ANN001, ANN201
    """Bytes ``buf[idx:idx+8]`` (1-D uint8, unaligned) as one uint64 in host order, little-endian on x86
    and AArch64 as the codes are packed: one load where assembling it took five loads, shifts and ors."""
    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(64))
        return builder.load(ptr, align=1)
    return types.uint64(buf, idx), codegen


@intrinsic
def move4(typingctx, dst, di, src, si):  # noqa: ANN001, ANN201
    """``dst[di:di+4] = src[si:si+4]`` for 1-D float32 arrays: one 16-byte load and store."""
    def codegen(context, builder, sig, args):
        vec = ir.VectorType(_F32, 4)
        value = builder.load(_element_ptr(context, builder, sig.args[2], args[2], args[3], vec), align=4)
        builder.store(value, _element_ptr(context, builder, sig.args[0], args[0], args[1], vec), align=4)
        return context.get_dummy_value()
    return types.void(dst, di, src, si), codegen

@intrinsic
def halves8(typingctx, arr, idx):  # noqa: ANN001, ANN201
    """The float32 values of the eight float16 bit patterns ``arr[idx:idx+8]`` (uint16, 1-D).

    Exact for every finite value, subnormals included, with integer operations and one multiply
    by 2**112 (no F16C needed); Inf stays Inf, NaN stays NaN.
    """
    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(16), LANES))
        h = builder.zext(builder.load(ptr, align=2), _VI)

        def const(v: int) -> ir.Constant:
            return ir.Constant(_VI, [v] * LANES)

        magnitude = builder.shl(builder.and_(h, const(0x7FFF)), const(13))
        scaled = builder.fmul(builder.bitcast(magnitude, _VF), ir.Constant(_VF, [2.0**112] * LANES))
        bits = builder.bitcast(scaled, _VI)
        special = builder.icmp_unsigned("==", builder.and_(h, const(0x7C00)), const(0x7C00))
        bits = builder.select(special, builder.or_(bits, const(0x7F800000)), bits)
        bits = builder.or_(bits, builder.shl(builder.and_(h, const(0x8000)), const(16)))
        return builder.bitcast(bits, _VF)
    return f32x8(arr, idx), codegen


_P8 = ir.IntType(8).as_pointer()
#: bytes per cache line (prefetch granularity)
LINE = 64


@intrinsic
def prefetch(typingctx, arr, idx):  # noqa: ANN001, ANN201
    """Hint: bring the cache line of ``arr[idx]`` (1-D) in ahead of use (``llvm.prefetch``, read,
    all cache levels). Never faults: an address past the array only wastes the hint."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), _P8)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_P8, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@njit(inline="always", cache=True)
def prefetch_bytes(buf, start, nbytes) -> None:
    """:func:`prefetch` every cache line of ``buf[start:start + nbytes]`` (clipped to ``buf``)."""
    for x in range(max(start, 0), min(start + nbytes, buf.shape[0]), LINE):
        prefetch(buf, x)


@njit(inline="always", cache=True)
def vaccumulate(acc, pos, v) -> None:
    """``acc[pos:pos+8] += v`` for a 1-D float32 array."""
    vstore(acc, pos, vadd(vload(acc, pos), v))


@njit(inline="always", cache=True)
def halves(src, lo, n, dst) -> None:
    """``dst[:n] = float32(src[lo:lo+n])`` for float16 bits ``src`` (uint16, 1-D): exact."""
    j = 0
    while j + LANES <= n:
        vstore(dst, j, halves8(src, lo + j))
        j += LANES
    for k in range(j, n):
        dst[k] = half_to_float(src[lo + k])

