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


class F32x(types.Type):
    """``lanes`` float32 lanes (8, or 16 where the kernels use AVX-512's full width)."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        super().__init__(name=f"F32x{lanes}")


class I32x(types.Type):
    """``lanes`` int32 lanes."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        super().__init__(name=f"I32x{lanes}")


f32x8, f32x16 = F32x(8), F32x(16)
i32x16 = I32x(16)


@register_model(F32x)
class _F32xModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001 - numba's model signature
        super().__init__(dmm, fe_type, ir.VectorType(_F32, fe_type.lanes))


@register_model(I32x)
class _I32xModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:  # noqa: ANN001
        super().__init__(dmm, fe_type, ir.VectorType(_I32, fe_type.lanes))


def _element_ptr(context, builder, arrty, arr, idx, vec):  # noqa: ANN001, ANN202 - llvmlite codegen
    """Pointer to ``arr[idx]`` (a 1-D array) cast to a pointer to the vector type ``vec``."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(builder.gep(ary.data, [idx]), vec.as_pointer())


def _splat(builder, x, vec):  # noqa: ANN001, ANN202
    v = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(_I32, vec.count),
                                                                                [0] * vec.count))


def _i32(context, builder, value, ty):  # noqa: ANN001, ANN202
    return context.cast(builder, value, ty, types.int32)


def _vload(lanes: int):  # noqa: ANN202
    ty, vec = F32x(lanes), ir.VectorType(_F32, lanes)

    def typer(typingctx, arr, idx):  # noqa: ANN001, ANN202 - numba intrinsic signature
        def codegen(context, builder, sig, args):
            return builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], vec), align=4)
        return ty(arr, idx), codegen
    typer.__doc__ = f"``arr[idx:idx+{lanes}]`` of a 1-D float32 array."
    return intrinsic(typer)


vload, vload16 = _vload(8), _vload(16)


@intrinsic
def vstore(typingctx, arr, idx, v):  # noqa: ANN001, ANN201
    """``arr[idx:idx+lanes] = v`` for a 1-D float32 array, any width."""
    def codegen(context, builder, sig, args):
        vec = ir.VectorType(_F32, sig.args[2].lanes)
        builder.store(args[2], _element_ptr(context, builder, sig.args[0], args[0], args[1], vec), align=4)
        return context.get_dummy_value()
    return types.void(arr, idx, v), codegen


@intrinsic
def vsplat(typingctx, x):  # noqa: ANN001, ANN201
    """Eight copies of the scalar ``x`` (cast to float32)."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)
    return f32x8(x), codegen


def _vzero(lanes: int):  # noqa: ANN202
    ty = F32x(lanes)

    def typer(typingctx):  # noqa: ANN001, ANN202
        def codegen(context, builder, sig, args):
            return ir.Constant(ir.VectorType(_F32, lanes), [0.0] * lanes)
        return ty(), codegen
    typer.__doc__ = f"{lanes} zeros."
    return intrinsic(typer)


vzero, vzero16 = _vzero(8), _vzero(16)


@intrinsic
def vfma(typingctx, a, b, c):  # noqa: ANN001, ANN201
    """``a * b + c`` lane-wise, any width (``llvm.fmuladd``: fused where the target has FMA)."""
    def codegen(context, builder, sig, args):
        vec = ir.VectorType(_F32, sig.return_type.lanes)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                            f"llvm.fmuladd.v{vec.count}f32")
        return builder.call(fn, args)
    return a(a, b, c), codegen


