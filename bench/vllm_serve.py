"""``python bench/vllm_serve.py --model DIR``: stock vLLM against kvq codecs, in one run.

Runs in the environment ``plugins/kvq-vllm/ci.sh`` builds (vLLM's CPU build + kvq + the plugin).
Every engine runs in its own process, one after another (:func:`kvq_vllm.generate.run_job`), on
the same prompts with greedy decoding.

- **(a) generous budget**: ``--prompts`` concurrent prompts x ``--max-tokens`` tokens with
  ``VLLM_CPU_KVCACHE_SPACE`` of KV (no engine runs out): generated tokens/s against stock, and the
  KV capacity vLLM reports.
- **(b) fixed KV-memory budget**: every engine gets the same bytes of KV (``num_gpu_blocks_override``
  = budget / that engine's block bytes; a token-group codec's staging buffers are paid out of its
  budget), and 24 requests x 512 prompt tokens x 64 generated tokens (WikiText-2 windows, all
  different) that stock must queue and preempt at the headline budget: wall time, tokens/s,
  preemptions and the most requests running in one scheduler step, per engine and budget.

Writes ``--out`` .json, .md (both tables) and .png (tokens/s against budget per engine).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from kvq_vllm.generate import run_job

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
BLOCK = 32
SEQS = 24  # (b): max_num_seqs, so an engine with room runs every request at once
GENEROUS = [None, {"method": "octopus", "bits": 3}, {"method": "oscar", "bits": 2}, {"method": "kivi", "bits": 2}]
BUDGETED = [None, {"method": "octopus", "bits": 3}, {"method": "oscar", "bits": 2}]
PROMPTS = ["The capital of France is", "Write a short poem about the sea. The waves",
           "def fibonacci(n):", "The three most important inventions of the last century are",
           "Once upon a time, in a small village by the mountains,", "Explain why the sky is blue:",
           "The recipe for a good bread starts with", "In 1969, the first humans landed on"]
TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2-test.txt"


def label(kvq: dict | None) -> str:
    if kvq is None:
        return "stock vLLM (fp32 KV)"
    return kvq["method"] + "".join(f" {k}={v}" for k, v in kvq.items() if k != "method")


def block_bytes(kvq: dict | None) -> tuple[int, int]:
    """(bytes of one KV block over all layers, bytes of the staging buffers) of an engine."""
    if kvq is None:
        return LAYERS * KV_HEADS * BLOCK * 2 * HEAD_DIM * 4, 0
    from kvq_core import registry
    from kvq_core.paged import PageLayout

    params = {k: v for k, v in kvq.items() if k not in ("method", "backend")}
    layout = PageLayout(registry.make_spec(kvq["method"], head_dim=HEAD_DIM, **params), BLOCK, KV_HEADS)
    staging = 0
    if layout.group > 1:  # kvq_vllm.backend.staging_bytes for max_num_seqs requests, no speculation
        staging = (SEQS + 4) * 2 * KV_HEADS * layout.group * HEAD_DIM * 4 * LAYERS
    return LAYERS * KV_HEADS * BLOCK * layout.row_bytes, staging


def long_prompts(model: str, text: Path, count: int, tokens: int) -> list[list[int]]:
    """``count`` different ``tokens``-token windows of ``text`` (WikiText-2), as token ids."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(text.read_text()[:200_000])["input_ids"]
    return [ids[i * tokens:(i + 1) * tokens] for i in range(count)]


