"""``python bench/decode_layer_times.py``: where a decode step's time goes inside the model, per layer.

Greedy-decodes after a ``--prompt``-token WikiText-2 prompt on SmolLM2-135M (1 thread) with each
cache of ``--configs`` in turn, several rounds in one process (so every cache is timed in the same
machine state), and times the cache's and the attention's functions with nested wall-clock timers:
per layer and step, the microseconds spent inside each (a callee's time is inside its caller's). The
step time is timed too, so *other* (the weights, everything outside the timed functions) follows.
Inside the model each Python step runs several times its hot time (the streamed weights evict the
interpreter's data between layers); this is the measure of that, where ``kvq bench speed`` gives the
hot one. Writes ``bench/results/decode_layer_times.{json,md}`` (``--out``); never overwrites a result.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

#: (module, attribute) of the functions timed: the cache's update, the attention function's parts, the
#: quantizer's fused call and its checks, the Numba kernel call; a name absent here is skipped
TIMED = [
    ("transformers.cache_utils", "DynamicLayer.update"),
    ("kvq_core.integrations.hf.layer", "KVQLayer.update"),
    ("kvq_core.integrations.hf.layer", "KVQLayer.check_step"),
    ("kvq_core.integrations.hf.layer", "KVQLayer._encode_flush"),
    ("kvq_core.integrations.hf.layer", "KVQLayer._settle"),
    ("kvq_core.integrations.hf.layer", "KVQLayer.window_plan"),
    ("kvq_core.integrations.hf.layer", "concat_tokens"),
    ("kvq_core.api", "Quantizer.encode_keys"),
    ("kvq_core.api", "Quantizer.encode_values"),
    ("kvq_core.api", "Quantizer.plan_window"),
    ("kvq_core.integrations.hf.layer", "step_view"),
    ("kvq_core.integrations.hf.attention", "_sdpa"),
    ("kvq_core.integrations.hf.attention", "attend_codes"),
    ("kvq_core.integrations.hf.attention", "to_torch"),
    ("kvq_core.api", "Quantizer.attend_window"),
    ("kvq_core.api", "Quantizer.fuses_window"),
    ("kvq_core.api", "check_query_for"),
    ("kvq_core.window_plan", "WindowPlan.current"),
    ("kvq_numba.threads", "run"),
    ("kvq_numba.cpu.attend_planes", "planes_window8"),
    ("kvq_numba.cpu.attend_planes", "planes_window16"),
    ("kvq_numba.cpu.window", "run"),
    ("kvq_numba.octopus", "cpu_attend_octopus.contiguous_jobs"),
    ("kvq_numba.octopus", "cpu_attend_octopus.octopus_window"),
    ("kvq_numba.octopus", "octopus_codes.encode"),
]


class Timers:
    """Wall-clock totals and call counts of the :data:`TIMED` functions while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        """Wrap each :data:`TIMED` function that exists here, and the model's attention functions."""
        import importlib

        for module, path in TIMED:
            try:
                owner = importlib.import_module(module)
            except ImportError:
                continue
            *parents, name = path.split(".")
            for p in parents:
                owner = getattr(owner, p, None)
            fn = getattr(owner, name, None) if owner is not None else None
            if fn is None:
                continue
            self._undo.append((owner, name, fn))
            setattr(owner, name, self._timed(fn, f"{module.rsplit('.', 1)[-1]}.{path}"))
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns

        for impl in ("sdpa", "kvq"):  # the model's attention functions, through a local override of the table
            if impl in fns:
                local = fns._local_mapping
                self._undo.append((local, impl, local.get(impl)))
                fns[impl] = self._timed(fns[impl], f"attention function {impl!r}")

    def _timed(self, fn: Any, key: str) -> Any:
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += clock() - t0
                calls[key] += 1
        return timed

    def clear(self) -> None:
        """Zero the totals (between rounds)."""
        self.seconds.clear()
        self.calls.clear()

    def remove(self) -> None:
        """Put back every timed function, newest first."""
        for owner, name, fn in reversed(self._undo):
            if isinstance(owner, dict):  # an attention function's local override
                if fn is None:
                    owner.pop(name, None)
                else:
                    owner[name] = fn
            else:
                setattr(owner, name, fn)
        self._undo.clear()