@intrinsic
def vmul(typingctx, a, b):  # noqa: ANN001, ANN201
    """``a * b`` lane-wise, any width."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return a(a, b), codegen


@intrinsic
def vadd(typingctx, a, b):  # noqa: ANN001, ANN201
    """``a + b`` lane-wise, any width."""
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return a(a, b), codegen


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
def vmax(typingctx, a, b):  # noqa: ANN001, ANN201
    """Lane-wise maximum of two float vectors of one width (``a`` where ``a > b``, else ``b``)."""
    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])
    if not (isinstance(a, F32x) and a == b):
        return None
    return a(a, b), codegen


@intrinsic
def vhmax(typingctx, a):  # noqa: ANN001, ANN201
    """The largest lane (halves compared pairwise, as :func:`vhsum` adds them): a running maximum kept in
    lanes, where a scalar ``max`` chain runs one compare per element at its full latency."""
    def codegen(context, builder, sig, args):
        v = args[0]
        width = sig.args[0].lanes
        while width > 1:
            width //= 2
            mask = ir.VectorType(_I32, width)
            lo = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(mask, list(range(width, 2 * width))))
            v = builder.select(builder.fcmp_ordered(">", lo, hi), lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(a), codegen


def _vbroadcast(lanes: int):  # noqa: ANN202
    ty, vec = F32x(lanes), ir.VectorType(_F32, lanes)

    def typer(typingctx, arr, idx):  # noqa: ANN001, ANN202
        def codegen(context, builder, sig, args):
            x = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], _F32), align=4)
            return _splat(builder, x, vec)
        return ty(arr, idx), codegen
    typer.__doc__ = (f"``arr[idx]`` (1-D float32) in all {lanes} lanes: one broadcast load, without the negative-index "
                     "wrap a subscript compiles to (three integer instructions per load in the value loops).")
    return intrinsic(typer)


vbroadcast, vbroadcast16 = _vbroadcast(8), _vbroadcast(16)


def _fold(builder, x, y, width):  # noqa: ANN001, ANN202
    """Two 16-lane vectors of ``16 // width`` partial sums at the same places (group ``g``: lanes ``g * width ..``)
    to one with twice as many of half the width: in each group, x's halves added into its first half and y's
    into its second. One lane shuffle, one blend, one add: half the shuffle-port work of two shuffles."""
    half = width // 2
    lanes = range(16)
    swap = [(16 + lane - half) if lane % width >= half else lane + half for lane in lanes]
    mask = ir.VectorType(_I32, 16)
    from_y = ir.Constant(ir.VectorType(ir.IntType(1), 16), [int(lane % width >= half) for lane in lanes])
    return builder.fadd(builder.select(from_y, y, x), builder.shuffle_vector(x, y, ir.Constant(mask, swap)))


@intrinsic
def vsums4x4(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):  # noqa: ANN001, ANN201
    """The lane sums of sixteen 16-lane accumulators (``a[4 * r + t]``: row ``r``, token ``t``) as one
    vector, lane ``4 * r + t``: a transposing tree of 15 folds (:func:`_fold`) and one final shuffle, where a
    reduction per accumulator costs four shuffles and adds and an extract."""
    args = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    if any(a != f32x16 for a in args):
        return None

    def codegen(context, builder, sig, llargs):
        # each vector with the accumulator index of each of its groups, in lane order
        level = [(v, [k]) for k, v in enumerate(llargs)]
        width = 16
        while len(level) > 1:
            level = [(_fold(builder, x, y, width), [lab for pair in zip(lx, ly) for lab in pair])
                     for (x, lx), (y, ly) in zip(level[0::2], level[1::2])]
            width //= 2
        v, labels = level[0]
        order = [labels.index(k) for k in range(16)]
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), order))
    return f32x16(*args), codegen


@intrinsic
def vrepeat4(typingctx, arr, idx):  # noqa: ANN001, ANN201
    """``arr[idx:idx+4]`` (1-D float32) four times over sixteen lanes."""
    def codegen(context, builder, sig, args):
        x = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(_F32, 4)), align=4)
        return builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, 16), [0, 1, 2, 3] * 4))
    return f32x16(arr, idx), codegen


@intrinsic
def vstore_rows4(typingctx, arr, idx, stride, v):  # noqa: ANN001, ANN201
    """``arr[idx + r * stride : ... + 4] = v[4 * r : 4 * r + 4]`` for r in 0..3 (1-D float32): a 4x4 tile's
    rows written into a row-major array."""
    def codegen(context, builder, sig, args):
        vec4, mask = ir.VectorType(_F32, 4), ir.VectorType(_I32, 4)
        base = args[1]
        step = context.cast(builder, args[2], sig.args[2], sig.args[1])
        for r in range(4):
            part = builder.shuffle_vector(args[3], args[3], ir.Constant(mask, [4 * r + k for k in range(4)]))
            builder.store(part, _element_ptr(context, builder, sig.args[0], args[0], base, vec4), align=4)
            base = builder.add(base, step)
        return context.get_dummy_value()
    return types.void(arr, idx, stride, v), codegen


def _bytes(lanes: int):  # noqa: ANN202
    ty = I32x(lanes)

    def typer(typingctx, arr, idx):  # noqa: ANN001, ANN202
        def codegen(context, builder, sig, args):
            ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), lanes))
            return builder.zext(builder.load(ptr, align=1), ir.VectorType(_I32, lanes))
        return ty(arr, idx), codegen
    typer.__doc__ = f"``arr[idx:idx+{lanes}]`` of a 1-D uint8 array, zero-extended to {lanes} int32 lanes."
    return intrinsic(typer)


bytes8, bytes16 = _bytes(8), _bytes(16)


@intrinsic
def bytes8x2(typingctx, arr, idx):  # noqa: ANN001, ANN201
    """``arr[idx:idx+8]`` of a 1-D uint8 array twice over sixteen int32 lanes (zero-extended): one 8-byte
    chunk's two planes in one vector (:func:`split_shifts`)."""
    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(ir.IntType(8), 8)
        x = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], v8), align=1)
        x = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, 16), list(range(8)) * 2))
        return builder.zext(x, ir.VectorType(_I32, 16))
    return i32x16(arr, idx), codegen


