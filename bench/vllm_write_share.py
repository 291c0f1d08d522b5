"""Where a kvq engine's time goes in the (a) workload of ``bench/vllm_serve.py`` (8 concurrent
prompts x 64 greedy tokens, SmolLM2-135M fp32 on CPU): the share of the batch's wall time spent in
``KVQAttentionImpl.do_kv_cache_update`` (the cache write) and in ``forward`` (paged attention).

    python bench/vllm_write_share.py --model DIR [--kvq '{"method": "octopus", "bits": 3}'] [--kvq none]

Runs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so both methods can be
timed (wall clock around each call); ``--kvq none`` runs stock vLLM (tokens/s only). Prints the
CPU capability and the load average with the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import time

PROMPTS = ["The capital of France is", "Write a short poem about the sea. The waves",
           "def fibonacci(n):", "The three most important inventions of the last century are",
           "Once upon a time, in a small village by the mountains,", "Explain why the sky is blue:",
           "The recipe for a good bread starts with", "In 1969, the first humans landed on"]


def timed(cls: type, name: str, spent: dict[str, float]) -> None:
    """Wrap ``cls.name`` so that its wall time adds up in ``spent[name]``."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t

    setattr(cls, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--kvq", default='{"method": "octopus", "bits": 3}', help="the codec's JSON, or none")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from kvq_vllm.backend import KVQAttentionImpl

    kvq = None if args.kvq == "none" else json.loads(args.kvq)
    spent = {"do_kv_cache_update": 0.0, "forward": 0.0}
    for name in spent:
        timed(KVQAttentionImpl, name, spent)
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": len(PROMPTS),
              "block_size": 32, "gpu_memory_utilization": 0.3}  # on CPU: the free memory demanded at start
    if kvq is not None:
        engine["additional_config"] = {"kvq": kvq}
    llm = LLM(model=args.model, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
    for name in spent:
        spent[name] = 0.0
    t = time.perf_counter()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    wall = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()}")
    print(f"{args.kvq}: {generated} tokens in {wall:.2f} s = {generated / wall:.1f} tok/s")
    if kvq is not None:
        for name, s in spent.items():
            print(f"  {name}: {s:.2f} s = {100 * s / wall:.0f}% of the batch's wall time")


if __name__ == "__main__":
    main()
