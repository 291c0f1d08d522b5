"""``kvq bench decode``: greedy decode tokens/s of SmolLM2 through DynamicCache, kvq and quanto caches.

For each prompt length (default 2,048 and 8,192 tokens of WikiText-2) and each cache
configuration (default: ``DynamicCache``; kvq OScaR INT2 with the block flush and its 128-token
window; kvq OCTOPUS b=3 with the sliding flush, its default stride (8) and stride 1; kvq TurboQuant b=3 and,
beside it, the PyPI ``turboquant`` package's cache at 3 bits; transformers' ``QuantizedCache`` with
the quanto backend at int4), in one run:

1. the prompt is prefilled through the cache (``prefill_s``, not part of the decode rate; for
   kvq caches it includes encoding the prompt, and the first encode call of a run may load or
   compile Numba kernels). The prefill attends with the implementation the decode steps use
   (``"kvq"`` for kvq caches), which hands a step whose K/V are all exact to sdpa;
2. two untimed greedy steps (the first one's time is ``first_step_s``: the first attend from
   codes happens there; the second is a sliding stride's first decode of a block encoded ahead);
3. ``--repeats`` timed segments of ``--new`` greedy steps, run round-robin over the
   configurations so that load drift on a shared machine hits all alike; tokens/s is the median
   segment, and ``ratio`` is that over DynamicCache's for the same prompt in the same run;
4. one instrumented segment of ``--profile-steps`` steps that splits the step time into parts
   (milliseconds per step, parts disjoint and summing to the step time):

   - ``encode``: ``Quantizer.encode_keys``/``encode_values`` of flushed tokens (kvq), quanto's
     ``_quantize`` (QuantizedCache re-quantizes its whole history every ``residual_length`` steps);
   - ``cache``: the rest of ``cache.update`` (window bookkeeping, concatenation, block joins,
     decoding: kvq's ``decode_*`` of a block encoded ahead, quanto's ``_dequantize`` of the history);
   - ``attention``: the attention function (kvq's ``"kvq"`` function for kvq caches, transformers'
     ``"sdpa"`` otherwise); ``codes`` is the part of it spent in ``Quantizer.attend_window``
     (the packed blocks and the exact window in one call, where the backend fuses them) or
     ``Quantizer.attend`` over the packed blocks; the remainder is glue (and, unfused, the
     exact window and the log-sum-exp merge);
   - ``other``: everything else (projections, MLP, norms, logits, Python).

   The instrumentation wraps those functions only for this segment, so it does not slow the
   timed segments. ``decode`` (inside ``cache`` or ``attention``) is reported beside them;
5. ``--contended-repeats`` more segments per cache (default 1; 0: none) at the *default* thread
   settings (torch's and Numba's thread counts as the process started) while a second process
   spins on one core: a shared machine as users have it (tokens/s and ratio to DynamicCache in
   the same conditions, beside the ``--threads`` figures).

kvq caches run with the model's attention implementation set to ``"kvq"`` (decode attends from
codes) and ``backend="auto"`` (the Numba backend on CPU where it serves the spec; the backend each
layer's quantizer uses is printed and stored); DynamicCache and QuantizedCache run with
``"sdpa"``. Also reported: KV bytes held at the end vs DynamicCache at the same length, and how
many of the generated greedy tokens equal DynamicCache's (position by position, and the first
position that differs). Results: ``decode.json``, ``decode.md`` and ``decode.png`` (step time
by part) at ``--out``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kvq_core.tools.eval.caches import KVQ_KINDS, CacheConfig, build_cache, parse_config, stored
from kvq_core.tools.progress import progress
from kvq_core.tools.results import out_help, results_dir

#: the reference every run includes: transformers' DynamicCache
REFERENCE = "dynamic:label=dynamic"
DEFAULT_CONFIGS = (
    REFERENCE,
    "oscar:bits=2,label=oscar-int2",
    "octopus:bits=3,label=octopus-b3",
    "octopus:bits=3,stride=1,label=octopus-b3-stride1",
    "turboquant:bits=3,label=turboquant-b3",
    "pypi-turboquant:bits=3,label=pypi-turboquant-3",
    "quanto:nbits=4,label=quanto-int4",
)
PROMPTS = (2048, 8192)
QUICK = {"prompts": [160], "new": 4, "repeats": 1, "profile_steps": 4, "contended_repeats": 0}
#: untimed steps after the prefill: the first is reported (first attend from codes; Numba kernels
#: compile or load from their disk cache), the second is a sliding stride's first decode of a block
#: encoded ahead
WARMUP_STEPS = 2
#: parts of a step, disjoint, in table order
PARTS = ("encode", "cache", "attention", "other")


@dataclass
class Run:
    """One (configuration, prompt) run: its cache, the greedy tokens so far and its results."""

    cfg: CacheConfig
    prompt: int
    cache: Any = None
    tok: Any = None
    tokens: list[int] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    contended: list[float] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.row.get("status") == "ok"


class StepProfile:
    """Inclusive wall time per key, from timers wrapped around methods for one pass (see
    :func:`instrument`); :meth:`restore` removes every wrapper."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []
        self._done: set[tuple[int, str]] = set()

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - t0

        return timed

    def wrap(self, obj: Any, name: str, key: str) -> None:
        """Time ``obj.name`` (a bound method) under ``key`` through an instance attribute; once per object."""
        if (id(obj), name) in self._done:
            return
        self._done.add((id(obj), name))
        had, old = name in vars(obj), vars(obj).get(name)
        setattr(obj, name, self._timed(getattr(obj, name), key))
        self._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def wrap_attention(self, impl: str, key: str) -> None:
        """Time transformers' attention function ``impl`` (a local override in ALL_ATTENTION_FUNCTIONS)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns

        local = fns._local_mapping
        had, old = impl in local, local.get(impl)
        fns[impl] = self._timed(fns[impl], key)
        self._undo.append(lambda: local.__setitem__(impl, old) if had else local.pop(impl))

    def restore(self) -> None:
        """Remove every wrapper, newest first."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._done.clear()


