"""``python bench/first_use.py``: a user's first ``generate`` against the same call once kvq's kernels are compiled.

SmolLM2-135M-Instruct, greedy, through the README's memory-saving path (``KVQCache(model.config,
method=..., bits=...)``, attention from the codes, backend "auto"), OScaR-2 then OCTOPUS-3, in a
fresh interpreter each time (model loading not timed):

- *first*: per prompt length, an empty Numba disk cache (a new ``NUMBA_CACHE_DIR``) and no ``kvq warmup`` before it. By
  default the cache serves from torch while numba compiles in a background process
  (:mod:`kvq_core.compile_ahead`); ``--foreground`` sets ``KVQ_COMPILE=foreground``: the first call compiles;
- *warm*: the same calls once the background compile has finished, numba loading from the disk cache.

Reports each generate's wall seconds, the backend its layers ran and first / warm, and how long the
background compile took. Writes ``bench/results/first_use.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = ("oscar:bits=2", "octopus:bits=3")


def child(configs: list[str], prompt: int, new: int) -> None:
    """Time one generate per config in this process; one JSON line each on stdout."""
    import torch

    from kvq_core.integrations.hf import KVQCache
    from kvq_core.tools.eval.model import load_model
    from kvq_core.tools.eval.text import load_text

    model, tok, _ = load_model()
    text, _ = load_text(None, None)
    ids = tok(text, return_tensors="pt").input_ids[:, :prompt]
    for config in configs:
        method, _, rest = config.partition(":")
        params = {k: int(v) for k, v in (x.split("=") for x in rest.split(",") if x)}
        t0 = time.perf_counter()
        cache = KVQCache(model.config, method=method, **params)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, do_sample=False, cache=cache)
        seconds = time.perf_counter() - t0
        backends = sorted({layer.kq.backend for layer in cache.kvq_layers})
        print(json.dumps({"config": config, "seconds": seconds, "backends": backends,
                          "decoded_bytes": cache.memory_report()["decoded_bytes"],
                          "tokens": out[0, ids.shape[1]:].tolist()}), flush=True)


def run_child(configs: list[str], prompt: int, new: int, env: dict[str, str]) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, __file__, "--child", *configs, "--prompts", str(prompt), "--new", str(new)],
                         env=env, capture_output=True, text=True, check=False)
    sys.stderr.write(out.stderr)
    if out.returncode:
        raise SystemExit(f"child failed ({out.returncode})")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="*", default=list(CONFIGS))
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 512], help="prompt tokens (WikiText-2), one child each")
    p.add_argument("--new", type=int, default=64, help="tokens generated")
    p.add_argument("--foreground", action="store_true", help="KVQ_COMPILE=foreground: the first call compiles")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/first_use.json")
    args = p.parse_args(argv)
    if args.child:
        child(args.configs, args.prompts[0], args.new)
        return 0
    import torch

    cache_dir = tempfile.mkdtemp(prefix="kvq-first-use-")
    os.environ["NUMBA_CACHE_DIR"] = cache_dir  # read by kvq_numba's marks below, and by the children
    env = dict(os.environ, KVQ_COMPILE="foreground" if args.foreground else "background")
    from kvq_core import compile_ahead, registry

    specs = [registry.make_spec(c.partition(":")[0], head_dim=64, **{k: int(v) for k, v in (
        x.split("=") for x in c.partition(":")[2].split(",") if x)}) for c in args.configs]
    t0 = time.perf_counter()
    first = [r | {"prompt": n} for n in args.prompts for r in run_child(args.configs, n, args.new, env)]
    cache = compile_ahead.compile_cache("numba")
    while not all(cache.ready(s, "cpu") for s in specs):
        time.sleep(1.0)
    compiled_after = time.perf_counter() - t0
    warm = [r | {"prompt": n} for n in args.prompts for r in run_child(args.configs, n, args.new, env)]
    rows = [{"config": f["config"], "prompt": f["prompt"], "first_s": f["seconds"], "first_backends": f["backends"],
             "warm_s": w["seconds"], "warm_backends": w["backends"], "ratio": f["seconds"] / w["seconds"],
             "decoded_bytes": f["decoded_bytes"], "same_tokens": sum(a == b for a, b in zip(f["tokens"], w["tokens"]))}
            for f, w in zip(first, warm)]
    command = "python bench/first_use.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cap = torch.backends.cpu.get_cpu_capability()
    res = {"command": command.strip(), "date": datetime.date.today().isoformat(), "cpu_capability": cap,
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "prompts": args.prompts, "new": args.new, "mode": "foreground" if args.foreground else "background",
           "compiled_after_s": compiled_after, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    lines = [
        "# First use: a first `generate` against the same call with the kernels compiled", "",
        f"Command: `{res['command']}`. CPU capability: {cap} ({res['cores']}-core {res['cpu']}), {res['torch_threads']} "
        f"torch threads. Date: {res['date']}.", "",
        f"SmolLM2-135M-Instruct, greedy, WikiText-2 prompts of {' and '.join(map(str, args.prompts))} tokens, {args.new} new tokens, "
        "`KVQCache(model.config, method=..., bits=...)` (attention from the codes, backend auto), each config in turn "
        "in a fresh interpreter per prompt length: *first* on an empty Numba disk cache with no `kvq warmup` before it "
        f"({'compiling in the foreground' if args.foreground else 'numba compiling in the background'}), *warm* "
        f"once the kernels are compiled (all compiled {compiled_after:.0f} s after the first run started). "
        "Seconds: cache creation and `generate`, model loading excluded.", "",
        "| config | prompt | first s | served by | warm s | served by | first / warm | decoded bytes | same greedy tokens |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['config']} | {r['prompt']} | {r['first_s']:.1f} | {', '.join(r['first_backends'])} | {r['warm_s']:.1f} | "
                     f"{', '.join(r['warm_backends'])} | **{r['ratio']:.2f}x** | {r['decoded_bytes']} | "
                     f"{r['same_tokens']}/{args.new} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
