"""Compile gate for the Triton kernels: every kernel compiles ahead of time for sm_80 and sm_90
(``triton.compile`` down to a cubin with the wheel's ptxas, no GPU needed), at the block sizes
the host code launches on a GPU. This catches what the interpreter cannot: GPU-only lowering,
dtype rules of ``tl.dot``, shifts and casts. Runs without ``TRITON_INTERPRET`` (the kernels must
be JIT functions, not interpreted ones)."""
from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # pragma: no cover - interpreter runs
    pytest.skip("AOT compilation needs JIT kernels; TRITON_INTERPRET is set", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvq_core.paged import PageLayout  # noqa: E402
from kvq_core.registry import make_spec  # noqa: E402
from kvq_triton import attention, codebook, intcodes, packing, paged, tiles, window  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier: compiles every Triton kernel for sm_80 and sm_90

P8, P16, P32, I32 = "*u8", "*fp16", "*fp32", "*i32"


#: kernels the host launches with ``enable_fp_fusion=False`` (encoders that must round as the reference)
NO_FMA = {codebook._coordinate_kernel, codebook._triplet_kernel, intcodes._quantize_kernel}


def _compile(fn, args: dict, arch: int):
    """``args``: name -> a type string (runtime argument) or the value (``tl.constexpr`` parameter)."""
    const = {p.name for p in fn.params if p.is_constexpr}
    assert set(args) == {p.name for p in fn.params}, f"{fn.__name__}: arguments {sorted(args)}"
    signature = {k: ("constexpr" if k in const else v) for k, v in args.items()}
    constexprs = {k: v for k, v in args.items() if k in const}
    options = {"enable_fp_fusion": fn not in NO_FMA}
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def _tile(kind: int, bits: int, group: int = 1, rho_bits: int = 0, scale: int = tiles.NO_SCALE) -> dict:
    return dict(KIND=kind, BITS=bits, SPAN=packing.span(bits), GROUP=group, RHO_BITS=rho_bits, SCALE=scale)


#: (codes, aux0, aux1) pointer types and tile constexprs of each stored kind
STORED = {
    "oscar-keys-int2": ((P8, P16, P16), _tile(tiles.INT_TOKENS, 2, 32, scale=tiles.BATCH_SCALE)),
    "oscar-values-int2": ((P8, P16, P16), _tile(tiles.INT_CHANNELS, 2, 32)),
    "oscar-keys-int3": ((P8, P16, P16), _tile(tiles.INT_TOKENS, 3, 128)),
    "turboquant-b3": ((P8, P32, P32), _tile(tiles.CODEBOOK, 3, scale=tiles.HEAD_SCALE)),
    "octopus-b2": ((P8, P32, P32), _tile(tiles.TRIPLETS, 7, rho_bits=1, scale=tiles.HEAD_SCALE)),
    "octopus-b4": ((P8, P32, P32), _tile(tiles.TRIPLETS, 13, rho_bits=3, scale=tiles.HEAD_SCALE)),
    "fp16": ((P16, P32, P32), _tile(tiles.DENSE, 8)),
}

#: (stored keys, stored values) pairs the methods attend over
ATTEND = {
    "oscar": ("oscar-keys-int2", "oscar-values-int2"),
    "kivi": ("oscar-keys-int3", "oscar-values-int2"),
    "turboquant": ("turboquant-b3", "turboquant-b3"),
    "octopus": ("octopus-b2", "octopus-b2"),
    "octopus-fp16-values": ("octopus-b4", "fp16"),
}


def _cases():
    yield "pack-2bit", packing._pack_kernel, dict(
        codes_ptr="*u8", out_ptr=P8, rows="i32", count="i32", nbytes="i32", BITS=2, SLOTS=4, ROWS=32, NBP=32)
    yield "pack-13bit", packing._pack_kernel, dict(
        codes_ptr=I32, out_ptr=P8, rows="i32", count="i32", nbytes="i32", BITS=13, SLOTS=2, ROWS=16, NBP=128)
    for name, integer_zero, ab, gb, cb in (("keys", True, 1, 32, 128), ("values", False, 128, 32, 1)):
        yield f"quantize-{name}", intcodes._quantize_kernel, dict(
            x_ptr=P32, codes_ptr=P8, scale_ptr=P16, offset_ptr=P16, A="i32", L="i32", C="i32", n_groups="i32",
            GROUP=128 if integer_zero else 32, BITS=2, INTEGER_ZERO=integer_zero, AB=ab, GB=gb, CB=cb)
    for norm_correction in (False, True):
        yield f"coordinates-nc{int(norm_correction)}", codebook._coordinate_kernel, dict(
            v_ptr=P32, codes_ptr=I32, norm_ptr=P32, rows="i32", thresholds=P32, centroids=P32, N_THRESHOLDS=7,
            D=128, DP=128, RB=32, NORM_CORRECTION=norm_correction)
    for joint in (False, True):
        yield f"triplets-joint{int(joint)}", codebook._triplet_kernel, dict(
            v_ptr=P32, codes_ptr=I32, rows="i32", n_triplets="i32", xi_thr=P32, eta_thr=P32, rho_thr=P32,
            directions=P32, N_XI=7, N_ETA=7, N_RHO=1, D=128, TP=64, RB=16, RHO_BITS=1, JOINT=joint)
    for name, (ptrs, consts) in STORED.items():
        yield f"decode-{name}", tiles._decode_kernel, dict(
            codes=ptrs[0], aux0=ptrs[1], aux1=ptrs[2], tscale=P32, out_ptr=P32, T="i32", HK="i32", nb="i32",
            nstat="i32", D=128, DP=128, BN=32, **consts)
    for name, (kname, vname) in ATTEND.items():
        (kp, kc), (vp, vc) = STORED[kname], STORED[vname]
        args = dict(q_ptr=P32, kc=kp[0], ka=kp[1], kb=kp[2], ks=P32, vc=vp[0], va=vp[1], vb=vp[2], vs=P32,
                    o_part=P32, m_part=P32, l_part=P32, R="i32", T="i32", HK="i32", k_nb="i32", k_nstat="i32",
                    v_nb="i32", v_nstat="i32", scale="fp32", tokens_per_split="i32", n_splits="i32",
                    D=128, DP=128, BM=16, BN=32 if kc["KIND"] == tiles.INT_TOKENS else 64,
                    PRECISION=attention.DOT_PRECISION, K_ONE_GROUP=kc["KIND"] == tiles.INT_TOKENS)
        for prefix, c in (("K", kc), ("V", vc)):
            args.update({f"{prefix}_KIND": c["KIND"], f"{prefix}_BITS": c["BITS"], f"{prefix}_SPAN": c["SPAN"],
                         f"{prefix}_GROUP": c["GROUP"], f"{prefix}_RHO": c["RHO_BITS"], f"{prefix}_SCALE": c["SCALE"]})
        yield f"attend-{name}", attention._attend_split_kernel, args
        yield f"window-{name}", window._window_kernel, dict(  # the same tiles, blocks read through the table
            q_ptr=P32, table="*i64", n_blocks="i32", wk=P32, wv=P32, o_part=P32, m_part=P32, l_part=P32, out_ptr=P32,
            lse_ptr=P32, R="i32", LQ="i32", W="i32", HK="i32", k_nb="i32", v_nb="i32", scale="fp32",
            tiles_per_split="i32", n_splits="i32", window_tile="i32", ONE_SPLIT=name == "oscar", ALIGNED=name != "kivi",
            **{k: a for k, a in args.items() if k.isupper() and k not in ("R", "T", "HK")})
    for name, params, block in (("oscar-int2", dict(method="oscar", bits=2), 32), ("kivi-int2", dict(method="kivi", bits=2, group=16), 16),
                                ("oscar-int4", dict(method="oscar", bits=4, key_group=64), 64),
                                ("octopus-b3", dict(method="octopus", bits=3), 16)):
        yield f"paged-{name}", paged._paged_split_kernel, _paged_args(params, block)
    yield "combine", attention._combine_kernel, dict(
        o_part=P32, m_part=P32, l_part=P32, out_ptr=P32, lse_ptr=P32, R="i32", n_splits="i32", D=128, DP=128, BM=16)


def _paged_args(params: dict, block: int) -> dict:
    """The paged kernel's arguments at d=128, GQA 4, 8 kv heads, as PagedTriton launches it."""
    spec = make_spec(params.pop("method"), head_dim=128, **params)
    layout = PageLayout(spec, block, 8)
    octopus = spec.method == "octopus"
    slot = layout.slot
    k, v = slot("keys", "codes"), slot("values", "codes")
    args = dict(q_ptr=P32, pages=P8, table=I32, req_ptr=I32, pos_ptr=I32, code_lens=I32, tail_k=P32, tail_v=P32,
                tail_lens=I32, aux0=P32, aux1=P32, o_part=P32, m_part=P32, l_part=P32, HK="i32", MB="i32",
                s_block="i64", s_head="i32", s_row="i32", max_tail="i32", scale="fp32", tokens_per_split="i32",
                n_splits="i32", G=4, D=128, BM=16, BS=block, CODE_BYTES=k.width, K_OFF=k.start, V_OFF=v.start,
                HAS_TAIL=True, PRECISION=attention.DOT_PRECISION)
    if octopus:
        args.update(KIND=paged.TRIPLETS, BITS=spec.triplet_bits, SPAN=packing.span(spec.triplet_bits), KGROUP=1,
                    VGROUP=1, RHO_BITS=spec.rho_bits, KS_OFF=0, KO_OFF=0, STAT_W=1, KN_OFF=slot("keys", "norm").start,
                    KN_W=4, USE_NORM=True, VS_OFF=0, VO_OFF=0, VN_OFF=slot("values", "norm").start, BN=64)
    else:
        kg = spec.key_group if spec.method == "oscar" else spec.group
        vg = spec.value_group if spec.method == "oscar" else spec.group
        norm = slot("keys", "norm") if spec.method == "oscar" else slot("keys", "scale")
        args.update(KIND=paged.INT, BITS=spec.bits, SPAN=1, KGROUP=kg, VGROUP=vg, RHO_BITS=0,
                    KS_OFF=slot("keys", "scale").start, KO_OFF=slot("keys", "offset").start,
                    STAT_W=slot("keys", "scale").width, KN_OFF=norm.start, KN_W=norm.width,
                    USE_NORM=spec.method == "oscar", VS_OFF=slot("values", "scale").start,
                    VO_OFF=slot("values", "offset").start, VN_OFF=0, BN=min(64, kg))
    return args


CASES = list(_cases())


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(("name", "fn", "args"), CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles(name: str, fn, args: dict, arch: int) -> None:
    compiled = _compile(fn, args, arch)
    assert compiled.asm.get("cubin"), f"{name}: no cubin for sm_{arch}"
    assert f".target sm_{arch}" in compiled.asm["ptx"]
