"""``kvq eval niah``: needle-in-a-haystack recall through the real cache.

Tasks:

- ``passkey``: one needle "The pass key is N. Remember it. N is the pass key." in the haystack;
  asked "What is the pass key? The pass key is";
- ``multikey``: several needles "The special magic number for WORD is N. Remember it. N is the
  special magic number for WORD." (``--keys``, default 3; the passkey needle's form, so the two
  tasks differ only by the distractors; ``--multikey-form single`` keeps only the first sentence),
  one of them (the target, at the swept depth) asked for; the others sit at random depths.

Per cell (task, context length, target depth, trial) the prompt is instructions + haystack with
the needles + question, ``context`` tokens in all. Everything before the question is prefilled
through the cache (prefill attention is full precision; the cache then holds the haystack
quantized); the question is fed as one chunk attending to the cache, and the answer is decoded
greedily. Correct when the first number in the answer equals the needle's. The prefix forward
is shared by all configurations (its K/V are written into each cache as a prefill would).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path
from typing import Any

from kvq_core.tools.eval.args import add_common_args
from kvq_core.tools.eval.caches import build_cache, parse_config, populate
from kvq_core.tools.eval.ppl import BEST, _write_json

OUT_NAME = "eval_niah.json"  # in kvq_core.tools.results.results_dir() unless --out says otherwise
# the PPL set minus the near-lossless and rate-matched rows (recall is costly on 2 CPU cores)
DEFAULT_METHODS = (
    "fp", "quanto:nbits=2", "oscar:bits=4", "oscar:bits=3", "oscar:bits=2", "kivi:bits=2",
    "octopus:bits=4", "octopus:bits=3", "octopus:bits=2", "turboquant:bits=3,residual=32",
    "turboquant:bits=2,residual=32", BEST,
)
INTRO = ("There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WORDS = ("apple", "river", "violin", "tiger", "candle", "harbor", "pepper", "meadow", "rocket", "saddle",
         "lantern", "orchid", "falcon", "marble", "copper", "glacier", "walnut", "puzzle", "anchor", "velvet")


MULTIKEY_FORMS = ("repeat", "single")


def _needles(task: str, rng: random.Random, keys: int, form: str = "repeat") -> tuple[list[str], str, str]:
    """``(needle sentences (target first), question, answer)``."""
    if task == "passkey":
        n = str(rng.randint(10000, 99999))
        return [f"The pass key is {n}. Remember it. {n} is the pass key."], "What is the pass key? The pass key is", n
    if task == "multikey":
        if form not in MULTIKEY_FORMS:
            raise ValueError(f"unknown multikey needle form {form!r}; expected one of {MULTIKEY_FORMS}")
        words = rng.sample(WORDS, keys)
        nums = [str(rng.randint(10000, 99999)) for _ in words]
        needles = [f"The special magic number for {w} is {n}." for w, n in zip(words, nums)]
        if form == "repeat":
            needles = [f"{s} Remember it. {n} is the special magic number for {w}."
                       for s, w, n in zip(needles, words, nums)]
        return needles, f"What is the special magic number for {words[0]}? The special magic number for {words[0]} is", nums[0]
    raise ValueError(f"unknown task {task!r}; expected passkey or multikey")


class PromptBuilder:
    """Token-level prompt assembly: haystack tokens cut to length, needles at sentence boundaries."""

    def __init__(self, tok: Any, haystack: str, text: str | None) -> None:
        self.tok = tok
        if haystack == "filler":
            hay = FILLER * 800
        else:
            if not text:
                raise ValueError("the wikitext haystack needs the text file")
            hay = text
        self.hay_ids = tok(hay, add_special_tokens=False).input_ids
        self.intro = tok(INTRO, add_special_tokens=False).input_ids
        bos = tok.bos_token_id
        self.bos = [bos] if bos is not None and tok("a").input_ids[:1] == [bos] else []
        self.ends = [i + 1 for i, t in enumerate(self.hay_ids[:200000]) if "." in tok.decode([t])]

    def encode(self, s: str) -> list[int]:
        return self.tok(s, add_special_tokens=False).input_ids

    def build(self, task: str, context: int, depth: float, rng: random.Random, keys: int, offset: int,
              form: str = "repeat") -> tuple[list[int], list[int], str]:
        """``(prefix ids, question ids, answer)`` with ``len(prefix) + len(question) == context``."""
        needles, question, answer = _needles(task, rng, keys, form)
        q_ids = self.encode("\n\n" + question)
        n_ids = [self.encode(" " + s + " ") for s in needles]
        budget = context - len(self.bos) - len(self.intro) - len(q_ids) - sum(map(len, n_ids))
        if budget <= 0:
            raise ValueError(f"context {context} is too short for the prompt")
        start = min(self.ends, key=lambda e: abs(e - offset)) if offset else 0
        hay = self.hay_ids[start:start + budget]
        if len(hay) < budget:
            raise ValueError("the haystack text is too short for this context")
        ends = [e - start for e in self.ends if start < e <= start + budget]
        ends = ends or [budget]

        def snap(frac: float) -> int:
            target = round(frac * budget)
            return 0 if frac <= 0 else min(ends, key=lambda e: abs(e - target))

        depths = [depth] + [rng.random() for _ in needles[1:]]
        spots = sorted(zip([snap(d) for d in depths], range(len(needles))))
        out, prev = [], 0
        for pos, idx in spots:
            out += hay[prev:pos] + n_ids[idx]
            prev = pos
        out += hay[prev:]
        return self.bos + self.intro + out, q_ids, answer


def answer_ok(text: str, answer: str) -> bool:
    m = re.search(r"\d+", text)
    return bool(m) and m.group(0) == answer


def run_cell(model: Any, tok: Any, prefix: list[int], question: list[int], cfg: Any, shared: Any, backend: str,
             answer_tokens: int, attention: str = "dequant") -> tuple[str, float]:
    """Greedy answer of one configuration (``attention``: a kvq cache's mode); returns (answer text, seconds)."""
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    import torch

    cache = build_cache(cfg, model.config, backend, attention=attention)
    t0 = time.perf_counter()
    with torch.no_grad():
        if shared is not None:
            populate(cache, shared)
        else:
            model(torch.tensor([prefix]), **cache_kwargs(model, cache), use_cache=True)
        logits = model(torch.tensor([question]), **cache_kwargs(model, cache), use_cache=True).logits
        out = [int(logits[0, -1].argmax())]
        for _ in range(answer_tokens - 1):
            if out[-1] == tok.eos_token_id:
                break
            logits = model(torch.tensor([[out[-1]]]), **cache_kwargs(model, cache), use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
    return tok.decode(out, skip_special_tokens=True), time.perf_counter() - t0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq eval niah", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    add_common_args(p, methods=list(DEFAULT_METHODS), text_help="haystack text for --haystack wikitext", out=OUT_NAME)
    p.add_argument("--haystack", choices=("wikitext", "filler"), default="wikitext",
                   help="haystack: the text file (default) or the classic repeated filler")
    p.add_argument("--tasks", nargs="+", default=["passkey", "multikey"], choices=("passkey", "multikey"))
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=1, help="prompts per (task, context, depth) (default 1)")
    p.add_argument("--keys", type=int, default=3, help="needles in a multikey prompt (default 3)")
    p.add_argument("--multikey-form", choices=MULTIKEY_FORMS, default="repeat",
                   help="multikey needle: stated twice like the passkey (default) or one sentence")
    p.add_argument("--answer-tokens", type=int, default=8, help="greedy answer tokens (default 8)")
    p.add_argument("--seed", type=int, default=1234, help="prompt seed (default 1234)")
    return p


def main(argv: list[str] | None = None) -> int:
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    args = build_parser().parse_args(argv)
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from kvq_core.tools.eval.model import load_model
    from kvq_core.tools.eval.text import load_text, text_part

    configs = [parse_config(m) for m in args.methods]
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"duplicate configuration labels: {labels}")
    text, source = (text_part(*load_text(args.text_file, args.dataset), args.text_part) if args.haystack == "wikitext" else (None, "filler"))
    model, tok, info = load_model(args.model, attn_implementation=args.attn, threads=args.threads)
    builder = PromptBuilder(tok, args.haystack, text)
    out = Path(args.out)
    data: dict[str, Any] = {
        "kind": "niah", "model": info,
        "protocol": {"tasks": args.tasks, "contexts": args.contexts, "depths": args.depths, "trials": args.trials,
                     "keys": args.keys, "multikey_form": args.multikey_form, "haystack": args.haystack if args.haystack == "filler" else source,
                     "answer_tokens": args.answer_tokens, "seed": args.seed, "backend": args.backend,
                     "shared_prefill": not args.no_shared_prefill, "attn": args.attn or model.config._attn_implementation},
        "configs": [c.describe() for c in configs], "runs": [],
    }
    if args.resume and out.exists():
        data["runs"] = [r for r in json.loads(out.read_text()).get("runs", []) if r["label"] in labels]
    done = {(r["label"], r["task"], r["context"], r["depth"], r["trial"]) for r in data["runs"]}
    cells = [(t, c, d, k) for t in args.tasks for c in args.contexts for d in args.depths for k in range(args.trials)]
    bar = tqdm(total=len(cells) * len(configs), desc="niah", disable=args.quiet, initial=len(done))
    for task, context, depth, trial in cells:
        todo = [c for c in configs if (c.label, task, context, depth, trial) not in done]
        if not todo:
            continue
        rng = random.Random(f"{args.seed}-{task}-{context}-{depth}-{trial}")
        offset = 0 if args.haystack == "filler" else rng.randrange(0, max(1, len(builder.hay_ids) - context - 10))
        prefix, question, answer = builder.build(task, context, depth, rng, args.keys, offset, args.multikey_form)
        shared = None
        if not args.no_shared_prefill:
            bar.set_postfix_str(f"{task} {context} d={depth}: prefill")
            shared = DynamicCache(config=model.config)
            with torch.no_grad():
                model(torch.tensor([prefix]), **cache_kwargs(model, shared), use_cache=True)
        for c in todo:
            bar.set_postfix_str(f"{task} {context} d={depth}: {c.label}")
            reply, secs = run_cell(model, tok, prefix, question, c, shared, args.backend, args.answer_tokens,
                                   "codes" if args.attn == "kvq" else "dequant")
            data["runs"].append({"label": c.label, "task": task, "context": context, "depth": depth, "trial": trial,
                                 "answer": answer, "reply": reply, "correct": answer_ok(reply, answer),
                                 "seconds": round(secs, 2)})
            _write_json(out, data)
            bar.update(1)
    bar.close()
    _write_json(out, data)
    from kvq_core.tools.eval.report import format_niah_table, write_niah_report

    if not args.no_report:
        write_niah_report(data, out)
    print(format_niah_table(data))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
