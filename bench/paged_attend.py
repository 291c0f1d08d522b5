"""Paged decode attention on the CPU: ``kvq::attend_paged`` on numba (one call for the batch, reading
the pages through the block table) against the gather-then-attend path (per request: gather its rows,
unpack, ``Quantizer.attend``; on numba, and on torch as the vLLM plugin did) and torch SDPA over
float32 K/V of the same lengths (batched, ``enable_gqa``), one query token per request.

    python bench/paged_attend.py [--batches 8 16] [--contexts 512 2048 4096] [--threads 1]

Shape: SmolLM2-135M's attention (3 KV heads, 9 query heads, head_dim 64). Each repeat times every
path once, in turn; the ratios are medians of the per-repeat ratios (a slow spell of the shared
machine moves both sides). Prints the CPU capability and ``uptime`` with the figures.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numba
import torch
import torch.nn.functional as F

import kvq_core
import kvq_core.dispatch.ops  # noqa: F401
from kvq_core.paged import PageLayout, gather_rows
from kvq_core.testing.paged import paged_case

HK, HQ, D = 3, 9, 64
CODECS = [("oscar", {"bits": 2}, 32), ("kivi", {"bits": 2}, 32), ("octopus", {"bits": 3}, 16), ("octopus", {"bits": 3}, 32)]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch-gather-max", type=int, default=2048,
                    help="largest context for the (slow) torch gather-then-attend path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); "
          f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("| codec | page | batch | context | paged numba ms | gather+numba ms | gather+torch ms | SDPA fp32 ms "
          "| paged vs gather+numba | paged vs SDPA |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method, params, page in CODECS:
        tq = kvq_core.get_quantizer(method, "torch", head_dim=D, **params)
        nq = kvq_core.get_quantizer(method, "numba", head_dim=D, **params)
        spec_json = tq.spec.to_json()
        for batch in args.batches:
            for ctx in args.contexts:
                case = paged_case(tq, block_size=page, kv_heads=HK, q_heads=HQ, code_lens=[ctx] * batch,
                                  q_lens=[1] * batch, seed=ctx + batch)
                layout = PageLayout(tq.spec, page, HK)
                k = torch.randn(batch, HK, ctx, D)
                v = torch.randn(batch, HK, ctx, D)
                qs = case.q.reshape(batch, HQ, 1, D)
                scale = D ** -0.5

                def paged() -> None:
                    torch.ops.kvq.attend_paged("numba", spec_json, 0, *case.args(), scale, None, None, None, None)

                def gathered(quant) -> None:  # noqa: ANN001
                    for r in range(batch):
                        pk, pv = layout.blocks(gather_rows(case.pages, case.block_table[r], ctx))
                        quant.attend(case.q[r][None, :, None, :], pk, pv, scale=scale)

                def sdpa() -> None:
                    F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)

                paths = {"paged": paged, "numba": lambda: gathered(nq), "sdpa": sdpa}
                if ctx <= args.torch_gather_max:
                    paths["torch"] = lambda: gathered(tq)
                for fn in paths.values():  # warm-up (compiles)
                    fn()
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(args.repeats):
                    for name, fn in paths.items():
                        times[name].append(_timed(fn))
                med = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
                vs_gather = statistics.median(g / p for g, p in zip(times["numba"], times["paged"]))
                vs_sdpa = statistics.median(s / p for s, p in zip(times["sdpa"], times["paged"]))
                torch_ms = f"{med['torch']:.1f}" if "torch" in med else "-"
                print(f"| {method}-{params.get('bits')} | {page} | {batch} | {ctx} | {med['paged']:.2f} | "
                      f"{med['numba']:.2f} | {torch_ms} | {med['sdpa']:.2f} | {vs_gather:.2f}x | {vs_sdpa:.2f}x |",
                      flush=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
