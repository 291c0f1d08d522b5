"""``python bench/vllm_serve.py --model DIR``: stock vLLM against kvq codecs, in one run.

Runs in the environment ``plugins/kvq-vllm/ci.sh`` builds (vLLM's CPU build + kvq + the plugin).
For each engine (stock, then each codec) it serves the same concurrent greedy prompts and
reports generated tokens per second, the KV capacity vLLM reports (tokens, and tokens per GiB of
``VLLM_CPU_KVCACHE_SPACE``), bytes per token over all layers and the ratio to stock. Every engine
runs in its own process (:func:`kvq_vllm.generate.run_job`). Writes ``--out`` (.json and .md).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from kvq_vllm.generate import run_job

CODECS = [None, {"method": "fp16", "storage": "float32"}, {"method": "octopus", "bits": 3},
          {"method": "turboquant", "bits": 3}, {"method": "quarot", "bits": 4}]
PROMPTS = ["The capital of France is", "Write a short poem about the sea. The waves",
           "def fibonacci(n):", "The three most important inventions of the last century are",
           "Once upon a time, in a small village by the mountains,", "Explain why the sky is blue:"]


def label(kvq: dict | None) -> str:
    if kvq is None:
        return "stock vLLM (fp32 KV)"
    return kvq["method"] + "".join(f" {k}={v}" for k, v in kvq.items() if k != "method")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the converted checkpoint (plugins/kvq-vllm/convert_model.py)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="concurrent prompts (at most %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="stock and OCTOPUS b=3 only")
    p.add_argument("--out", default="bench/results/vllm_serve")
    args = p.parse_args(argv)
    gib = float(os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1"))
    codecs = CODECS[::2][:2] if args.quick else CODECS
    rows = []
    for kvq in codecs:
        r = run_job({"model": args.model, "kvq": kvq, "prompts": PROMPTS[: args.prompts],
                     "max_tokens": args.max_tokens, "engine": {"block_size": 32}})
        rows.append({"engine": label(kvq), "kvq": kvq, "kv_tokens": r["kv_tokens"],
                     "kv_tokens_per_gib": round(r["kv_tokens"] / gib), "kv_bytes_per_token": r["kv_bytes_per_token"],
                     "tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"], "backend": r["backend"],
                     "first_text": r["outputs"][0]["text"]})
        print(f"{rows[-1]['engine']}: {r['kv_tokens']} KV tokens, {r['tokens_per_s']} tok/s", flush=True)
    stock = rows[0]
    cpu = torch.backends.cpu.get_cpu_capability()
    lines = [f"# vLLM serving: stock vs kvq codecs ({args.prompts} concurrent prompts x {args.max_tokens} greedy tokens)",
             "", f"Model {Path(args.model).name}, fp32, enforce_eager, block_size 32, VLLM_CPU_KVCACHE_SPACE={gib:g} GiB, "
             f"CPU capability {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads.", "",
             "| engine | KV bytes/token (all layers) | KV tokens per GiB | vs stock | generated tok/s | vs stock |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['kv_bytes_per_token']} | {r['kv_tokens_per_gib']} | "
                     f"{r['kv_tokens'] / stock['kv_tokens']:.2f}x | {r['tokens_per_s']} | "
                     f"{r['tokens_per_s'] / stock['tokens_per_s']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"cpu_capability": cpu, "gib": gib, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