@contextmanager
def instrument(cache: Any, impl: str) -> Iterator[StepProfile]:
    """Timers on ``cache.update``, the attention function and, inside them, the codec calls:
    kvq quantizers' encode/decode/attend, quanto layers' ``_quantize``/``_dequantize``."""
    from kvq_core.integrations.hf.cache import KVQLayer

    prof = StepProfile()
    try:
        prof.wrap(cache, "update", "update")
        prof.wrap_attention(impl, "attention")
        for layer in cache.layers:
            if isinstance(layer, KVQLayer) and layer.kq is not None:
                for name, key in (("encode_keys", "encode"), ("decode_keys", "decode"), ("attend", "codes"),
                                  ("attend_window", "codes")):
                    prof.wrap(layer.kq, name, key)
                for name, key in (("encode_values", "encode"), ("decode_values", "decode")):
                    prof.wrap(layer.vq, name, key)
            elif hasattr(layer, "_quantize"):  # transformers QuantizedLayer
                prof.wrap(layer, "_quantize", "encode")
                prof.wrap(layer, "_dequantize", "decode")
        yield prof
    finally:
        prof.restore()


def breakdown(seconds: dict[str, float], step_total: float, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """``(parts, detail)`` in ms per step: the disjoint :data:`PARTS` summing to the step time,
    and ``decode``/``codes``/``step`` beside them."""
    per = 1e3 / steps
    enc, upd, att = seconds.get("encode", 0.0), seconds.get("update", 0.0), seconds.get("attention", 0.0)
    parts = {"encode": enc * per, "cache": max(upd - enc, 0.0) * per, "attention": att * per,
             "other": max(step_total - upd - att, 0.0) * per}
    detail = {"step": step_total * per, "decode": seconds.get("decode", 0.0) * per, "codes": seconds.get("codes", 0.0) * per}
    return parts, detail


def attn_impl(cfg: CacheConfig) -> str:
    """The model's attention implementation for ``cfg``: "kvq" (attend from codes) for kvq caches."""
    return "kvq" if cfg.kind in KVQ_KINDS else "sdpa"


def greedy_step(model: Any, tok: Any, cache: Any) -> Any:
    """One decode step: the next greedy token ``[batch, 1]``."""
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    return model(tok, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)


def start(run: Run, model: Any, ids: Any) -> None:
    """Build the cache, prefill the prompt and take the untimed warm-up steps; marks the run
    unavailable (with the reason) when the cache cannot be built or, for transformers'
    QuantizedCache, cannot run here."""
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    import torch

    cfg = run.cfg
    run.row = {"label": cfg.label, "config": cfg.describe(), "prompt": run.prompt, "status": "ok"}
    try:
        model.set_attn_implementation(attn_impl(cfg))  # what the cache's decode steps attend with
        run.cache = build_cache(cfg, model.config, attention="codes" if cfg.kind in KVQ_KINDS else "auto")
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = model(ids, **cache_kwargs(model, run.cache), use_cache=True, logits_to_keep=1).logits
            run.row["prefill_s"] = time.perf_counter() - t0
            run.tok = logits[:, -1].argmax(-1, keepdim=True)
            run.tokens.append(int(run.tok))
            for i in range(WARMUP_STEPS):
                t0 = time.perf_counter()
                run.tok = greedy_step(model, run.tok, run.cache)
                if i == 0:
                    run.row["first_step_s"] = time.perf_counter() - t0
                run.tokens.append(int(run.tok))
    except ImportError as exc:
        unavailable(run, exc)
        return
    except Exception as exc:  # noqa: BLE001 - a third-party cache that cannot run here is reported, not fatal
        if cfg.kind in KVQ_KINDS or cfg.kind == "fp":
            raise
        unavailable(run, exc)
        return
    run.row["backends"] = dict(Counter(layer.kq.backend for layer in getattr(run.cache, "kvq_layers", [])))
    if run.row["backends"]:
        print(f"\n{cfg.label} @ {run.prompt}: kvq backend "
              + ", ".join(f"{k} on {v} of {len(run.cache.layers)} layers" for k, v in run.row["backends"].items()),
              flush=True)


def unavailable(run: Run, exc: BaseException) -> None:
    """Mark ``run`` as not measurable here, with the reason (printed and kept in the table)."""
    run.row.update(status="unavailable", reason=f"{type(exc).__name__}: {exc}")
    run.cache = None
    print(f"\n{run.cfg.label} @ {run.prompt}: unavailable: {run.row['reason']}", flush=True)


def timed_segment(run: Run, model: Any, steps: int) -> None:
    """``steps`` greedy steps; their tokens/s into ``run.rates`` (nothing for an unavailable run)."""
    if run.ok:
        run.rates.append(steps / segment(run, model, steps))


def segment(run: Run, model: Any, steps: int) -> float:
    """Seconds for ``steps`` greedy steps (the tokens are kept)."""
    import torch

    model.set_attn_implementation(attn_impl(run.cfg))
    gc.collect()
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(steps):
            run.tok = greedy_step(model, run.tok, run.cache)
            run.tokens.append(int(run.tok))
        return time.perf_counter() - t0


def profile(run: Run, model: Any, steps: int) -> None:
    """The instrumented segment: per-step time by part into ``run.row`` (nothing for an unavailable run)."""
    import torch

    if not run.ok:
        return
    impl = attn_impl(run.cfg)
    model.set_attn_implementation(impl)
    gc.collect()
    total = 0.0
    with torch.no_grad(), instrument(run.cache, impl) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            run.tok = greedy_step(model, run.tok, run.cache)
            total += time.perf_counter() - t0
            run.tokens.append(int(run.tok))
    run.row["breakdown_ms"], run.row["detail_ms"] = breakdown(prof.seconds, total, steps)
    run.row["profile_steps"] = steps
    run.row["torch_threads"] = torch.get_num_threads()  # Numba's OpenMP layer can reset it when it starts


@contextmanager
def contended(threads: dict[str, int]) -> Iterator[None]:
    """Default thread settings (``threads``: torch's and Numba's counts at start) and a second
    process spinning on one core, both undone afterwards."""
    import subprocess

    import torch

    numba = sys.modules.get("numba")
    before = {"torch": torch.get_num_threads(), "numba": numba.get_num_threads() if numba else None}
    loader = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        if numba is not None and threads.get("numba"):
            numba.set_num_threads(threads["numba"])
        torch.set_num_threads(threads["torch"])  # after numba's: setting numba's can reset torch's
        yield
    finally:
        loader.kill()
        loader.wait()
        if numba is not None and before["numba"]:
            numba.set_num_threads(before["numba"])
        torch.set_num_threads(before["torch"])


def contended_segments(runs: list[Run], model: Any, steps: int, repeats: int, threads: dict[str, int]) -> None:
    """``repeats`` segments per run, round-robin, under :func:`contended`; tokens/s into ``run.contended``."""
    with contended(threads):
        for _ in range(repeats):
            for run in runs:
                if run.ok:
                    run.contended.append(steps / segment(run, model, steps))


def finish(runs: list[Run], token_elements: int, rows: list[dict[str, Any]]) -> None:
    """Rates, ratios to DynamicCache, KV bytes and matching tokens of one prompt's runs (the
    first is DynamicCache) into ``rows``; frees their caches."""
    ref = runs[0]  # DynamicCache, always first
    for run in runs:
        if not run.ok:
            continue
        run.row["tokens_per_s"] = statistics.median(run.rates)
        run.row["segment_tokens_per_s"] = list(run.rates)
        if run.contended:
            run.row["contended_tokens_per_s"] = statistics.median(run.contended)
        run.row["kv_bytes"] = int(stored(run.cache, token_elements)["bytes"])
        run.row["tokens_at_end"] = run.cache.get_seq_length()
        run.row["generated"] = len(run.tokens)
        run.cache = None
    for run in runs:
        if not run.ok:
            continue
        run.row["ratio"] = run.row["tokens_per_s"] / ref.row["tokens_per_s"]
        # segment i of every cache ran back to back (round-robin), so their ratio shares the machine's state;
        # on a machine whose speed drifts between segments it is steadier than the ratio of the medians
        pairs = [r / f for r, f in zip(run.rates, ref.rates)]
        run.row["segment_ratios"] = pairs
        run.row["segment_ratio_median"] = statistics.median(pairs)
        run.row["kv_bytes_vs_dynamic"] = run.row["kv_bytes"] / ref.row["kv_bytes"]
        if "contended_tokens_per_s" in run.row and "contended_tokens_per_s" in ref.row:
            run.row["contended_ratio"] = run.row["contended_tokens_per_s"] / ref.row["contended_tokens_per_s"]
        same = [a == b for a, b in zip(run.tokens, ref.tokens)]
        first_diff = next((i for i, s in enumerate(same) if not s), None)
        run.row["match"] = {"same": sum(same), "of": len(same), "first_diff": first_diff}
    rows += [run.row for run in runs]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _num(x: float | None, unit: str = "") -> str:
    return "-" if x is None else (f"{x:.2f}{unit}" if unit else f"{x:.1f}")


def _segments(r: dict[str, Any]) -> str:
    """A row's paired per-segment ratios as ``median (min-max)`` ("-" in results written before they were kept)."""
    pairs = r.get("segment_ratios")
    if not pairs:
        return "-"
    return f"{r['segment_ratio_median']:.2f}x ({min(pairs):.2f}-{max(pairs):.2f})"


def render_md(res: dict[str, Any]) -> str:
    """The Markdown report: a header on the machine and method, one table per prompt length."""
    m, a = res["machine"], res["args"]
    lines = ["# kvq bench decode", "",
             f"{res['model']['name']} (fp32, {res['model']['layers']} layers, {res['model']['kv_heads']} KV heads x "
             f"{res['model']['head_dim']}), greedy decode after a prompt from "
             f"{Path(res['text']).name}. Machine: {m['cpu']}, torch CPU "
             f"capability **{m['cpu_capability']}**, **{m['threads']} torch thread(s)**, torch {m['torch']}, "
             f"transformers {m['transformers']}, load average {m['load_start']} at start, {m['load_end']} at end. "
             f"tokens/s: median of {a['repeats']} segment(s) of {a['new']} steps, run round-robin over the caches; "
             f"ratio: to DynamicCache on the same prompt in this run (medians' ratio); *per segment*: the median "
             f"(min-max) of the {a['repeats']} paired ratios, each segment's tokens/s over DynamicCache's in the "
             "same round (steadier where the machine's speed drifts). Per-step ms by part (disjoint, summing to the "
             f"step): one instrumented segment of {a['profile_steps']} steps; *codes* is the share of attention spent "
             "in `Quantizer.attend_window` (blocks and exact window in one call) or `Quantizer.attend`, *decode* the codec decode inside cache or attention. Same tokens: greedy tokens "
             "equal to DynamicCache's, position by position (first difference in brackets)."
             + (f" *Contended*: median of {a['contended_repeats']} segment(s) at the default thread settings "
                f"(torch {m['default_threads']['torch']}, Numba {m['default_threads']['numba']} thread(s)) while a "
                "second process spins on one core." if a.get("contended_repeats") else ""), ""]
    drift = sorted({r["torch_threads"] for r in res["rows"] if r["status"] == "ok"} - {m["threads"]})
    if drift:
        lines += [f"**Warning:** torch ran with {drift} thread(s) by the end of some runs, not {m['threads']}.", ""]
    for prompt in a["prompts"]:
        lines += [f"## prompt {prompt} tokens", "",
                  "| cache | tokens/s | vs dynamic | per segment | contended tokens/s | vs dynamic | first step s | prefill s | step ms "
                  "| encode | cache | attention (codes) | other | decode | KV MB | vs dynamic | same tokens | backend |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in res["rows"]:
            if r["prompt"] != prompt:
                continue
            if r["status"] != "ok":
                reason = " ".join(r["reason"].split()).replace("|", "/")
                lines.append(f"| {r['label']} | {r['status']}: {reason} |" + " |" * 16)
                continue
            b, d, mt = r["breakdown_ms"], r["detail_ms"], r["match"]
            diff = "" if mt["first_diff"] is None else f" [{mt['first_diff']}]"
            backend = ", ".join(f"{k} x{v}" for k, v in r["backends"].items()) or "-"
            lines.append(
                f"| {r['label']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x | {_segments(r)} | "
                f"{_num(r.get('contended_tokens_per_s'))} | "
                f"{_num(r.get('contended_ratio'), 'x')} | {r['first_step_s']:.2f} | "
                f"{r['prefill_s']:.1f} | {_ms(d['step'])} | {_ms(b['encode'])} | {_ms(b['cache'])} | "
                f"{_ms(b['attention'])} ({_ms(d['codes'])}) | {_ms(b['other'])} | {_ms(d['decode'])} | "
                f"{r['kv_bytes'] / 1e6:.1f} | {r['kv_bytes_vs_dynamic']:.3f} | {mt['same']}/{mt['of']}{diff} | {backend} |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    """Stacked bars of the per-step time by part, one panel per prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = res["args"]["prompts"]
    fig, axes = plt.subplots(1, len(prompts), figsize=(6 * len(prompts), 4.5), squeeze=False)
    for ax, prompt in zip(axes[0], prompts):
        rows = [r for r in res["rows"] if r["prompt"] == prompt and r["status"] == "ok"]
        bottom = [0.0] * len(rows)
        for part in PARTS:
            vals = [r["breakdown_ms"][part] for r in rows]
            ax.bar([r["label"] for r in rows], vals, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, r in enumerate(rows):
            ax.text(i, bottom[i], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"prompt {prompt} tokens ({res['machine']['threads']} thread(s); label: tokens/s vs dynamic)")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("torch", "transformers", "numba", "optimum-quanto", "turboquant"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvq bench decode``."""
    p = argparse.ArgumentParser(prog="kvq bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, nargs="+", default=None, help=f"prompt lengths in tokens (default {PROMPTS})")
    p.add_argument("--new", type=int, default=None, help="greedy steps per timed segment (default 128: one OScaR block)")
    p.add_argument("--repeats", type=int, default=None, help="timed segments per cache and prompt (default 3)")
    p.add_argument("--profile-steps", type=int, default=None, help="steps of the instrumented segment (default 128)")
    p.add_argument("--threads", type=int, default=1, help="torch (and Numba) threads (default 1)")
    p.add_argument("--contended-repeats", type=int, default=None,
                   help="segments per cache at the default thread settings with a second process loading one core "
                        "(default 1, --quick 0; 0: none)")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="CFG",
                   help="caches as METHOD[:k=v,...] (kvq_core.tools.eval.caches): 'dynamic', 'quanto:nbits=4', any kvq "
                        "method with its parameters and residual/flush/stride; DynamicCache always runs as the reference")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny sizes for CI: prompt {QUICK['prompts'][0]}, {QUICK['new']} new tokens, 1 segment")
    p.add_argument("--model", help="a .gguf file or checkpoint directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--text-file", help="prompt text (default: WikiText-2 test, shared/data/wikitext2-test.txt)")
    p.add_argument("--out", type=Path, default=results_dir() / "decode.json",
                   help=out_help("results JSON, .md and .png beside it", results_dir() / "decode.json"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = QUICK if args.quick else {"prompts": list(PROMPTS), "new": 128, "repeats": 3, "profile_steps": 128,
                                         "contended_repeats": 1}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("new", "repeats", "profile_steps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvq bench decode: --{name.replace('_', '-')} must be >= 1")
    if args.contended_repeats < 0:
        raise SystemExit("kvq bench decode: --contended-repeats must be >= 0")
    configs = [parse_config(c) for c in args.configs]
    if not any(c.kind == "fp" for c in configs):
        configs.insert(0, parse_config(REFERENCE))
    configs.sort(key=lambda c: c.kind != "fp")  # the reference runs first
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"kvq bench decode: configuration labels repeat: {labels}; add label=... to tell them apart")

    import torch
    import transformers

    default_threads = {"torch": torch.get_num_threads(), "numba": None}
    try:
        import numba

        default_threads["numba"] = numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    torch.set_num_threads(args.threads)  # after numba's: setting numba's threads resets torch's
    from kvq_core.tools.eval.model import load_model
    from kvq_core.tools.eval.text import load_text

    transformers.logging.set_verbosity_error()
    model, tokenizer, info = load_model(args.model, attn_implementation="kvq", threads=args.threads)
    text, source = load_text(args.text_file)
    ids_all = tokenizer(text, return_tensors="pt").input_ids
    if ids_all.shape[1] < max(args.prompts):
        raise SystemExit(f"kvq bench decode: the text has {ids_all.shape[1]} tokens; --prompts asks for {max(args.prompts)}")
    res: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "threads": torch.get_num_threads(), "default_threads": default_threads,
                    "load_start": round(os.getloadavg()[0], 2), **_versions()},
        "model": info, "text": source,
        "args": {"prompts": args.prompts, "new": args.new, "repeats": args.repeats, "profile_steps": args.profile_steps,
                 "contended_repeats": args.contended_repeats,
                 "configs": [c.describe() for c in configs]},
        "rows": [],
    }
    print(f"kvq bench decode: {info['name']}, torch CPU capability {res['machine']['cpu_capability']}, "
          f"{res['machine']['threads']} thread(s)", flush=True)
    token_elements = 2 * info["kv_heads"] * info["head_dim"]
    plan: list[Callable[[], None]] = []
    for prompt in args.prompts:
        runs = [Run(cfg, prompt) for cfg in configs]
        ids = ids_all[:, :prompt]
        plan += [partial(start, run, model, ids) for run in runs]
        plan += [partial(timed_segment, run, model, args.new) for _ in range(args.repeats) for run in runs]
        plan += [partial(profile, run, model, args.profile_steps) for run in runs]
        if args.contended_repeats:
            plan.append(partial(contended_segments, runs, model, args.new, args.contended_repeats, default_threads))
        plan.append(partial(finish, runs, token_elements, res["rows"]))
    for task in progress(plan, "decode", total=len(plan), enabled=not args.quiet):
        task()
    res["machine"]["load_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    md = render_md(res)
    args.out.with_suffix(".md").write_text(md)
    if not args.no_plot:
        try:
            plot(res, args.out.with_suffix(".png"))
        except ImportError as exc:  # matplotlib: the bench extra
            print(f"no plot: {exc}", file=sys.stderr)
    print(md)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
