"""Multi-token queries on the CPU: ``kvq::attend_paged`` on numba scoring from the codes against
decoding the request's context to float32 K/V once and attending on torch's flash kernel (the two
paths of :mod:`kvq_numba.paged`, forced by ``DENSE_MIN_QUERY``), one request, SmolLM2-135M's shape
(3 KV heads, 9 query heads, head_dim 64), the query tokens the last ``q_len`` of the context.

    python bench/paged_prefill.py [--contexts 512 2048] [--q-lens 1 2 4 8 16 64 512] [--threads 1]

Each repeat times both paths once, in turn; the ratio is the median of per-repeat ratios. The
crossover (smallest ``q_len`` where decoding wins at every context) is what ``DENSE_MIN_QUERY``
is set from. Prints the CPU capability and ``uptime`` with the figures.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numba
import torch

import kvq_core
import kvq_core.torch_ops.ops  # noqa: F401
from kvq_core.testing.paged import paged_case
from kvq_numba import paged

HK, HQ, D = 3, 9, 64
CODECS = [("octopus", {"bits": 3}, 16), ("oscar", {"bits": 2}, 32), ("kivi", {"bits": 2}, 32)]


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--q-lens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); uptime: {_uptime()}")
    print("| codec | page | context | q_len | codes ms | decode + flash ms | decode + flash vs codes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method, params, page in CODECS:
        tq = kvq_core.get_quantizer(method, "torch", head_dim=D, **params)
        spec_json = tq.spec.to_json()
        for ctx in args.contexts:
            for q_len in (x for x in args.q_lens if x <= ctx):
                case = paged_case(tq, block_size=page, kv_heads=HK, q_heads=HQ, code_lens=[ctx], q_lens=[q_len],
                                  seed=ctx + q_len)

                def call(dense_min: int) -> float:
                    paged.DENSE_MIN_QUERY = dense_min
                    t = time.perf_counter()
                    torch.ops.kvq.attend_paged("numba", spec_json, 0, *case.args(), D ** -0.5, None, None, None, None)
                    return time.perf_counter() - t

                paths = {"codes": 1 << 30, "dense": 1}
                for m in paths.values():
                    call(m)  # warm-up (compiles)
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(args.repeats):
                    for name, m in paths.items():
                        times[name].append(call(m))
                med = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
                ratio = statistics.median(c / e for c, e in zip(times["codes"], times["dense"]))
                print(f"| {method}-{params['bits']} | {page} | {ctx} | {q_len} | {med['codes']:.2f} | "
                      f"{med['dense']:.2f} | {ratio:.2f}x |", flush=True)
    print(f"uptime: {_uptime()}")


if __name__ == "__main__":
    main()
