"""``python bench/decode_flush.py``: what the sliding flush costs at decode time.

A sliding flush (every decode query sees exactly ``residual`` exact tokens, the OCTOPUS
protocol) encodes one token per layer at every step, or ``stride`` tokens every ``stride``
steps (same attention); the block flush encodes ``residual`` tokens every ``residual`` steps.
This greedy-decodes ``--new`` tokens after a ``--prompt``-token
WikiText-2 prompt on SmolLM2-135M with each (method, flush, attention mode) and reports decode
tokens/s as a ratio to the block flush measured in the same run, plus the blocks each layer
holds at the end. Writes ``bench/results/decode_flush.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def decode_rate(model: Any, ids: Any, cache: Any, new: int) -> tuple[float, int]:
    """Decode tokens/s after prefilling ``ids`` into ``cache``; and the blocks layer 0 holds."""
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    import torch

    with torch.no_grad():
        logits = model(ids, **cache_kwargs(model, cache), use_cache=True).logits
        tok = logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new):
            tok = model(tok, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
        dt = time.perf_counter() - t0
    return new / dt, len(cache.kvq_layers[0].blocks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=["octopus:bits=3", "turboquant:bits=3"])
    p.add_argument("--prompt", type=int, default=1536)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--residual", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/results/decode_flush.json")
    args = p.parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    from kvq_core.tools.eval.model import load_model
    from kvq_core.tools.eval.text import load_text
    from kvq_core.integrations.hf import KVQCache

    model, tok, info = load_model(None, attn_implementation="kvq", threads=args.threads)
    text, _ = load_text(None, None)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.prompt]
    rows = []
    flushes = [("block", 1), ("sliding", 1), ("sliding", args.residual)]
    runs = [(m, f, s, a) for m in args.methods for a in ("dequant", "codes") for f, s in flushes]
    for spec, flush, stride, attention in tqdm(runs, desc="decode"):
        method, _, params = spec.partition(":")
        kw = {k: int(v) for k, v in (x.split("=") for x in params.split(",") if x)}
        cache = KVQCache(model.config, method, residual=args.residual, flush=flush, stride=stride, attention=attention, **kw)
        rate, blocks = decode_rate(model, ids, cache, args.new)
        label = flush if stride == 1 else f"{flush}, stride {stride}"
        rows.append({"method": spec, "flush": label, "attention": attention, "tok_s": rate, "blocks": blocks})
    for r in rows:
        base = next(x for x in rows if (x["method"], x["attention"], x["flush"]) == (r["method"], r["attention"], "block"))
        r["vs_block"] = r["tok_s"] / base["tok_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": info["name"], "prompt": args.prompt, "new": args.new, "residual": args.residual,
            "threads": args.threads, "torch_threads": torch.get_num_threads()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# Decode speed by flush policy: {info['name']}", "",
          f"Greedy decode of {args.new} tokens after a {args.prompt}-token prompt, residual {args.residual}, "
          f"{args.threads} thread(s); ratios are to the block flush in the same run (same method, same mode).", "",
          "| method | attention | flush | decode tokens/s | vs block | blocks in layer 0 |", "|---|---|---|---|---|---|"]
    md += [f"| {r['method']} | {r['attention']} | {r['flush']} | {r['tok_s']:.1f} | {r['vs_block']:.2f} | {r['blocks']} |"
           for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
