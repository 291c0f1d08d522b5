"""The best tokens/s ratio serving benchmark (b) allows on this CPU: stock vLLM's own prefill and
decode step times, and what an engine with unlimited KV (every request running at once, no
preemption) would take against stock at the (b) budget.

    python bench/vllm_bound.py --model ~/.cache/kvq-vllm/smollm2-fp32   (in the plugin's vLLM venv)

One stock engine (fp32, enforce_eager, block size 32, prefix caching, max_num_seqs 24, 1 GiB of KV):
(1) 24 distinct 512-token prompts, 1 token each: the prefill of workload (b); (2) the same prompts,
65 tokens (their prefixes cached): 64 decode steps at batch 24 over ~512-576 tokens; (3) 5 of them,
65 tokens: 64 steps at batch 5 (the (b) budget holds ~4-5 stock requests). Then

    unlimited = prefill + 64 * step(24);   stock at the budget >= prefill + (24 * 64 / 5) * step(5)

(stock also recomputes what it preempts: its real time is longer), so the ratio bound is
``stock / unlimited`` for an engine that decodes as fast as stock. Prints CPU capability and load.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--budget-batch", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=True,
              max_num_seqs=args.requests, max_model_len=args.prompt + args.gen + 8, gpu_memory_utilization=0.3)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt)]}
               for _ in range(args.requests)]

    def timed(ps: list, tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t

    timed(prompts[-1:], 2)  # warm-up
    prefill = timed(prompts, 1)
    step24 = (timed(prompts, args.gen + 1) - timed(prompts, 1)) / args.gen
    small = prompts[:args.budget_batch]
    step5 = (timed(small, args.gen + 1) - timed(small, 1)) / args.gen
    total = args.requests * args.gen
    unlimited = prefill + args.gen * step24
    stock = prefill + total / args.budget_batch * step5
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}; {load}")
    print(f"prefill {args.requests} x {args.prompt} tokens: {prefill:.2f} s ({prefill / args.requests:.3f} s per prompt)")
    print(f"decode step at batch {args.requests}: {1e3 * step24:.1f} ms; at batch {args.budget_batch}: {1e3 * step5:.1f} ms")
    print(f"unlimited KV: {unlimited:.1f} s = {total / unlimited:.2f} tok/s; stock at the budget >= {stock:.1f} s = "
          f"{total / stock:.2f} tok/s; bound on the ratio: {stock / unlimited:.2f}x")


if __name__ == "__main__":
    main()