def main(argv: list[str] | None = None) -> int:
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per cache and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=["fp", "oscar:bits=2"])
    p.add_argument("--model", help="a .gguf file, a checkpoint directory or a hub name (default: SmolLM2-135M GGUF)")
    p.add_argument("--text-file", help="prompt text (default: WikiText-2 test, as kvq eval finds it)")
    p.add_argument("--out", type=Path, default=Path("bench/results/decode_layer_times.json"))
    args = p.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; results are never overwritten: pass another --out")
    import numba
    import torch
    import transformers

    numba.set_num_threads(1)
    torch.set_num_threads(1)  # after numba's, which can reset it
    transformers.logging.set_verbosity_error()
    from kvq_core.tools.bench.decode import attn_impl
    from kvq_core.tools.eval.caches import KVQ_KINDS, build_cache, parse_config
    from kvq_core.tools.eval import model as model_loader
    from kvq_core.tools.eval.text import load_text
    from kvq_core.tools.progress import progress

    model, tok, info = model_loader.load_model(args.model, attn_implementation="kvq", threads=1)
    text, source = load_text(args.text_file)
    ids = tok(text, return_tensors="pt").input_ids[:, :args.prompt]
    if ids.shape[1] < args.prompt:
        raise SystemExit(f"the text has {ids.shape[1]} tokens; --prompt asks for {args.prompt}")
    configs = [parse_config(c) for c in args.configs]
    state = {}
    with torch.no_grad():
        for cfg in configs:  # prefill and warm each cache (compiles, or loads, the kernels)
            model.set_attn_implementation(attn_impl(cfg))
            cache = build_cache(cfg, model.config, attention="codes" if cfg.kind in KVQ_KINDS else "auto")
            t = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(4):
                t = model(t, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            state[cfg.label] = [cache, t]
        timers = Timers()
        timers.install()
        per: dict[str, list[dict[str, Any]]] = defaultdict(list)
        try:
            for _ in progress(range(args.rounds), "rounds", total=args.rounds):
                for cfg in configs:
                    cache, t = state[cfg.label]
                    model.set_attn_implementation(attn_impl(cfg))
                    timers.clear()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        t = model(t, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                    step = (time.perf_counter() - t0) / args.steps
                    state[cfg.label][1] = t
                    n = args.steps * info["layers"]
                    per[cfg.label].append({"step_ms": 1e3 * step, "us_per_layer": {k: 1e6 * v / n for k, v in timers.seconds.items()},
                                           "calls_per_layer": {k: c / n for k, c in timers.calls.items()}})
        finally:
            timers.remove()
    rows = []
    for cfg in configs:
        rounds = per[cfg.label]
        names = sorted({k for r in rounds for k in r["us_per_layer"]})
        rows.append({"label": cfg.label, "step_ms": [r["step_ms"] for r in rounds],
                     "us_per_layer": {k: statistics.median(r["us_per_layer"].get(k, 0.0) for r in rounds) for k in names},
                     "calls_per_layer": rounds[0]["calls_per_layer"]})
    res = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": 1, "model": info, "text": source,
           "prompt": args.prompt, "steps": args.steps, "rounds": args.rounds, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    md = render(res)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


def render(res: dict[str, Any]) -> str:
    """One table per cache: per-layer microseconds of each timed function (median over rounds)."""
    lines = ["# decode step, per layer inside the model", "",
             f"{res['model']['name']}, prompt {res['prompt']} tokens, {res['steps']} steps x {res['rounds']} rounds "
             f"per cache (round-robin), torch CPU capability **{res['cpu_capability']}**, 1 thread. Nested timers: a "
             "callee's time is inside its caller's.", ""]
    for r in res["rows"]:
        steps = ", ".join(f"{s:.1f}" for s in r["step_ms"])
        lines += [f"## {r['label']}: step ms by round {steps}", "", "| function | us per layer | calls per layer |",
                  "|---|---:|---:|"]
        for k, v in sorted(r["us_per_layer"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| `{k}` | {v:.1f} | {r['calls_per_layer'].get(k, 0):.2f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
