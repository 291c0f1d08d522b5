"""``kvq bench speed``: encode / decode / attend throughput per method and backend, beside SDPA.

For contexts of 4k..64k tokens (``--quick``: 4k and 32k, fewer methods), head_dim 64 and 128,
8 KV heads, batch 1 and one query token per query head with GQA 4 (32 query heads), it times
``encode`` (keys + values), ``decode`` (keys + values) and ``attend`` for the NumPy reference,
torch eager (``kvq::`` ops), torch compiled (inductor) and Numba (``@njit``), and in the same run:

- torch SDPA (``torch.nn.functional.scaled_dot_product_attention``) over float32 and bfloat16
  K/V of the same context, both as the usual GQA call (``enable_gqa=True``, 32 query heads) and
  folded (the 4 query heads of a KV head as 4 query rows, no K/V expansion; the faster form);
- memcpy bandwidth (``copy_`` of a 256 MiB buffer into another, already written: read + write
  bytes per second; a ``clone`` would time page faults of fresh memory, not the copy).

``attend`` is timed paired with SDPA: every repeat times SDPA fp32 (GQA call, then folded) and
then the kvq attend, and the ratios reported are the medians of the per-repeat ratios, so a
shared machine that slows down for a while moves both sides of a ratio alike.

Throughput is tokens/s and GB/s of the fp16-equivalent K/V (2 bytes per element of K and V);
``attend`` also reports the GB/s of packed bytes it reads and what bounds it: "memory" when that
rate reaches half the memcpy read rate, else "compute" (unpacking, dot products, exp). SDPA fp32
folded is the fp32 reference (on CPU, ``enable_gqa`` re-reads K/V once per query head).
Ratios are the result, not absolute times: the machine may be shared. Results go to
``speed.md``, ``speed.json`` and ``speed.png`` (attend time vs context) under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvq_core.tools.results import out_help, results_dir

BACKENDS = ("numpy", "torch", "torch-compiled", "numba")
METHODS = {
    "oscar": {"bits": 2},
    "kivi": {"bits": 2},
    "quarot": {"bits": 4},
    "fp16": {},
    "turboquant": {"bits": 2},
    "octopus": {"bits": 3},
}
QUICK_METHODS = ("oscar", "kivi")
CONTEXTS = (4096, 8192, 16384, 32768, 65536)
QUICK_CONTEXTS = (4096, 32768)
#: attend targets at 32k tokens, head_dim 128 (the Numba issue): minimum paired speedups over
#: SDPA fp32 as the GQA call ("gqa") and folded ("folded")
TARGETS = (
    {"method": "oscar", "tokens": 32768, "head_dim": 128, "vs": "gqa", "min": 4.0},
    {"method": "oscar", "tokens": 32768, "head_dim": 128, "vs": "folded", "min": 1.5},
    {"method": "octopus", "tokens": 32768, "head_dim": 128, "vs": "gqa", "min": 1.5},
)
#: encode (K+V) of a 32k block: at least this many times the torch backend's speed
ENCODE_TARGET = 5.0
#: backends held to TARGETS (one "Target" line each)
TARGET_BACKENDS = ("torch-compiled", "numba")
#: host-array backends (NumPy inputs)
HOST_BACKENDS = ("numpy", "numba")


def _timeit(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time (s) of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second read + written by ``copy_`` of a ``mib`` MiB float32 tensor into another
    (both touched first, so page faults are not timed)."""
    import torch

    x = torch.ones(mib * (1 << 20) // 4)
    y = torch.zeros_like(x)
    t = _timeit(lambda: y.copy_(x), repeats, warmup=2)
    return 2 * x.numel() * 4 / t


def sdpa_calls(tokens: int, head_dim: int, kv_heads: int, gqa: int, dtype: Any, seed: int = 0) -> dict[str, Callable[[], Any]]:
    """SDPA over random K/V of one context: ``{"gqa": call, "folded": call}`` (see the module doc)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, kv_heads, tokens, head_dim, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, tokens, head_dim, generator=g).to(dtype)
    q = torch.randn(1, kv_heads * gqa, 1, head_dim, generator=g).to(dtype)
    qf = q.view(1, kv_heads, gqa, head_dim)
    return {"gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            "folded": lambda: F.scaled_dot_product_attention(qf, k, v)}


def sdpa_times(calls: dict[str, dict[str, Callable[[], Any]]], repeats: int) -> dict[str, float]:
    """Median seconds of each SDPA call: ``calls`` maps "fp32"/"bf16" to :func:`sdpa_calls`."""
    return {f"sdpa_{name}_{kind}": _timeit(fn, repeats) for name, fns in calls.items() for kind, fn in fns.items()}


def paired_attend(attend: Callable[[], Any], sdpa: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Attend timed paired with SDPA fp32 (module doc): the median attend seconds and the medians
    of the per-repeat ratios SDPA / attend."""
    attend()
    times: dict[str, list[float]] = {"attend": [], **{k: [] for k in sdpa}}
    for _ in range(repeats):
        for name, fn in (*sdpa.items(), ("attend", attend)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out = {"attend_s": statistics.median(times["attend"])}
    for kind in sdpa:
        out[f"attend_vs_sdpa_fp32_{kind}"] = statistics.median(s / a for s, a in zip(times[kind], times["attend"]))
    return out


def bench_one(method: str, params: dict[str, Any], backend: str, tokens: int, head_dim: int, kv_heads: int, gqa: int,
              repeats: int, sdpa: dict[str, Callable[[], Any]], seed: int = 0) -> dict[str, Any]:
    """Times of encode / decode / attend (seconds; attend paired with the SDPA fp32 calls
    ``sdpa``, :func:`paired_attend`) and the packed size, for one configuration."""
    import torch

    import kvq_core

    qz = kvq_core.get_quantizer(method, backend=backend, head_dim=head_dim, **params)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, kv_heads, tokens, head_dim, generator=g)
    v = torch.randn(1, kv_heads, tokens, head_dim, generator=g)
    q = torch.randn(1, kv_heads * gqa, 1, head_dim, generator=g)
    if backend in HOST_BACKENDS:
        k, v, q = k.numpy(), v.numpy(), q.numpy()
    reps = 1 if backend == "numpy" else repeats
    t0 = time.perf_counter()
    pk, pv = qz.encode_keys(k), qz.encode_values(v)  # first call: includes any compilation
    qz.decode_keys(pk), qz.decode_values(pv)
    qz.attend(q, pk, pv)
    first = time.perf_counter() - t0
    rec: dict[str, Any] = {
        "method": method, "params": params, "backend": backend, "tokens": tokens, "head_dim": head_dim,
        "kv_heads": kv_heads, "q_heads": kv_heads * gqa,
        "packed_bytes": pk.nbytes() + pv.nbytes(),
        "bits_per_element": qz.bits_per_element([pk, pv]),
        "first_call_s": first,
        "encode_s": _timeit(lambda: (qz.encode_keys(k), qz.encode_values(v)), reps, warmup=0),
        "decode_s": _timeit(lambda: (qz.decode_keys(pk), qz.decode_values(pv)), reps, warmup=0),
        **paired_attend(lambda: qz.attend(q, pk, pv), sdpa, reps),
    }
    fp16_bytes = 2 * 2 * kv_heads * tokens * head_dim
    for op in ("encode", "decode", "attend"):
        rec[f"{op}_tokens_per_s"] = tokens / rec[f"{op}_s"]
        rec[f"{op}_gbps_fp16"] = fp16_bytes / rec[f"{op}_s"] / 1e9
    rec["attend_gbps_packed"] = rec["packed_bytes"] / rec["attend_s"] / 1e9
    return rec


#: ``Quantizer.attend`` on a 1-token packed block (numba, OScaR INT2, SmolLM2's 3 KV heads x 64 and
#: 9 query heads) may cost at most this many microseconds more than the attend kernel it runs
OVERHEAD_TARGET_US = 15.0


def call_overhead(repeats: int = 15, calls: int = 1000) -> dict[str, Any] | None:
    """The Python cost of one ``Quantizer.attend`` call: its time on a 1-token OScaR INT2 block
    (numba) minus a direct call of the compiled kernel it runs (query rotation, attention from the
    codes and output rotation in one ``@njit`` call) on the same prepared arrays, both on one thread
    (what the quantizer runs a call this small on), timed in this thread's CPU time
    (``time.thread_time``: a shared machine's preemptions do not count). ``repeats`` rounds each
    time ``calls`` attend calls then ``calls`` kernel calls (interleaved, so a machine that slows down
    for a while slows both); each side's figure is its best round, the overhead their difference,
    and ``overhead_rounds_us`` the spread of the per-round differences. None without numba."""
    import kvq_core

    try:
        q = kvq_core.get_quantizer("oscar", "numba", head_dim=64, bits=2)
        import numba
    except (kvq_core.KVQError, ImportError):
        return None
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 3, 1, 64), dtype=np.float32)
    query = rng.standard_normal((1, 9, 1, 64), dtype=np.float32)
    pk, pv = q.encode_keys(k), q.encode_values(k)
    q_rows = np.ascontiguousarray(query.reshape(1, 3, 3, 64))
    kernel, args = q.kernels.attend_args(q_rows, pk.fields, pv.fields, 0.125)

    def full() -> None:
        q.attend(query, pk, pv)

    def direct() -> None:
        kernel(*args)

    def batch(fn: Callable[[], Any]) -> float:
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - t0) / calls * 1e6

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        for fn in (full, direct):  # warm up (and compile) both
            for _ in range(calls // 10):
                fn()
        rounds = [(batch(full), batch(direct)) for _ in range(repeats)]
    finally:
        numba.set_num_threads(threads)
    attend_us, kernel_us = min(a for a, _ in rounds), min(d for _, d in rounds)
    diffs = sorted(a - d for a, d in rounds)
    return {"method": "oscar", "bits": 2, "backend": "numba", "tokens": 1, "kv_heads": 3, "q_heads": 9, "head_dim": 64,
            "attend_us": attend_us, "kernel_us": kernel_us, "overhead_us": attend_us - kernel_us,
            "overhead_rounds_us": {"min": diffs[0], "median": statistics.median(diffs), "max": diffs[-1]},
            "target_us": OVERHEAD_TARGET_US, "met": attend_us - kernel_us <= OVERHEAD_TARGET_US}


def _overhead_line(o: dict[str, Any]) -> str:
    r = o["overhead_rounds_us"]
    return (f"attend call overhead (numba OScaR INT2, 1-token block, 3 KV heads x 64, 9 query heads, 1 thread, CPU time): "
            f"Quantizer.attend {o['attend_us']:.1f} us, the compiled kernel it runs (rotations included) called directly "
            f"{o['kernel_us']:.1f} us (best of interleaved rounds each): overhead **{o['overhead_us']:.1f} us** "
            f"(target <= {o['target_us']:g} us: {'met' if o['met'] else 'not met'}; per round {r['min']:.1f} / "
            f"{r['median']:.1f} / {r['max']:.1f} us min / median / max)")


def bound(rec: dict[str, Any], memcpy_gbps: float) -> str:
    """"memory" when attend reads packed bytes at >= half the memcpy read rate, else "compute"."""
    return "memory" if rec["attend_gbps_packed"] >= 0.5 * (memcpy_gbps / 2) else "compute"


def targets_of(res: dict[str, Any], backend: str) -> list[dict[str, Any]]:
    """The :data:`TARGETS` of ``backend`` that were measured, each with its paired speedup, the
    packed read rate and bound, and the encode speedup over the torch backend."""
    out = []
    for tgt in TARGETS:
        hit = [r for r in res["rows"] if r["method"] == tgt["method"] and r["backend"] == backend
               and r["tokens"] == tgt["tokens"] and r["head_dim"] == tgt["head_dim"]]
        if not hit:
            continue
        r = hit[0]
        torch_row = [x for x in res["rows"] if x["backend"] == "torch" and x["method"] == r["method"]
                     and x["tokens"] == r["tokens"] and x["head_dim"] == r["head_dim"]]
        speedup = r[f"attend_vs_sdpa_fp32_{tgt['vs']}"]
        out.append({
            **tgt, "backend": backend, "attend_s": r["attend_s"], "speedup": speedup, "met": speedup >= tgt["min"],
            "packed_mb": r["packed_bytes"] / 1e6, "attend_read_gbps": r["attend_gbps_packed"],
            "fraction_of_memcpy": r["attend_gbps_packed"] / (res["memcpy_gbps"] / 2), "bound": bound(r, res["memcpy_gbps"]),
            "encode_speedup_vs_torch": torch_row[0]["encode_s"] / r["encode_s"] if torch_row else None,
        })
    return out


def _fmt_ms(s: float | None) -> str:
    return "-" if s is None else (f"{s * 1e3:.1f}" if s < 10 else f"{s:.1f} s")


def render_md(res: dict[str, Any]) -> str:
    lines = ["# kvq bench speed", ""]
    m = res["machine"]
    lines += [f"Machine: {m['cpu']} (torch CPU capability {m.get('cpu_capability', '?')}), {m['threads']} torch threads, "
              f"torch {m['torch']}, load average at start "
              f"{m['load_start']}, at end {m['load_end']}. memcpy (copy_ of 256 MiB into a written buffer): "
              f"**{res['memcpy_gbps']:.2f} GB/s** read+write. Batch 1, {res['kv_heads']} KV heads, GQA {res['gqa']} "
              f"({res['kv_heads'] * res['gqa']} query heads), one query token per head. Times are medians; "
              "ratios matter, not absolute times (shared machine).", ""]
    if res.get("overhead"):
        lines += [_overhead_line(res["overhead"]) + ".", ""]
    targets = res.get("targets", [])
    if targets:
        lines += ["## Targets", "", "Attend at 32k tokens, head_dim 128, paired with SDPA fp32 (median of per-repeat ratios).", "",
                  "| backend | method | attend ms | vs SDPA | speedup | target | met | packed MB | GB/s | of memcpy | bound | "
                  f"encode vs torch (target {ENCODE_TARGET:g}x) |", "|---|---|---:|---|---:|---:|---|---:|---:|---:|---|---:|"]
    for t in targets:
        enc = t.get("encode_speedup_vs_torch")
        lines.append(f"| {t['backend']} | {t['method']} | {_fmt_ms(t['attend_s'])} | {t['vs']} | **{t['speedup']:.2f}x** | "
                     f">= {t['min']:g}x | {'yes' if t['met'] else '**no**'} | {t['packed_mb']:.1f} | "
                     f"{t['attend_read_gbps']:.2f} | {100 * t['fraction_of_memcpy']:.1f}% | {t['bound']} | "
                     + (f"{enc:.2f}x |" if enc else "- |"))
    if targets:
        lines.append("")
    for d in res["head_dims"]:
        lines += [f"## head_dim {d}", ""]
        lines += ["| method | backend | tokens | bits/elem | encode ms | decode ms | attend ms | attend tok/s | "
                  "attend GB/s (fp16-eq) | attend GB/s (packed) | bound | attend vs SDPA fp32 gqa | vs folded |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            if r["head_dim"] != d:
                continue
            lines.append(
                f"| {r['method']} | {r['backend']} | {r['tokens']} | {r['bits_per_element']:.3f} | {_fmt_ms(r['encode_s'])} | "
                f"{_fmt_ms(r['decode_s'])} | {_fmt_ms(r['attend_s'])} | {r['attend_tokens_per_s']:.3g} | "
                f"{r['attend_gbps_fp16']:.2f} | {r['attend_gbps_packed']:.2f} | {bound(r, res['memcpy_gbps'])} | "
                f"{r['attend_vs_sdpa_fp32_gqa']:.2f}x | {r['attend_vs_sdpa_fp32_folded']:.2f}x |")
        lines += ["", "| SDPA (same run) | tokens | fp32 gqa ms | fp32 folded ms | bf16 gqa ms | bf16 folded ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        for key, sd in res["sdpa"].items():
            dd, tok = key.split("/")
            if int(dd) == d:
                lines.append(f"| sdpa | {tok} | {_fmt_ms(sd['sdpa_fp32_gqa'])} | {_fmt_ms(sd['sdpa_fp32_folded'])} | "
                             f"{_fmt_ms(sd['sdpa_bf16_gqa'])} | {_fmt_ms(sd['sdpa_bf16_folded'])} |")
        lines.append("")
    lines += ["First-call times (encode + decode + attend, including torch.compile) are in speed.json.", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = res["head_dims"]
    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims), 4.5), squeeze=False)
    for ax, d in zip(axes[0], dims):
        rows = [r for r in res["rows"] if r["head_dim"] == d]
        for (method, backend) in sorted({(r["method"], r["backend"]) for r in rows}):
            pts = sorted((r["tokens"], r["attend_s"]) for r in rows if r["method"] == method and r["backend"] == backend)
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=f"{method} / {backend}")
        for key, style in (("sdpa_fp32_gqa", "k--"), ("sdpa_fp32_folded", "k-"), ("sdpa_bf16_folded", "k:")):
            pts = sorted((int(k.split("/")[1]), v[key]) for k, v in res["sdpa"].items() if int(k.split("/")[0]) == d)
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, label=key.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("attend time (ms)")
        ax.set_title(f"attend, head_dim {d}, {res['kv_heads']} KV heads, GQA {res['gqa']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kvq bench speed``."""
    p = argparse.ArgumentParser(prog="kvq bench speed", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="contexts 4k and 32k, methods oscar and kivi")
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--methods", nargs="+", default=None, help=f"default: {', '.join(METHODS)}")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gqa", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 gives steadier ratios on a shared machine")
    p.add_argument("--numpy-max-tokens", type=int, default=32768, help="skip the NumPy reference above this context")
    p.add_argument("--out", type=Path, default=results_dir(), help=out_help("directory for speed.{md,json,png}", results_dir()))
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvq-inductor"))
    import torch

    import kvq_core

    if args.threads:
        try:
            import numba

            numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
        except ImportError:
            pass
        torch.set_num_threads(args.threads)  # after numba's, which can reset torch's
    contexts = args.contexts or (QUICK_CONTEXTS if args.quick else CONTEXTS)
    methods = args.methods or (QUICK_METHODS if args.quick else tuple(METHODS))
    known = {m.name for m in kvq_core.list_methods()}
    backends = [b for b in args.backends if any(r.name == b and r.available for r in kvq_core.list_backends())]
    res: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "torch": torch.__version__, "load_start": round(os.getloadavg()[0], 2)},
        "kv_heads": args.kv_heads, "gqa": args.gqa, "head_dims": list(args.head_dims), "contexts": list(contexts),
        "memcpy_gbps": memcpy_bandwidth() / 1e9, "rows": [], "sdpa": {},
    }
    print(f"memcpy {res['memcpy_gbps']:.2f} GB/s (read+write); CPU capability {res['machine']['cpu_capability']}",
          flush=True)
    if "numba" in backends:
        res["overhead"] = call_overhead()
        if res["overhead"]:
            print(_overhead_line(res["overhead"]).replace("**", ""), flush=True)
    for d in args.head_dims:
        for tokens in contexts:
            calls = {name: sdpa_calls(tokens, d, args.kv_heads, args.gqa, dtype)
                     for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
            res["sdpa"][f"{d}/{tokens}"] = sdpa_times(calls, args.repeats)
            print(f"d={d} T={tokens} sdpa " + " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in res["sdpa"][f"{d}/{tokens}"].items()),
                  flush=True)
            for method in methods:
                if method not in known:
                    continue
                for backend in backends:
                    if backend == "numpy" and tokens > args.numpy_max_tokens:
                        continue
                    try:
                        rec = bench_one(method, METHODS.get(method, {}), backend, tokens, d, args.kv_heads, args.gqa,
                                        args.repeats, calls["fp32"])
                    except kvq_core.KVQError as exc:
                        print(f"skip {method}/{backend}: {exc}")
                        continue
                    res["rows"].append(rec)
                    print(f"d={d} T={tokens} {method:8} {backend:15} encode {rec['encode_s'] * 1e3:9.1f} ms  decode "
                          f"{rec['decode_s'] * 1e3:9.1f} ms  attend {rec['attend_s'] * 1e3:9.1f} ms "
                          f"({rec['attend_vs_sdpa_fp32_gqa']:.2f}x SDPA gqa, {rec['attend_vs_sdpa_fp32_folded']:.2f}x folded, "
                          f"paired)  (first call {rec['first_call_s']:.1f} s)", flush=True)
            del calls
    res["machine"]["load_end"] = round(os.getloadavg()[0], 2)
    res["targets"] = [t for b in TARGET_BACKENDS for t in targets_of(res, b)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speed.json").write_text(json.dumps(res, indent=1))
    (args.out / "speed.md").write_text(render_md(res))
    if not args.no_plot:
        try:
            plot(res, args.out / "speed.png")
        except ImportError as exc:  # matplotlib is the bench extra
            print(f"no plot: {exc}")
    print(render_md(res))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
