"""``python bench/onnx_decode.py``: one decoder attention step of SmolLM2 over a kvq cache in onnxruntime.

Takes the real post-RoPE q/k/v of one layer of SmolLM2-135M-Instruct (9 query heads, 3 KV
heads, head_dim 64: GQA 3) on a ``--prompt``-token WikiText-2 prompt plus one new token. The
prompt's K/V are packed by Python kvq (OCTOPUS, a per-token layout, so new tokens join the cache
without re-quantizing it); the step then runs three exported ONNX graphs in onnxruntime:
``encode_keys`` and ``encode_values`` of the new token, a join along tokens, and ``attend`` of
the new query over the packed cache. The same step runs on kvq's ``"torch"`` backend; the
script reports the max difference of the outputs (ONNX vs torch), both against exact softmax
attention over the full-precision K/V, and the time per step of each (median of ``--reps``).
Writes ``bench/results/onnx_decode.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CAPTURE = "kvq_capture"


def capture_qkv(model: Any, ids: Any, layer: int) -> tuple[Any, Any, Any]:
    """Post-RoPE ``(q [1, hq, t, d], k [1, hk, t, d], v)`` of ``layer`` for the tokens ``ids``."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[str, Any] = {}

    def attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        if module.layer_idx == layer:
            seen.update(q=query.detach().clone(), k=key.detach().clone(), v=value.detach().clone())
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(CAPTURE, attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return seen["q"], seen["k"], seen["v"]


def median_seconds(fn: Any, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="octopus", help="a method with a per-token layout (octopus, turboquant)")
    p.add_argument("--layer", type=int, default=5)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads")
    p.add_argument("--out", default="bench/results/onnx_decode.json")
    args = p.parse_args(argv)
    import onnxruntime as ort
    import torch

    from kvq_core import get_quantizer
    from kvq_core.tools.eval.model import load_model
    from kvq_core.tools.eval.text import load_text
    from kvq_core.integrations.onnx import export
    from kvq_core.packed import PackedKV
    from kvq_core.tokens import concat_tokens

    model, tok, info = load_model(None, threads=args.threads)
    text, source = load_text(None, None)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.prompt + 1]
    q_all, k_all, v_all = capture_qkv(model, ids, args.layer)
    hq, hk, d = info["q_heads"], info["kv_heads"], info["head_dim"]
    t = ids.shape[1] - 1
    k_np, v_np = k_all.float().numpy(), v_all.float().numpy()
    query, k_new, v_new = q_all[:, :, t:], k_all[:, :, t:], v_all[:, :, t:]  # the decode step's token

    ref = get_quantizer(args.method, "numpy", layer=args.layer, head_dim=d)
    pk, pv = ref.encode_keys(k_np[:, :, :t]), ref.encode_values(v_np[:, :, :t])  # the cache, packed by kvq

    # ONNX: export the three graphs of the step, run them in onnxruntime
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    sessions, export_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for graph in ("encode_keys", "encode_values", "attend"):
            t0 = time.perf_counter()
            path = export(ref, Path(tmp) / f"{graph}.onnx", graph, kv_heads=hk, q_heads=hq)
            export_s[graph] = round(time.perf_counter() - t0, 1)
            sessions[graph] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

    def onnx_step() -> np.ndarray:
        blocks = []
        for kind, x, cache in (("keys", k_new, pk), ("values", v_new, pv)):
            s = sessions[f"encode_{kind}"]
            fields = dict(zip((o.name for o in s.get_outputs()), s.run(None, {"x": x.float().numpy()})))
            blocks.append(concat_tokens([cache, PackedKV(ref.spec, kind, tuple(x.shape), fields, args.layer)]))
        feed = {"q": query.float().numpy(), **{f"keys_{n}": a for n, a in blocks[0].fields.items()},
                **{f"values_{n}": a for n, a in blocks[1].fields.items()}}
        return sessions["attend"].run(["out"], feed)[0]

    # torch: the same step on kvq's torch backend
    qt = get_quantizer(args.method, "torch", layer=args.layer, head_dim=d)
    tk, tv = pk.map_fields(torch.from_numpy), pv.map_fields(torch.from_numpy)

    def torch_step() -> Any:
        with torch.no_grad():
            bk = concat_tokens([tk, qt.encode_keys(k_new)], qt.arrays)
            bv = concat_tokens([tv, qt.encode_values(v_new)], qt.arrays)
            return qt.attend(query, bk, bv)

    def exact_step() -> Any:
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(query, k_all, v_all, enable_gqa=True)

    out_onnx, out_torch, out_exact = onnx_step(), torch_step().numpy(), exact_step().numpy()
    rows = {
        "onnxruntime": median_seconds(onnx_step, args.reps),
        "torch (kvq torch backend)": median_seconds(torch_step, args.reps),
        "torch sdpa, full precision": median_seconds(exact_step, args.reps),
    }
    diff = float(np.abs(out_onnx - out_torch).max())
    meta = {"model": info["name"], "layer": args.layer, "method": ref.spec.describe(), "context": t, "q_heads": hq,
            "kv_heads": hk, "head_dim": d, "text": source, "threads": args.threads, "reps": args.reps,
            "cpu": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "onnxruntime": ort.__version__,
            "export_seconds": export_s, "max_abs_onnx_vs_torch": diff,
            "max_abs_onnx_vs_exact": float(np.abs(out_onnx - out_exact).max()),
            "max_abs_torch_vs_exact": float(np.abs(out_torch - out_exact).max()),
            "output_max_abs": float(np.abs(out_exact).max())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "ms_per_step": {k: 1e3 * v for k, v in rows.items()}}, indent=1))
    md = [f"# One decode attention step over a kvq cache in onnxruntime: {info['name']}", "",
          f"Layer {args.layer}, {meta['method']}, {t} cached tokens + 1 new, {hq} query / {hk} KV heads, head_dim {d}; "
          f"{args.threads} thread(s), CPU capability {meta['cpu']}, median of {args.reps} steps.", "",
          f"Output max |ONNX - torch| = {diff:.3g}; vs exact attention: ONNX {meta['max_abs_onnx_vs_exact']:.3g}, "
          f"torch {meta['max_abs_torch_vs_exact']:.3g} (output max |x| {meta['output_max_abs']:.3g}).", "",
          "| step on | ms per step |", "|---|---|"]
    md += [f"| {k} | {1e3 * v:.3f} |" for k, v in rows.items()]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if diff <= 1e-4 * max(1.0, meta["output_max_abs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
