"""One prepared GPU check of kvq's GPU backends (run by ``bench/gpu_check.sh``).

1. **Conformance on CUDA** against the NumPy reference for every available backend that
   ``supports(spec, "cuda")`` a method, found by iterating the registry (a new GPU backend is
   picked up without edits; ``--skip`` names backends to leave out, by default the inductor
   one, whose CUDA compiles alone would take the budget).
2. **Encode throughput** (keys + values, through the public Quantizer) per GPU backend and method.
3. **Attend vs SDPA**: each GPU backend's fused attention over the packed cache against torch
   SDPA over bfloat16 K/V (flash), at 4k/32k/128k tokens, batch 1 and 16, 8 KV heads x 128,
   GQA 4, one query token; both timed as CUDA graphs (no Python overhead) and eagerly. Prints
   SDPA time / kvq time and whether OScaR INT2 reaches >= 3x at 128k tokens, batch 1.

Budget: ``--budget`` seconds (default 400) for this script; sections that would overrun print
SKIPPED. Exit status 1 when a conformance check fails.

``--dry-run``: Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set here before kvq is
imported), tiny shapes, one drawn example per method. CI runs it to prove the script works.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

GOAL = ("oscar", 131072, 1, 3.0)  # method, tokens, batch, minimum SDPA/kvq ratio
METHODS = {"oscar": {"bits": 2}, "kivi": {"bits": 2}, "turboquant": {"bits": 2}, "octopus": {"bits": 2}}


@dataclasses.dataclass(frozen=True)
class Plan:
    device: str
    tokens: tuple[int, ...]
    batches: tuple[int, ...]
    kv_heads: int
    head_dim: int
    gqa: int
    reps: int
    examples: int


FULL = Plan("cuda", (4096, 32768, 131072), (1, 16), 8, 128, 4, reps=20, examples=5)
DRY = Plan("cpu", (80,), (1, 2), 2, 64, 4, reps=1, examples=1)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for the whole script")
    p.add_argument("--backends", nargs="*", default=None, help="only these backends (default: every GPU backend)")
    p.add_argument("--skip", nargs="*", default=["torch-compiled"], help="backends to leave out")
    return p.parse_args(argv)


class Clock:
    """The script's time budget."""

    def __init__(self, budget: float) -> None:
        self.end = time.monotonic() + budget

    def left(self) -> float:
        return self.end - time.monotonic()


def supports(backend: str, spec: Any, device: str) -> tuple[bool, str | None]:
    """The registry's ``supports(backend, spec, device)`` (or, on a registry without it, the
    backend's own ``supports(spec, device)``)."""
    from kvq_core import registry

    check = getattr(registry, "supports", None)
    if check is not None:
        return check(backend, spec, device)
    own = getattr(registry.backend_info(backend), "supports", None)
    return own(spec, device) if own is not None else (False, "the backend has no supports(spec, device)")


def gpu_backends(plan: Plan, only: list[str] | None, skip: list[str]) -> dict[str, list[str]]:
    """backend -> methods it serves on the plan's device (per its ``supports``), reference excluded."""
    from kvq_core import registry, testing

    found: dict[str, list[str]] = {}
    for rec in registry.list_backends():
        name = rec.name
        if name == testing.REFERENCE or name in skip or (only is not None and name not in only):
            continue
        if not rec.available:
            print(f"backend {name}: unavailable ({rec.reason})")
            continue
        methods = []
        for method in testing.methods_for(name):
            ok, why = supports(name, registry.make_spec(method, head_dim=plan.head_dim), plan.device)
            if ok:
                methods.append(method)
            else:
                print(f"backend {name}: {method} not served on {plan.device}: {why}")
        if methods:
            found[name] = methods
    # GPU-first backends before the eager torch one, so the budget serves them first
    return dict(sorted(found.items(), key=lambda item: (item[0] == "torch", item[0])))