def run(model: str, kvq: dict | None, prompts: list, max_tokens: int, engine: dict, **extra) -> dict:
    t0 = time.perf_counter()
    r = run_job({"model": model, "kvq": kvq, "prompts": prompts, "max_tokens": max_tokens,
                 "engine": {"block_size": BLOCK, **engine}, "warmup": True, **extra}, timeout=3600)
    if "error" in r:
        raise RuntimeError(f"{label(kvq)}: {r['error']}\n{r['log'][-3000:]}")
    r["process_seconds"] = round(time.perf_counter() - t0, 1)
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the converted checkpoint (plugins/kvq-vllm/convert_model.py)")
    p.add_argument("--prompts", type=int, default=8, help="(a): concurrent prompts (at most %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="(a): greedy tokens per prompt")
    p.add_argument("--budgets", default="120,240,60", help="(b): KV budgets in MiB, the headline first")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--text", default=str(TEXT), help="(b): the text the prompts are cut from")
    p.add_argument("--parts", default="ab", help="a, b or ab")
    p.add_argument("--out", default="bench/results/vllm_serve")
    args = p.parse_args(argv)
    gib = float(os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1"))
    cpu = torch.backends.cpu.get_cpu_capability()
    load = lambda: os.getloadavg()[0]  # noqa: E731
    generous, budgeted = [], []
    previous = Path(args.out).with_suffix(".json")
    if "a" not in args.parts and previous.exists():  # keep (a) of an earlier run of this command
        generous = json.loads(previous.read_text())["generous"]
    if "a" in args.parts:
        for kvq in GENEROUS:
            r = run(args.model, kvq, PROMPTS[: args.prompts], args.max_tokens, {"max_num_seqs": args.prompts})
            generous.append({"engine": label(kvq), "kvq": kvq, "kv_tokens": r["kv_tokens"],
                             "kv_bytes_per_token": r["kv_bytes_per_token"], "tokens_per_s": r["tokens_per_s"],
                             "seconds": r["seconds"], "backend": r["backend"], "load_after": round(load(), 1),
                             "first_text": r["outputs"][0]["text"]})
            print(f"(a) {generous[-1]['engine']}: {r['tokens_per_s']} tok/s, {r['kv_tokens']} KV tokens", flush=True)
            write(args, gib, cpu, generous, budgeted, quiet=True)  # every finished run is kept
    if "b" in args.parts:
        prompts = long_prompts(args.model, Path(args.text), args.requests, args.prompt_tokens)
        for mib in [int(b) for b in args.budgets.split(",")]:
            for kvq in BUDGETED:
                per_block, staging = block_bytes(kvq)
                blocks = (mib * 2**20 - staging) // per_block
                engine = {"num_gpu_blocks_override": int(blocks), "max_num_seqs": SEQS, "enable_prefix_caching": False,
                          "max_model_len": args.prompt_tokens + args.generate + BLOCK, "max_num_batched_tokens": 2048}
                try:
                    r = run(args.model, kvq, prompts, args.generate, engine, track_running=True)
                except RuntimeError as exc:  # keep the other engines' figures; say what failed
                    print(f"(b) {mib} MiB {label(kvq)} failed: {exc}", flush=True)
                    continue
                assert r["kv_bytes_per_token"] * BLOCK == per_block, (r["kv_bytes_per_token"], per_block)
                budgeted.append({"engine": label(kvq), "kvq": kvq, "budget_mib": mib, "blocks": int(blocks),
                                 "staging_mib": round(staging / 2**20, 1), "kv_tokens": r["kv_tokens"],
                                 "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"],
                                 "preemptions": r["preemptions"], "peak_running": r["peak_running"],
                                 "load_after": round(load(), 1)})
                print(f"(b) {mib} MiB {budgeted[-1]['engine']}: {blocks} blocks, {r['seconds']} s, "
                      f"{r['tokens_per_s']} tok/s, {r['preemptions']:.0f} preemptions, peak {r['peak_running']} running",
                      flush=True)
                write(args, gib, cpu, generous, budgeted, quiet=True)
    write(args, gib, cpu, generous, budgeted)
    return 0


def write(args: argparse.Namespace, gib: float, cpu: str, generous: list[dict], budgeted: list[dict],
          quiet: bool = False) -> None:
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    lines = ["# vLLM serving: stock vs kvq codecs (SmolLM2-135M fp32, CPU)", "",
             f"CPU capability {cpu}, torch {torch.__version__}, {nproc} cores; fp32, enforce_eager, block_size "
             f"{BLOCK}; each engine in its own process, one after another; load average after each run in the tables."]
    if generous:
        stock = generous[0]
        lines += ["", f"## (a) generous budget: {args.prompts} concurrent prompts x {args.max_tokens} greedy tokens, "
                  f"VLLM_CPU_KVCACHE_SPACE={gib:g} GiB", "",
                  "| engine | kvq backend | KV bytes/token | KV tokens | vs stock | generated tok/s | vs stock | load |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in generous:
            lines.append(f"| {r['engine']} | {r['backend'].rsplit('.', 1)[-1]} | {r['kv_bytes_per_token']} | "
                         f"{r['kv_tokens']} | {r['kv_tokens'] / stock['kv_tokens']:.2f}x | {r['tokens_per_s']} | "
                         f"{r['tokens_per_s'] / stock['tokens_per_s']:.2f}x | {r['load_after']} |")
    if budgeted:
        lines += ["", f"## (b) fixed KV budget: {args.requests} requests x {args.prompt_tokens} prompt tokens x "
                  f"{args.generate} generated, max_num_seqs {SEQS}", "",
                  "| budget | engine | KV blocks | staging | wall s | generated tok/s | vs stock | preemptions | "
                  "peak running | load |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in budgeted:
            stock = next(s for s in budgeted if s["budget_mib"] == r["budget_mib"] and s["kvq"] is None)
            lines.append(f"| {r['budget_mib']} MiB | {r['engine']} | {r['blocks']} | {r['staging_mib']} MiB | "
                         f"{r['seconds']} | {r['tokens_per_s']} | {r['tokens_per_s'] / stock['tokens_per_s']:.2f}x | "
                         f"{r['preemptions']:.0f} | {r['peak_running']} | {r['load_after']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"cpu_capability": cpu, "gib": gib, "generous": generous,
                                                    "budgeted": budgeted}, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if budgeted:
        plot(budgeted, out.with_suffix(".png"))
    if not quiet:
        print("\n".join(lines))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["budget_mib"])
        ax.plot([r["budget_mib"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=engine)
    ax.set_xlabel("KV-cache budget (MiB)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("SmolLM2-135M on vLLM CPU: 24 x (512 + 64) tokens")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