@intrinsic
def split_shifts(typingctx, lo, hi):  # noqa: ANN001, ANN201
    """Sixteen int32 lanes, ``lo`` in lanes 0-7 and ``hi`` in 8-15: per-lane shifts for :func:`plane`."""
    def codegen(context, builder, sig, args):
        vec = ir.VectorType(_I32, 8)
        lo8, hi8 = (_splat(builder, _i32(context, builder, a, ty), vec) for a, ty in zip(args, sig.args))
        return builder.shuffle_vector(lo8, hi8, ir.Constant(ir.VectorType(_I32, 16), list(range(16))))
    return i32x16(lo, hi), codegen


@intrinsic
def plane(typingctx, x, shift, mask, center):  # noqa: ANN001, ANN201
    """``float32((x >> shift) & mask) - center`` lane-wise: one bit field of code bytes (8 or 16 lanes),
    centred (exact for codes below 2**24 and a half-integer ``center``). ``shift``: an integer, or one
    per lane (an ``I32x`` as wide as ``x``)."""
    def codegen(context, builder, sig, args):
        vi, vf = ir.VectorType(_I32, sig.args[0].lanes), ir.VectorType(_F32, sig.args[0].lanes)
        if isinstance(sig.args[1], I32x):
            sh = args[1]
        else:
            sh = _splat(builder, _i32(context, builder, args[1], sig.args[1]), vi)
        mk = _splat(builder, _i32(context, builder, args[2], sig.args[2]), vi)
        c = _splat(builder, context.cast(builder, args[3], sig.args[3], types.float32), vf)
        return builder.fsub(builder.sitofp(builder.and_(builder.lshr(args[0], sh), mk), vf), c)
    return F32x(x.lanes)(x, shift, mask, center), codegen


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
def vaccumulate16(acc, pos, v) -> None:
    """``acc[pos:pos+16] += v`` for a 1-D float32 array."""
    vstore(acc, pos, vadd(vload16(acc, pos), v))


@njit(inline="always", cache=True)
def halves(src, lo, n, dst) -> None:
    """``dst[:n] = float32(src[lo:lo+n])`` for float16 bits ``src`` (uint16, 1-D): exact."""
    j = 0
    while j + LANES <= n:
        vstore(dst, j, halves8(src, lo + j))
        j += LANES
    for k in range(j, n):
        dst[k] = half_to_float(src[lo + k])


@intrinsic
def vrint(typingctx, a):  # noqa: ANN001, ANN201
    """Lane-wise round to the nearest integer, ties to even (``llvm.rint``), any width."""
    def codegen(context, builder, sig, args):
        vec = ir.VectorType(_F32, sig.args[0].lanes)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec]), f"llvm.rint.v{vec.count}f32")
        return builder.call(fn, args)
    return a(a), codegen


@intrinsic
def vpow2(typingctx, k):  # noqa: ANN001, ANN201
    """``2.0 ** k`` lane-wise for integral float lanes ``k`` in -126 .. 127, any width: built in the
    exponent bits (no libm call)."""
    def codegen(context, builder, sig, args):
        lanes = sig.args[0].lanes
        vi = ir.VectorType(_I32, lanes)
        e = builder.add(builder.fptosi(args[0], vi), ir.Constant(vi, [127] * lanes))
        return builder.bitcast(builder.shl(e, ir.Constant(vi, [23] * lanes)), ir.VectorType(_F32, lanes))
    return k(k), codegen
