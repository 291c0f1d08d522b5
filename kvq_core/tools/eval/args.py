"""Command-line options shared by ``kvq eval ppl`` and ``kvq eval niah``."""
from __future__ import annotations

import argparse

from kvq_core.tools.eval.text import TEXT_PARTS
from kvq_core.tools.results import out_help, results_dir


def add_common_args(p: argparse.ArgumentParser, *, methods: list[str], text_help: str, out: str) -> None:
    """Model, text, cache configurations, backend, attention, threads and the results file (``out``:
    its name in :func:`kvq_core.tools.results.results_dir`)."""
    p.add_argument("--model", help="a .gguf file, a checkpoint directory or a hub name (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--text-file", help=f"{text_help} (default: shared/data/wikitext2-test.txt)")
    p.add_argument("--dataset", help="a datasets name[:config[:split]] instead of a file (needs a network)")
    p.add_argument("--text-part", choices=TEXT_PARTS, default="all",
                   help="read all of the text, or only its calibration (first) or evaluation (second) part: cut at "
                        "the article heading after the middle, what kvq tune calibrates on (default all)")
    p.add_argument("--methods", nargs="+", default=methods, metavar="CFG",
                   help="cache configurations METHOD[:k=v,...] (see kvq_core.tools.eval.caches); 'fp' is DynamicCache")
    p.add_argument("--backend", default="auto", help="kvq backend for kvq methods (default auto)")
    p.add_argument("--no-shared-prefill", action="store_true", help="run the prefix forward once per configuration")
    p.add_argument("--attn", default=None, help="attention implementation; 'kvq' makes kvq caches attend from their codes (ppl default: the kvq function with dequant-mode caches, i.e. sdpa numerics plus decode-equivalent chunks for sliding caches)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    default = str(results_dir() / out)
    p.add_argument("--out", default=default, help=out_help("results JSON, .md/.png and eval_summary.md beside it", default))
    p.add_argument("--resume", action="store_true", help="keep runs already in --out and skip them")
    p.add_argument("--no-report", action="store_true", help="skip the Markdown/PNG report")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
