"""Evaluation text: WikiText-2 (raw) test split, any text file, or a ``datasets`` name
(``name[:config[:split]]``).

WikiText-2 is looked for in ``$KVQ_EVAL_TEXT``, in ``shared/data`` beside an ancestor of the
working directory or of this package (a checkout of the repo), and in kvq's cache; where none
is found (e.g. after ``pip install "kvq-core[hf]"``) it is loaded once through ``datasets`` and
written to the cache, so later runs need neither the network nor ``datasets``.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_FILE = "wikitext2-test.txt"
ENV = "KVQ_EVAL_TEXT"
CACHE_ENV = "KVQ_CACHE_DIR"
#: The hub dataset (the canonical ``wikitext`` repository), config and split of the default text.
WIKITEXT = ("Salesforce/wikitext", "wikitext-2-raw-v1", "test")
#: sha256 of the split's rows joined by blank lines (the convention of GPTQ and most KV-cache
#: papers), which is also ``shared/data/wikitext2-test.txt``: 1,296,370 bytes.
WIKITEXT_SHA256 = "696cca6b65a171b0a358a4be6732cdfdf2dd6164a32e20fd70e3c13fc4dfae83"


def cache_dir() -> Path:
    """``$KVQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvq``, else ``~/.cache/kvq``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvq"


def default_text_path() -> Path | None:
    """``$KVQ_EVAL_TEXT``, else ``shared/data/wikitext2-test.txt`` next to an ancestor of the
    working directory or of this package (the repo sits beside ``shared/``), else the copy in
    :func:`cache_dir`; None when there is none."""
    env = os.environ.get(ENV)
    if env and Path(env).is_file():
        return Path(env)
    starts = [Path.cwd().resolve(), Path(__file__).resolve().parent]
    for start in starts:
        for base in (start, *start.parents):
            cand = base / "shared" / "data" / DEFAULT_FILE
            if cand.is_file():
                return cand
    cached = cache_dir() / DEFAULT_FILE
    return cached if cached.is_file() else None


def _offline_help() -> str:
    return (f"pass --text-file PATH (a UTF-8 text file, e.g. the WikiText-2 raw test split), or set ${ENV}=PATH, "
            f"or put {DEFAULT_FILE} in {cache_dir()} (${CACHE_ENV})")


#: Seconds the hub reachability probe waits (name lookup and TCP connect) before giving up.
PROBE_SECONDS = 3.0
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARS)


def hub_unreachable(timeout: float = PROBE_SECONDS) -> str | None:
    """Why the Hugging Face hub (``$HF_ENDPOINT``, default huggingface.co) cannot be reached, or
    None when a TCP connection opens within ``timeout`` seconds (or a proxy is configured, which
    this probe cannot see through). Asked before ``datasets``, whose retries take half a minute
    to fail on a machine without a network."""
    if any(os.environ.get(v) for v in PROXY_VARS):
        return None
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)

    def connect() -> None:
        socket.create_connection((host, port), timeout=timeout).close()

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # name lookups have no timeout of their own
    try:
        pool.submit(connect).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return f"no answer from {host}:{port} within {timeout:g} s"
    except OSError as exc:
        return f"cannot reach {host}:{port} ({type(exc).__name__}: {exc})"
    finally:
        pool.shutdown(wait=False)
    return None


def download_wikitext() -> Path:
    """Load WikiText-2 (raw, test) through ``datasets`` (its download progress bars on
    stderr), write it to :func:`cache_dir` and return that path. Raises FileNotFoundError
    naming the file or flag to pass when ``datasets`` is missing or the hub is unreachable."""
    name, config, split = WIKITEXT
    try:
        from datasets import load_dataset
    except ImportError as exc:
        raise FileNotFoundError(
            f"WikiText-2 ({DEFAULT_FILE}) was not found locally and the datasets package is not installed "
            f"(pip install 'kvq-core[hf]' to download it once); or {_offline_help()}") from exc
    offline = _offline()
    unreachable = None if offline else hub_unreachable()
    if unreachable:  # fail now, with the fix, instead of after the hub client's retries
        raise FileNotFoundError(f"WikiText-2 ({DEFAULT_FILE}) was not found locally and the hub is unreachable: "
                                f"{unreachable}; {_offline_help()}")
    print(f"kvq: {DEFAULT_FILE} not found locally; loading {name} {config} ({split}) through datasets",
          file=sys.stderr)
    try:
        ds = load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - offline, hub unreachable, dataset moved: all end here
        why = "offline mode is on (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) and it is not cached" if offline else \
            f"{type(exc).__name__}: {exc}"
        raise FileNotFoundError(f"could not load WikiText-2 through datasets ({name} {config} {split}): {why}; "
                                f"{_offline_help()}") from exc
    text = "\n\n".join(ds["text"])
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != WIKITEXT_SHA256:
        print(f"kvq: warning: {name} {config} {split} has sha256 {digest}, not the {WIKITEXT_SHA256} "
              f"results in this repo were measured on", file=sys.stderr)
    path = cache_dir() / DEFAULT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    print(f"kvq: cached WikiText-2 at {path}", file=sys.stderr)
    return path


def load_text(text_file: str | None = None, dataset: str | None = None) -> tuple[str, str]:
    """``(text, source)``: a file's text, a ``datasets`` split joined by newlines, or WikiText-2
    (found locally or downloaded once, see the module docstring)."""
    if text_file and dataset:
        raise ValueError("give --text-file or --dataset, not both")
    if dataset:
        from datasets import load_dataset  # needs the datasets package and a network

        name, config, split = (dataset.split(":") + [None, None])[:3]
        ds = load_dataset(name, config, split=split or "test")
        column = "text" if "text" in ds.column_names else ds.column_names[0]
        return "\n".join(ds[column]), f"datasets:{dataset}"
    if text_file:
        path = Path(text_file)
        if not path.is_file():
            raise FileNotFoundError(f"--text-file {text_file}: no such file")
    else:
        path = default_text_path() or download_wikitext()
    return path.read_text(encoding="utf-8"), str(path)


#: Which part of a text a run reads (:func:`text_part`).
TEXT_PARTS = ("all", "calibration", "evaluation")
_ARTICLE = re.compile(r"\n = [^=\n][^\n]* = \n")  # a WikiText article heading, `` = Title = ``


def split_text(text: str) -> tuple[str, str]:
    """(first part, second part): cut at the first article heading (`` = Title = ``) after the
    middle (the middle itself where there is none), so the two parts share no article."""
    m = _ARTICLE.search(text, len(text) // 2)
    cut = m.start() + 1 if m else len(text) // 2
    return text[:cut], text[cut:]


def text_part(text: str, source: str, part: str) -> tuple[str, str]:
    """``(text, source)`` of ``part``: "all", "calibration" (the first part of :func:`split_text`,
    what ``kvq tune`` reads by default) or "evaluation" (the second part, disjoint from it)."""
    if part not in TEXT_PARTS:
        raise ValueError(f"text part {part!r}; expected one of {TEXT_PARTS}")
    if part == "all":
        return text, source
    first, second = split_text(text)
    chosen, (a, b) = (first, (0, len(first))) if part == "calibration" else (second, (len(first), len(text)))
    return chosen, f"{source} [{part} part: characters {a}-{b}, cut at the article heading after the middle]"
