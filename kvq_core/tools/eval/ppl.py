"""``kvq eval ppl``: perplexity through the real cache, every configuration side by side.

Protocol (per window of ``prefix + score + 1`` tokens of the text):

1. the prefix is prefilled through the cache (prefill attention is full precision, as every
   method's reference does; the K/V it writes are then quantized by the cache);
2. the continuation is fed in teacher-forced chunks that attend to the cache, and token t+1 is
   scored from the logits at t, so all ``score`` predictions come from attention over the
   quantized cache plus the exact window.

Chunks default to each cache's flush block (``residual`` for kvq, ``residual_length`` for
transformers' QuantizedCache), aligned to block boundaries: a query then sees exactly what it
would see decoding token by token (the tokens since the last flush exact, all else packed).
Caches with a sliding flush (OCTOPUS, TurboQuant, PolarQuant: every decode query sees exactly
its ``residual`` most recent tokens exact) score with ``chunks="decode"`` through the ``"kvq"``
attention function, which gives each query of a chunk that same view (the model is loaded with
it; without it they score one token per step).

The prefix forward is shared: it is run once per window with a ``DynamicCache`` and its K/V are
written into each configuration's cache with one ``update`` per layer, which is what a prefill
forward does (``--no-shared-prefill`` runs the prefill per configuration instead).

Windows: the text is cut into consecutive windows; windows below ``--first-window`` are left
for tuning, and ``--windows`` report windows are spread evenly over the rest of the file.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from kvq_core.tools.eval.args import add_common_args
from kvq_core.tools.eval.caches import KVQ_KINDS, CacheConfig, build_cache, expand_seeds, parse_config, populate, steady_bits, stored

# the best configuration found at <= 3.2 true bits per element (tuned on windows 0-2, see docs/eval.md):
# TurboQuant keys at 3 bits and values at 2 bits, both norm-corrected, 28 exact tokens
BEST = ("turboquant:bits=3,norm_correction=true,v.bits=2,v.norm_correction=true,residual=28,"
        "label=kvq-best[TQ K3/V2 nc W28]")
DEFAULT_METHODS = (
    "fp",
    "quanto:nbits=4",
    "quanto:nbits=2",
    "oscar:bits=4",
    "oscar:bits=3",
    "oscar:bits=2",
    "oscar:bits=2,token_scaling=false",
    "kivi:bits=2",
    "octopus:bits=4",
    "octopus:bits=3",
    "octopus:bits=2",
    "octopus:bits=3,fp_key_layers=0;-1,label=octopus-3[K exact in first+last layer]",
    "turboquant:bits=4,residual=32",
    "turboquant:bits=3,residual=32",
    "turboquant:bits=2,residual=32",
    "turboquant:bits=3,high_bits_coords=32,residual=32,label=turboquant-3.5[rate of octopus-3]",
    "turboquant:bits=2,high_bits_coords=32,residual=32,label=turboquant-2.5[rate of octopus-2]",
    BEST,
)
OUT_NAME = "eval_ppl.json"  # in kvq_core.tools.results.results_dir() unless --out says otherwise


def chunk_plan(cfg: CacheConfig, cache: Any, prefix: int, score: int, chunk: int | None,
               decode_view: bool = True) -> list[int]:
    """Chunk sizes covering ``score`` tokens: fixed ``chunk``, or the cache's flush block, aligned.
    A sliding-flush cache without ``decode_view`` (the kvq attention function) gets single tokens."""
    if chunk is None:
        block = 128
        if cfg.kind in KVQ_KINDS:
            layers = getattr(cache, "kvq_layers", [])
            rs = [layer.residual for layer in layers]
            block = min(rs) if rs and min(rs) > 0 else 32
            if not decode_view and any(layer.flush == "sliding" for layer in layers):
                block = 1
        elif cfg.kind in ("quanto", "hqq"):
            block = int(cfg.params.get("residual_length", 128))
        first = block - prefix % block
    else:
        block = first = chunk
    sizes, done = [], 0
    step = first
    while done < score:
        sizes.append(min(step, score - done))
        done += sizes[-1]
        step = block
    return sizes


def token_elements(model_config: Any) -> int:
    cfg = model_config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_key_value_heads * head_dim


def score_window(model: Any, ids: Any, cfg: CacheConfig, prefix: int, score: int, *, backend: str,
                 shared: Any | None, chunk: int | None, reference: Any | None = None,
                 keep_logprobs: bool = False, attention: str = "dequant",
                 cache: Any | None = None) -> tuple[dict[str, Any], Any | None]:
    """NLL of ``score`` tokens after ``prefix`` for one configuration; ``ids`` is ``[1, prefix+score+1]``.

    With ``reference`` (the full-precision run's next-token log-probabilities, ``[score, vocab]``)
    the run also records ``kl``: the summed KL(fp || this cache) over the scored positions, a
    lower-variance measure of the same damage PPL sees. ``keep_logprobs`` returns this run's
    log-probabilities (to serve as the reference); otherwise the second item is ``None``.
    ``attention`` is the kvq caches' attention mode ("dequant" or "codes"); ``cache`` is a fresh
    cache built by the caller for ``cfg`` (``kvq tune``'s trial caches), else one is built here.
    """
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    import torch

    if cache is None:
        cache = build_cache(cfg, model.config, backend, attention=attention)
    decode_view = getattr(model.config, "_attn_implementation", None) == "kvq"
    t0 = time.perf_counter()
    kept = []
    with torch.no_grad():
        if shared is not None:
            populate(cache, shared)
        else:
            model(ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True)
        prefill_s = time.perf_counter() - t0
        if decode_view and cfg.kind in KVQ_KINDS:
            cache.chunks = "decode"  # scoring chunks see what token-by-token decoding sees
        nll, kl, pos = 0.0, 0.0, prefix
        t1 = time.perf_counter()
        for size in chunk_plan(cfg, cache, prefix, score, chunk, decode_view):
            logits = model(ids[:, pos:pos + size], **cache_kwargs(model, cache), use_cache=True).logits
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            target = ids[0, pos + 1:pos + size + 1]
            nll -= logp.gather(1, target[:, None]).sum().item()
            if reference is not None:
                ref = reference[pos - prefix:pos - prefix + size]
                kl += (ref.exp() * (ref - logp)).sum().item()
            if keep_logprobs:
                kept.append(logp)
            pos += size
        score_s = time.perf_counter() - t1
    after = stored(cache, token_elements(model.config))
    bpe = steady_bits(cache, cfg, prefix + score, token_elements(model.config))
    dyn = int(after["elements"] * model.dtype.itemsize)
    out = {
        "label": cfg.label, "nll": nll, "tokens": score, "ppl": math.exp(nll / score),
        "kl": kl if reference is not None else None,
        "prefill_s": round(prefill_s, 3), "score_s": round(score_s, 3), "tok_s": score / score_s if score_s else math.nan,
        "bits_per_element": bpe, "cache_bytes": int(after["bytes"]), "dynamic_bytes": int(dyn),
        "decoded_bytes": int(cache.memory_report()["decoded_bytes"]) if hasattr(cache, "memory_report") else 0,
    }
    return out, (torch.cat(kept) if keep_logprobs else None)


def window_starts(n_tokens: int, length: int, first: int, count: int, tuning: bool) -> list[int]:
    """Window indices: the first ``count`` when tuning, else ``count`` spread over [first, N)."""
    total = n_tokens // length
    if tuning:
        return list(range(min(count, first, total)))
    if first >= total:
        raise ValueError(f"the text has {total} windows of {length} tokens; --first-window {first} leaves none")
    avail = total - first
    count = min(count, avail)
    return sorted({first + (i * avail) // count for i in range(count)})


def summarize(runs: list[dict[str, Any]], configs: list[CacheConfig], fp_label: str | None) -> list[dict[str, Any]]:
    """Per configuration: PPL over all its windows (token-weighted), delta vs fp on the same windows."""
    by = {c.label: [r for r in runs if r["label"] == c.label] for c in configs}
    fp_runs = {r["window"]: r for r in by.get(fp_label, [])} if fp_label else {}
    rows = []
    for c in configs:
        rs = by[c.label]
        if not rs:
            continue
        nll, tok = sum(r["nll"] for r in rs), sum(r["tokens"] for r in rs)
        row = {
            "label": c.label, "bits": c.nominal_bits, "windows": len(rs), "ppl": math.exp(nll / tok),
            "bits_per_element": sum(r["bits_per_element"] for r in rs) / len(rs),
            "tok_s": sum(r["tokens"] for r in rs) / sum(r["score_s"] for r in rs),
            "cache_bytes": max(r["cache_bytes"] for r in rs), "dynamic_bytes": max(r["dynamic_bytes"] for r in rs),
        }
        common = [r for r in rs if r["window"] in fp_runs]
        if common:
            fp_nll = sum(fp_runs[r["window"]]["nll"] for r in common)
            fp_tok = sum(fp_runs[r["window"]]["tokens"] for r in common)
            fp_ppl = math.exp(fp_nll / fp_tok)
            row["fp_ppl"] = fp_ppl
            row["delta_pct"] = 100.0 * (math.exp(sum(r["nll"] for r in common) / sum(r["tokens"] for r in common)) / fp_ppl - 1)
        with_kl = [r for r in rs if r.get("kl") is not None]
        if with_kl:
            row["kl"] = sum(r["kl"] for r in with_kl) / sum(r["tokens"] for r in with_kl)
        if c.group:
            row["group"] = c.group
        rows.append(row)
    return rows


def summarize_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per seed group (``--seeds``): mean, spread and per-seed Δ vs fp and KL over its rotation seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("group") and r.get("delta_pct") is not None:
            groups.setdefault(r["group"], []).append(r)
    out = []
    for name, rs in groups.items():
        deltas = [r["delta_pct"] for r in rs]
        mean = sum(deltas) / len(deltas)
        sd = math.sqrt(sum((d - mean) ** 2 for d in deltas) / (len(deltas) - 1)) if len(deltas) > 1 else math.nan
        kls = [r["kl"] for r in rs if r.get("kl") is not None]
        out.append({
            "group": name, "bits": rs[0]["bits"], "seeds": len(rs), "windows": min(r["windows"] for r in rs),
            "bits_per_element": sum(r["bits_per_element"] for r in rs) / len(rs),
            "delta_mean": mean, "delta_sd": sd, "delta_min": min(deltas), "delta_max": max(deltas),
            "deltas": deltas, "kl_mean": sum(kls) / len(kls) if kls else None,
        })
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq eval ppl", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    add_common_args(p, methods=list(DEFAULT_METHODS), text_help="text to score", out=OUT_NAME)
    p.add_argument("--prefix", type=int, default=1536, help="tokens prefilled through the cache (default 1536)")
    p.add_argument("--score", type=int, default=512, help="tokens scored after the prefix (default 512)")
    p.add_argument("--chunk", type=int, default=None, help="teacher-forced chunk size (default: each cache's flush block)")
    p.add_argument("--windows", type=int, default=4, help="number of windows (default 4)")
    p.add_argument("--first-window", type=int, default=8, help="windows before this index are kept for tuning (default 8)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, metavar="S",
                   help="run every kvq configuration with a rotation seed once per seed (label@seedS) and report "
                        "the mean and spread over seeds")
    p.add_argument("--tuning", action="store_true", help="run on the tuning windows (the first --windows) instead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    from kvq_core.tools.eval.model import load_model
    from kvq_core.tools.eval.text import load_text, text_part

    configs = expand_seeds([parse_config(m) for m in args.methods], args.seeds)
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"duplicate configuration labels: {labels}")
    fp_cfg = next((c for c in configs if c.kind == "fp"), None)
    fp_label = fp_cfg.label if fp_cfg else None
    if fp_cfg is not None:  # the fp run goes first in every window: it is the KL reference
        configs = [fp_cfg] + [c for c in configs if c is not fp_cfg]
    # the kvq attention function falls back to sdpa for everything but kvq caches' multi-token
    # sliding steps; --attn kvq also makes kvq caches attend from their codes
    attention = "codes" if args.attn == "kvq" else "dequant"
    text, source = text_part(*load_text(args.text_file, args.dataset), args.text_part)  # before the model: a missing text fails fast
    model, tok, info = load_model(args.model, attn_implementation=args.attn or "kvq", threads=args.threads)
    ids_all = tok(text, return_tensors="pt").input_ids
    length = args.prefix + args.score + 1
    windows = window_starts(ids_all.shape[1], length, args.first_window, args.windows, args.tuning)
    out = Path(args.out)
    data: dict[str, Any] = {
        "kind": "ppl", "model": info, "text": source, "text_tokens": int(ids_all.shape[1]),
        "protocol": {"prefix": args.prefix, "score": args.score, "chunk": args.chunk or "flush block",
                     "shared_prefill": not args.no_shared_prefill, "attn": args.attn or "sdpa (kvq function for sliding chunks)",
                     "window_tokens": length, "windows": windows, "tuning": args.tuning, "backend": args.backend,
                     "seeds": args.seeds},
        "configs": [c.describe() for c in configs], "fp_label": fp_label, "runs": [],
    }
    if args.resume and out.exists():
        old = json.loads(out.read_text())
        data["runs"] = [r for r in old.get("runs", []) if r["label"] in labels and r["window"] in windows]
    done = {(r["label"], r["window"]) for r in data["runs"]}
    bar = tqdm(total=len(windows) * len(configs), desc="ppl", disable=args.quiet, initial=len(done))

    def record(run: dict[str, Any], w: int) -> None:
        run["window"] = w
        data["runs"].append(run)
        data["summary"] = summarize(data["runs"], configs, fp_label)
        data["groups"] = summarize_groups(data["summary"])
        _write_json(out, data)
        bar.update(1)
        if not args.quiet:
            kl = "" if run.get("kl") is None else f"  KL {1e3 * run['kl'] / run['tokens']:.2f}e-3"
            tqdm.write(f"window {w} {run['label']:32s} ppl {run['ppl']:.3f}{kl}  bits/elt "
                       f"{run['bits_per_element']:.2f}  {run['tok_s']:.1f} tok/s")

    for w in windows:
        ids = ids_all[:, w * length:(w + 1) * length]
        todo = [c for c in configs if (c.label, w) not in done]
        if not todo:
            continue
        shared = None
        if not args.no_shared_prefill:
            from transformers import DynamicCache

            bar.set_postfix_str(f"window {w}: prefill")
            t0 = time.perf_counter()
            shared = DynamicCache(config=model.config)
            with torch.no_grad():
                model(ids[:, :args.prefix], **cache_kwargs(model, shared), use_cache=True)
            data.setdefault("prefill_seconds", {})[str(w)] = round(time.perf_counter() - t0, 2)
        reference = None
        if fp_cfg is not None:  # rerun on --resume when only later configurations are missing
            bar.set_postfix_str(f"window {w}: {fp_label}")
            run, reference = score_window(model, ids, fp_cfg, args.prefix, args.score, backend=args.backend,
                                          shared=shared, chunk=args.chunk, keep_logprobs=True, attention=attention)
            if fp_cfg in todo:
                record(run, w)
        for c in todo:
            if c is fp_cfg:
                continue
            bar.set_postfix_str(f"window {w}: {c.label}")
            run, _ = score_window(model, ids, c, args.prefix, args.score, backend=args.backend, shared=shared,
                                  chunk=args.chunk, reference=reference, attention=attention)
            record(run, w)
    bar.close()
    data["summary"] = summarize(data["runs"], configs, fp_label)
    data["groups"] = summarize_groups(data["summary"])
    _write_json(out, data)
    if not args.no_report:
        from kvq_core.tools.eval.report import write_ppl_report

        write_ppl_report(data, out)
    from kvq_core.tools.eval.report import format_group_table, format_ppl_table

    print(format_ppl_table(data["summary"]))
    if data["groups"]:
        print()
        print(format_group_table(data["groups"]))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
