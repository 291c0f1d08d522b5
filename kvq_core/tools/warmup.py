"""``kvq warmup``: compile, once, the kernels a model's cache will need, with a progress line each.

Numba compiles a kernel on its first call with a new argument type (seconds to three minutes per
kernel on a small CPU) and keeps it in its disk cache, so later processes load it in well under a
second. The argument types depend on the method (and its bit width), the head dim and the backend,
not on the token count or the number of heads, so one small encode, decode and attend per method
at the model's head dim (:func:`kvq_core.compile_ahead.warm`) compiles what ``KVQCache`` runs during
``generate``, and marks the spec compiled: caches made later use numba from their first call (a
cache made before serves from torch while numba compiles in the background). Methods compile in
parallel processes (``--jobs``). Torch-tensor backends compile nothing on the host ahead of use and
are only exercised.

    kvq warmup                           # oscar:bits=2 and octopus:bits=3 at SmolLM2's head dim 64
    kvq warmup oscar:bits=4 --model path/to/model   # head dim and KV heads from the model's config
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

DEFAULT_METHODS = ("oscar:bits=2", "octopus:bits=3")
#: SmolLM2-135M, the default model of kvq's eval and bench commands
DEFAULT_SHAPE = {"head_dim": 64, "kv_heads": 3, "q_heads": 9}


def model_shape(model: str | None) -> dict[str, int]:
    """Head dim and KV / query heads from a model's config (``--model``: a checkpoint or .gguf file)."""
    from transformers import AutoConfig

    from kvq_core.tools.eval.model import resolve_model

    path, gguf_file = resolve_model(model)
    cfg = AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    cfg = cfg.get_text_config(decoder=True)
    q_heads = cfg.num_attention_heads
    return {"head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or q_heads, "q_heads": q_heads}


def parse_method(text: str) -> tuple[str, dict[str, Any]]:
    """``METHOD[:k=v,...]`` -> (method, params); values parsed as int, float or kept as text."""
    method, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"kvq warmup: {text!r}: {item!r} is not key=value")
        for kind in (int, float):
            try:
                params[key.strip()] = kind(value)
                break
            except ValueError:
                continue
        else:
            params[key.strip()] = value.strip()
    return method.strip(), params


def warm(method: str, params: dict[str, Any], shape: dict[str, int], backend: str = "auto",
         device: str | None = "cpu", say: Any = print, every: bool = True) -> float:
    """Compile ``method`` with ``params`` at ``shape`` on ``backend`` (``"auto"``: what a ``KVQCache`` on
    ``device`` picks) by running what a cache runs (:func:`kvq_core.compile_ahead.warm`), and mark it
    compiled, so caches made later use that backend from their first call; returns the seconds it took."""
    from kvq_core import compile_ahead, registry

    spec = registry.make_spec(method, head_dim=shape["head_dim"], **params)
    name = registry.select_backend(spec, device) if backend == "auto" else backend
    seconds = compile_ahead.warm(spec, name, shape["kv_heads"], shape["q_heads"], say=lambda m: say(f"kvq warmup: {m}"),
                                 every=every)
    compile_ahead.mark_warm(spec, name)
    return seconds


def _in_parallel(texts: list[str], options: list[str], jobs: int) -> int:
    """Run ``kvq warmup TEXT OPTIONS --jobs 1`` per method text, up to ``jobs`` processes at a time (a
    compile runs on one core), their lines relayed whole to this process's stdout; the first non-zero
    exit status, else 0."""
    import subprocess
    import threading

    def relay(proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            print(line, end="", flush=True)

    pending, running, rc = list(texts), [], 0
    while pending or running:
        while pending and len(running) < jobs:
            cmd = [sys.executable, "-m", "kvq_core.tools.warmup", pending.pop(0), *options, "--jobs", "1"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            reader = threading.Thread(target=relay, args=(proc,), daemon=True)
            reader.start()
            running.append((proc, reader))
        time.sleep(0.1)
        for proc, reader in [x for x in running if x[0].poll() is not None]:
            reader.join()
            running.remove((proc, reader))
            rc = rc or proc.returncode
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvq warmup", description=__doc__.splitlines()[0])
    p.add_argument("methods", nargs="*", default=list(DEFAULT_METHODS), metavar="METHOD[:k=v,...]",
                   help=f"methods and parameters as a cache uses them (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--model", help="take head dim and heads from this model's config (a checkpoint or .gguf file)")
    p.add_argument("--head-dim", type=int, default=None, help=f"head dim (default {DEFAULT_SHAPE['head_dim']})")
    p.add_argument("--backend", default="auto", help="backend (default auto: what KVQCache picks on the CPU)")
    p.add_argument("--device", default="cpu", help="device for backend auto (default cpu)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="methods compiled at once, one process each (default: the CPU count)")
    p.add_argument("--decode-only", action="store_true",
                   help="only what an unpadded generate runs: skip the plain attend a fused backend runs for masked steps")
    args = p.parse_args(argv)
    total = time.perf_counter()
    if args.jobs > 1 and len(args.methods) > 1:
        options = ["--backend", args.backend, "--device", args.device] + (["--model", args.model] if args.model else []) \
            + (["--head-dim", str(args.head_dim)] if args.head_dim else []) + (["--decode-only"] if args.decode_only else [])
        rc = _in_parallel(args.methods, options, args.jobs)
        print(f"kvq warmup: done in {time.perf_counter() - total:.1f} s ({min(args.jobs, len(args.methods))} processes; "
              "Numba's disk cache keeps the kernels for later processes)", flush=True)
        return rc
    shape = model_shape(args.model) if args.model else dict(DEFAULT_SHAPE)
    if args.head_dim:
        shape["head_dim"] = args.head_dim
    for text in args.methods:
        method, params = parse_method(text)
        seconds = warm(method, params, shape, args.backend, args.device, say=lambda m: print(m, flush=True),
                       every=not args.decode_only)
        print(f"kvq warmup: {text} ready in {seconds:.1f} s", flush=True)
    print(f"kvq warmup: done in {time.perf_counter() - total:.1f} s (Numba's disk cache keeps the kernels for later "
          "processes)", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
