"""Paged decode attention on the CPU: ``kvq::attend_paged`` on numba (one call for the batch, reading
the pages through the block table) against torch SDPA over float32 K/V of the same lengths (batched,
``enable_gqa``) and, when vLLM is importable (the plugin's venv), vLLM's own CPU paged attention
(``cpu_attention_with_kv_cache`` over float32 pages, its scheduler metadata built outside the
timing, as its metadata builder does once per step); one query token per request.

    python bench/paged_attend.py [--batches 8 24] [--contexts 64 128 256 512 1024 2048] [--threads 1]

Shape: SmolLM2-135M's attention (3 KV heads, 9 query heads, head_dim 64), pages of 32 tokens (the
serving benchmark's block size). Each repeat times every path once, in turn; the ratios are
medians of the per-repeat ratios (a slow spell of the shared machine moves both sides). Prints
the CPU capability and ``uptime`` with the figures.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

import numba
import torch
import torch.nn.functional as F

import kvq_core
import kvq_core.torch_ops.ops  # noqa: F401
from kvq_core.torch_ops.torch_kernels import spec_from_json
from kvq_core.torch_ops.torch_kernels import field_names
from kvq_core.paged import PageLayout

HK, HQ, D, PAGE = 3, 9, 64, 32
CODECS = [("octopus", {"bits": 3}), ("oscar", {"bits": 2}), ("kivi", {"bits": 2})]


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def coded_pages(spec_json: str, k: torch.Tensor, v: torch.Tensor,
                table: torch.Tensor) -> torch.Tensor:
    """Token-major ``uint8`` pages (vLLM's physical order, seen ``[blocks, kv_heads, PAGE, row_bytes]``)
    holding ``k, v [batch, kv_heads, ctx, d]`` encoded, request ``r``'s block ``j`` at ``table[r, j]``."""
    spec = spec_from_json(spec_json)
    batch, _, ctx, _ = k.shape
    blocks = table.shape[1]
    pad = blocks * PAGE - ctx
    kp, vp = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    fields = [dict(zip(field_names(spec, kind), torch.ops.kvq.encode("torch", spec_json, 0, kind, x)))
              for kind, x in (("keys", kp), ("values", vp))]
    layout = PageLayout(spec, PAGE, HK)
    rows = layout.pack(*fields)  # [batch, HK, blocks * PAGE, row_bytes]
    physical = torch.zeros(batch * blocks, PAGE, HK, layout.row_bytes, dtype=torch.uint8)
    by_block = rows.view(batch, HK, blocks, PAGE, -1).permute(0, 2, 3, 1, 4).reshape(batch * blocks, PAGE, HK, -1)
    physical[table.view(-1).long()] = by_block
    return physical.permute(0, 2, 1, 3)


def vllm_attend(batch: int, ctx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                scale: float) -> Callable[[], object] | None:
    """vLLM's CPU decode attention over the same K/V in float32 pages, or None without vLLM."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    blocks = -(-ctx // PAGE)
    isa = _get_attn_isa(torch.float32, PAGE, D)
    kv = torch.zeros(batch * blocks, HK, 2 * PAGE, D)  # vLLM's cache view: K then V per (block, head)
    kc, vc = kv.chunk(2, dim=2)
    pos = torch.arange(ctx)
    slots = (table[:, pos // PAGE].long() * PAGE + pos % PAGE).reshape(-1)  # its own cache writer's layout
    ops.cpu_attn_reshape_and_cache(k.transpose(1, 2).reshape(-1, HK, D), v.transpose(1, 2).reshape(-1, HK, D),
                                   kc, vc, slots, isa)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=batch, num_heads=HQ, num_kv_heads=HK, head_dim=D,
                                               seq_lens=lens, dtype=torch.float32, query_start_loc=qsl, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=True)
    out = torch.empty(batch, HQ, D)
    qt = q.reshape(batch, HQ, D).contiguous()

    def run() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(query=qt, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                                        seq_lens=lens, scale=scale, causal=True, alibi_slopes=None,
                                        sliding_window=-1, block_table=table, softcap=0.0,
                                        scheduler_metadata=meta, s_aux=None)
        return out

    want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).reshape(batch, HQ, D)
    got = run()
    err = float((got - want).abs().max())
    if err > 1e-3:
        raise SystemExit(f"vLLM's CPU attention differs from SDPA by {err} (page layout misread)")
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); uptime: {_uptime()}")
    print("| codec | batch | context | paged numba us | SDPA fp32 us | vLLM CPU fp32 us | paged vs SDPA | paged vs vLLM |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    scale = D ** -0.5
    for method, params in CODECS:
        tq = kvq_core.get_quantizer(method, "torch", head_dim=D, **params)
        spec_json = tq.spec.to_json()
        for batch in args.batches:
            for ctx in args.contexts:
                gen = torch.Generator().manual_seed(ctx + batch)
                k, v = torch.randn(batch, HK, ctx, D, generator=gen), torch.randn(batch, HK, ctx, D, generator=gen)
                q = torch.randn(batch, HQ, D, generator=gen)
                qs = q.reshape(batch, HQ, 1, D)
                blocks = -(-ctx // PAGE)
                table = torch.randperm(batch * blocks, generator=gen, dtype=torch.int32).view(batch, blocks)
                pages = coded_pages(spec_json, k, v, table)
                lens = torch.full((batch,), ctx, dtype=torch.int32)
                qsl = torch.arange(batch + 1, dtype=torch.int32)
                paths = {
                    "paged": lambda: torch.ops.kvq.attend_paged("numba", spec_json, 0, q, pages, table, lens, qsl,
                                                                scale, None, None, None, None),
                    "sdpa": lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True),
                }
                theirs = vllm_attend(batch, ctx, qs, k, v, table, scale)
                if theirs is not None:
                    paths["vllm"] = theirs
                for fn in paths.values():  # warm-up (compiles)
                    fn()
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(args.repeats):
                    for name, fn in paths.items():
                        times[name].append(_timed(fn))
                med = {name: 1e6 * statistics.median(ts) for name, ts in times.items()}
                vs = {name: statistics.median(s / p for s, p in zip(times[name], times["paged"])) for name in times}
                vllm_us = f"{med['vllm']:.0f}" if "vllm" in med else "-"
                vllm_x = f"{vs['vllm']:.2f}x" if "vllm" in vs else "-"
                print(f"| {method}-{params['bits']} | {batch} | {ctx} | {med['paged']:.0f} | {med['sdpa']:.0f} | "
                      f"{vllm_us} | {vs['sdpa']:.2f}x | {vllm_x} |", flush=True)
    print(f"uptime: {_uptime()}")


if __name__ == "__main__":
    main()
