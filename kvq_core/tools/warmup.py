"""``kvq warmup``: compile, once, the kernels a model's cache will need, with a progress line each.

Numba compiles a kernel on its first call with a new argument type (tens of seconds per kernel
on a small CPU, about a minute for a fresh OScaR or OCTOPUS cache) and keeps it in its disk cache,
so later processes load it in well under a second. The argument types depend on the method (and
its bit width: INT3 takes another attend kernel than INT2/INT4), the head dim and the backend,
not on the token count or the number of heads, so one small encode, decode and attend per method
at the model's head dim compiles what ``KVQCache`` runs during ``generate``. Torch-tensor backends
(torch, triton) compile nothing on the host ahead of use and are only exercised.

    kvq warmup                           # oscar:bits=2 and octopus:bits=3 at SmolLM2's head dim 64
    kvq warmup oscar:bits=4 --model path/to/model   # head dim and KV heads from the model's config
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

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
         device: str | None = "cpu", say: Any = print) -> float:
    """Encode (a block and one token), decode and attend a small block of ``method`` on ``backend`` (``"auto"``: what a
    ``KVQCache`` on ``device`` picks), and attend it with an exact window where the backend fuses
    the two (:meth:`kvq_core.Quantizer.attend_window`); returns the seconds it took."""
    import kvq_core

    t0 = time.perf_counter()
    q = kvq_core.get_quantizer(method, backend, device=device if backend == "auto" else None,
                               head_dim=shape["head_dim"], **params)
    rng = np.random.default_rng(0)
    b, h, d, g = 1, shape["kv_heads"], shape["head_dim"], max(1, shape["q_heads"] // shape["kv_heads"])
    kv = rng.standard_normal((b, h, 40, d)).astype(np.float32)
    query = rng.standard_normal((b, h * g, 1, d)).astype(np.float32)
    label = f"kvq warmup: {q.spec.describe()} on {q.backend}:"
    say(f"{label} encode ...")
    pk, pv = q.encode_keys(kv), q.encode_values(kv)
    q.encode_keys(kv[:, :, :1]), q.encode_values(kv[:, :, :1])  # a decode step's token: small calls may run other kernels
    say(f"{label} decode ...")
    q.decode_keys(pk), q.decode_values(pv)
    say(f"{label} attend ...")
    q.attend(query, pk, pv)
    if q.fuses_window(query):  # what a KVQCache decode step calls: the blocks and the exact window at once
        say(f"{label} attend_window ...")
        q.attend_window(query, [(pk, pv)], kv[:, :, :4], kv[:, :, :4])
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvq warmup", description=__doc__.splitlines()[0])
    p.add_argument("methods", nargs="*", default=list(DEFAULT_METHODS), metavar="METHOD[:k=v,...]",
                   help=f"methods and parameters as a cache uses them (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--model", help="take head dim and heads from this model's config (a checkpoint or .gguf file)")
    p.add_argument("--head-dim", type=int, default=None, help=f"head dim (default {DEFAULT_SHAPE['head_dim']})")
    p.add_argument("--backend", default="auto", help="backend (default auto: what KVQCache picks on the CPU)")
    p.add_argument("--device", default="cpu", help="device for backend auto (default cpu)")
    args = p.parse_args(argv)
    shape = model_shape(args.model) if args.model else dict(DEFAULT_SHAPE)
    if args.head_dim:
        shape["head_dim"] = args.head_dim
    total = time.perf_counter()
    for text in args.methods:
        method, params = parse_method(text)
        seconds = warm(method, params, shape, args.backend, args.device, say=lambda m: print(m, flush=True))
        print(f"kvq warmup: {text} ready in {seconds:.1f} s", flush=True)
    print(f"kvq warmup: done in {time.perf_counter() - total:.1f} s (Numba's disk cache keeps the kernels for later "
          "processes)", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
