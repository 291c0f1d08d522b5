"""What limits serving benchmark (b) on this CPU: one engine's prefill, decode steps and whole
workload with unlimited KV memory, against stock at the budget.

    python bench/vllm_bound.py --model ~/.cache/kvq-vllm/smollm2-fp32 [--kvq '{"method": "octopus", "bits": 3}']
                               [--out bench/results/vllm_bound.md]          (in the plugin's vLLM venv)

One engine (stock, or a kvq codec with ``--kvq``; fp32, enforce_eager, block size 32, max_num_seqs 24,
chunks of 2048 tokens, no prefix caching and the engine core in-process as in (b), 1 GiB of KV: every request runs at once, no
preemption) on (b)'s 24 prompts (WikiText-2 windows of 512 tokens): (1) 1 token each: the prefill;
(2) 65 tokens each: the whole workload, whose difference from (1) is 64 decode steps at batch 24;
(3) 5 of the prompts, 65 tokens less 1 token: decode steps at batch 5 (what the (b) budget holds of
stock). With ``bench/results/vllm_serve.json`` present, the whole workload with unlimited KV is set
against stock's measured wall time at (b)'s headline budget: a codec that computes as this engine
does can gain at most that ratio from capacity alone. Prints CPU capability and load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from vllm_serve import TEXT, long_prompts

SERVE = Path(__file__).resolve().parent / "results" / "vllm_serve.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--budget-batch", type=int, default=5)
    ap.add_argument("--kvq", default=None, help="a kvq codec as JSON: time that engine instead of stock")
    ap.add_argument("--out", default=None, help="also write the figures to this .md file")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the engine core in this process, as (b) runs it (kvq_vllm.generate's track_running): on 2 cores a
    # separate engine-core process roughly halved these engines' speed
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=False,
              max_num_seqs=args.requests, max_model_len=args.prompt + args.gen + 32, max_num_batched_tokens=2048,
              gpu_memory_utilization=0.3, **({"additional_config": {"kvq": json.loads(args.kvq)}} if args.kvq else {}))
    prompts = [{"prompt_token_ids": ids} for ids in long_prompts(args.model, TEXT, args.requests, args.prompt)]

    def timed(ps: list, tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t

    timed(prompts[-1:], 2)  # warm-up (numba compiles on a kvq engine's first steps)
    prefill = timed(prompts, 1)
    whole = timed(prompts, args.gen + 1)
    small = prompts[:args.budget_batch]
    step_small = (timed(small, args.gen + 1) - timed(small, 1)) / args.gen
    tokens = args.requests * args.gen
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines = [f"engine: {args.kvq or 'stock vLLM'}; cpu capability {torch.backends.cpu.get_cpu_capability()}, "
             f"torch threads {torch.get_num_threads()}; {load}",
             f"prefill of {args.requests} x {args.prompt} tokens: {prefill:.2f} s",
             f"whole workload ({args.gen} tokens each) with unlimited KV: {whole:.2f} s = {tokens / whole:.2f} tok/s "
             f"(decode step at batch {args.requests}: {1e3 * (whole - prefill) / args.gen:.1f} ms; at batch "
             f"{args.budget_batch}: {1e3 * step_small:.1f} ms)"]
    if SERVE.exists():
        stock = [r for r in json.loads(SERVE.read_text()).get("budgeted", []) if r["kvq"] is None]
        if stock:
            r = stock[0]  # the headline budget comes first
            lines.append(f"stock at {r['budget_mib']} MiB in bench/results/vllm_serve.json: {r['seconds']} s; "
                         f"this engine with unlimited KV: {whole:.2f} s: {r['seconds'] / whole:.2f}x")
    print("\n".join(lines))
    if args.out:
        head = ["# What limits serving benchmark (b) (`python bench/vllm_bound.py`)", "",
                "SmolLM2-135M fp32, one engine, unlimited KV (the module docstring of bench/vllm_bound.py).", ""]
        Path(args.out).write_text("\n".join(head + [f"- {x}" for x in lines]) + "\n")


if __name__ == "__main__":
    main()
