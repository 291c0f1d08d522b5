"""Evaluation text: WikiText-2 (raw) test split from ``shared/data`` by default, any text file,
or a ``datasets`` name (``name[:config[:split]]``) where a network is available."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_FILE = "wikitext2-test.txt"
ENV = "KVQ_EVAL_TEXT"


def default_text_path() -> Path | None:
    """``$KVQ_EVAL_TEXT``, else ``shared/data/wikitext2-test.txt`` next to an ancestor of the
    working directory or of this package (the repo sits beside ``shared/``)."""
    env = os.environ.get(ENV)
    if env and Path(env).is_file():
        return Path(env)
    starts = [Path.cwd().resolve(), Path(__file__).resolve().parent]
    for start in starts:
        for base in (start, *start.parents):
            cand = base / "shared" / "data" / DEFAULT_FILE
            if cand.is_file():
                return cand
    return None


def load_text(text_file: str | None = None, dataset: str | None = None) -> tuple[str, str]:
    """``(text, source)``: a file's text, a ``datasets`` split joined by newlines, or the default."""
    if text_file and dataset:
        raise ValueError("give --text-file or --dataset, not both")
    if dataset:
        from datasets import load_dataset  # needs the datasets package and a network

        name, config, split = (dataset.split(":") + [None, None])[:3]
        ds = load_dataset(name, config, split=split or "test")
        column = "text" if "text" in ds.column_names else ds.column_names[0]
        return "\n".join(ds[column]), f"datasets:{dataset}"
    path = Path(text_file) if text_file else default_text_path()
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"text file {text_file or DEFAULT_FILE} not found; pass --text-file, set ${ENV}, or run from the repo "
            "next to shared/data"
        )
    return path.read_text(encoding="utf-8"), str(path)