def served_params(backend: str, method: str, device: str) -> dict[str, tuple]:
    """The conformance suite's parameter choices, less those the backend's ``supports`` refuses."""
    from kvq_core.testing import SPEC_PARAMS
    from kvq_core.testing.strategies import make_spec_or_none

    params = {}
    for name, choices in SPEC_PARAMS.get(method, {}).items():
        kept = []
        for c in choices:
            spec = make_spec_or_none(method, {name: c})
            if spec is None or supports(backend, spec, device)[0]:
                kept.append(c)
        params[name] = tuple(kept) or tuple(choices[:1])
    return params


def conformance(plan: Plan, backends: dict[str, list[str]], clock: Clock, reserve: float) -> list[str]:
    """Runs the suite per (backend, method); returns the failures."""
    import numpy as np
    import torch

    from kvq_core import testing

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(plan.device)

    failures = []
    print("\n== conformance against the NumPy reference on", plan.device)
    for backend, methods in backends.items():
        for method in methods:
            if clock.left() < reserve:
                print(f"SKIPPED {backend}/{method}: budget")
                continue
            start = time.monotonic()
            try:
                report = testing.check_method(backend, method, max_examples=plan.examples, to_backend=to_device,
                                              spec_params=served_params(backend, method, plan.device))
                print(report.line(), f"{time.monotonic() - start:.1f}s", flush=True)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
                failures.append(f"{backend}/{method}: {type(exc).__name__}: {exc}")
                print(f"FAIL {backend}/{method}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return failures


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def eager_time(fn: Callable[[], Any], reps: int, device: str) -> float:
    """Seconds per call: median over ``reps`` synchronised calls after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def graph_time(fn: Callable[[], Any], reps: int, device: str) -> float | None:
    """Seconds per call with ``fn`` captured in a CUDA graph (no launch overhead); None if it cannot be captured."""
    import torch

    if device != "cuda":
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    except Exception as exc:  # noqa: BLE001 - reported; the eager time still stands
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:200]})")
        return None


def best(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


# --------------------------------------------------------------------------------------------
# benchmarks
# --------------------------------------------------------------------------------------------
def _inputs(plan: Plan, batch: int, tokens: int, seed: int = 0):
    import torch

    gen = torch.Generator(device=plan.device).manual_seed(seed)
    shape = (batch, plan.kv_heads, tokens, plan.head_dim)
    k = torch.randn(shape, generator=gen, device=plan.device, dtype=torch.float32).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen, device=plan.device, dtype=torch.float32).to(torch.bfloat16)
    q = torch.randn((batch, plan.kv_heads * plan.gqa, 1, plan.head_dim), generator=gen, device=plan.device,
                    dtype=torch.float32).to(torch.bfloat16)
    return q, k, v


def sdpa_times(q, k, v, plan: Plan) -> tuple[float | None, float | None]:
    """(GQA call, folded call) seconds of flash SDPA over bf16 K/V; folded = the GQA query heads of
    a KV head as query rows (no K/V expansion). None where the kernel refuses the shapes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, lq, d = q.shape
    folded = q.reshape(b, plan.kv_heads, hq // plan.kv_heads * lq, d)
    backends = [SDPBackend.FLASH_ATTENTION] if plan.device == "cuda" else [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]
    out = []
    for call in (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                 lambda: F.scaled_dot_product_attention(folded, k, v)):
        def run(call=call):
            with sdpa_kernel(backends):
                return call()
        try:
            out.append(best(graph_time(run, plan.reps, plan.device), eager_time(run, plan.reps, plan.device)))
        except Exception as exc:  # noqa: BLE001
            print(f"  (SDPA refused: {type(exc).__name__}: {str(exc)[:160]})")
            out.append(None)
    return out[0], out[1]


def _us(t: float | None) -> str:
    return f"{t * 1e6:10.1f}" if t is not None else "         -"


def benchmarks(plan: Plan, backends: dict[str, list[str]], clock: Clock) -> dict[tuple, float]:
    """Encode throughput and attend vs SDPA; returns ratios keyed (backend, method, tokens, batch)."""
    import torch

    from kvq_core import registry
    from kvq_core.api import Quantizer
    from kvq_core.kernels import KernelContext

    ratios: dict[tuple, float] = {}
    print(f"\n== encode and attend: {plan.kv_heads} KV heads x {plan.head_dim}, GQA {plan.gqa}, bf16 input, "
          f"times per call in microseconds")
    print(f"{'backend':>10} {'method':<11} {'batch':>5} {'tokens':>7} {'encode_us':>10} {'enc_Mtok/s':>10} "
          f"{'attend_us':>10} {'eager_us':>10} {'sdpa_gqa':>10} {'sdpa_fold':>10} {'sdpa/kvq':>8}")
    for tokens in plan.tokens:
        for batch in plan.batches:
            if clock.left() < 20:
                print(f"SKIPPED tokens={tokens} batch={batch}: budget")
                continue
            q, k, v = _inputs(plan, batch, tokens)
            sdpa_gqa, sdpa_fold = sdpa_times(q, k, v, plan)
            sdpa = best(sdpa_gqa, sdpa_fold)
            for backend, methods in backends.items():
                for method in methods:
                    if method not in METHODS or clock.left() < 15:
                        continue
                    try:
                        spec = registry.make_spec(method, head_dim=plan.head_dim, **METHODS[method])
                        quant = Quantizer(spec, backend)
                        reps = max(1, plan.reps // 5)
                        enc = eager_time(lambda: (quant.encode_keys(k), quant.encode_values(v)), reps, plan.device)
                        pk, pv = quant.encode_keys(k), quant.encode_values(v)
                        ctx = KernelContext(spec, 0, pk.shape, spec.constants(plan.kv_heads, 0))
                        scale = plan.head_dim ** -0.5

                        def attend() -> Any:
                            return quant.kernels.attend(q, pk.fields, pv.fields, ctx, scale)

                        graph = graph_time(attend, plan.reps, plan.device)
                        eager = eager_time(lambda: quant.attend(q, pk, pv), plan.reps, plan.device)
                        kvq = best(graph, eager)
                        ratio = sdpa / kvq if sdpa and kvq else float("nan")
                        ratios[(backend, method, tokens, batch)] = ratio
                        rate = batch * tokens / enc / 1e6
                        print(f"{backend:>10} {method:<11} {batch:>5} {tokens:>7} {_us(enc)} {rate:10.2f} "
                              f"{_us(graph)} {_us(eager)} {_us(sdpa_gqa)} {_us(sdpa_fold)} {ratio:8.2f}", flush=True)
                        del pk, pv
                    except Exception as exc:  # noqa: BLE001
                        print(f"FAIL bench {backend}/{method} batch={batch} tokens={tokens}: {type(exc).__name__}: "
                              f"{str(exc)[:300]}", flush=True)
                        traceback.print_exc(limit=3)
            del q, k, v
            if plan.device == "cuda":
                torch.cuda.empty_cache()
    return ratios


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    plan = DRY if args.dry_run else FULL
    clock = Clock(args.budget)

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"kvq gpu_check ({'dry run: CPU, Triton interpreter' if args.dry_run else 'GPU'}): torch {torch.__version__}, "
          f"triton {triton_version}, GPU {gpu}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter")
        return 2

    backends = gpu_backends(plan, args.backends, args.skip)
    print("GPU backends and methods:", {b: m for b, m in backends.items()} or "none")
    failures = conformance(plan, backends, clock, reserve=args.budget * 0.45)
    ratios = benchmarks(plan, backends, clock)

    method, tokens, batch, want = GOAL
    if args.dry_run:
        tokens = plan.tokens[-1]
    got = ratios.get(("triton", method, tokens, batch))
    if got is not None:
        verdict = "PASS" if got >= want else "MISS"
        note = " (dry run: shapes differ, not meaningful)" if args.dry_run else ""
        print(f"\nGOAL {method} INT2 attend >= {want:g}x SDPA bf16 at {tokens} tokens, batch {batch}: "
              f"{got:.2f}x {verdict}{note}")
    elif not args.dry_run:
        print(f"\nGOAL {method} at {tokens} tokens, batch {batch}: not measured")
    print(f"\nconformance failures: {len(failures)}")
    for f in failures:
        print("  " + f[:500])
    print(f"time left in the budget: {clock.left():.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
