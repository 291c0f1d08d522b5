"""One prepared GPU check of kvq's GPU backends (run by ``bench/gpu_check.sh``).

1. **Conformance on CUDA** against the NumPy reference for every available backend that
   ``supports(spec, "cuda")`` a method, found by iterating the registry (a new GPU backend is
   picked up without edits; ``--skip`` names backends to leave out, by default the inductor
   one, whose CUDA compiles alone would take the budget).
2. **Encode throughput** (keys + values, through the public Quantizer) per GPU backend and method:
   Triton's kernels and numba's CUDA kernels side by side (numba takes float16 input: numba-cuda
   has no bfloat16 arrays).
3. **Attend vs SDPA**: each GPU backend's fused attention over the packed cache against torch
   SDPA over bfloat16 K/V (flash), at 4k/32k/128k tokens, batch 1 and 16, 8 KV heads x 128,
   GQA 4, one query token; timed as CUDA graphs (no Python overhead; not numba, which launches
   on its own stream) and eagerly. The goal shape (OScaR INT2 >= 3x at 128k tokens, batch 1)
   runs first.
4. **Fused window step**: the ``kvq::attend_window`` op's body (a layer's packed blocks, four of
   halving length as a KVQCache layer holds them, then a 64-token exact window, in one online
   softmax) per GPU backend whose kernel class has a fused ``attend_window`` of its own, against
   the unfused reference body (``TorchMethod.attend_window``: each block decoded by the backend's
   kernels, then one softmax), at 8k tokens (batch 1 and 16) and 32k (batch 1), as CUDA graphs and
   eagerly; the two answers are compared.
5. **Paged decode** (only when ``torch.ops.kvq.attend_paged`` exists): ``kvq::attend_paged`` per
   backend with a paged kernel of its own (and the torch fallback), batch 16 and 64 of mixed
   context lengths, pages of 16 and 32 tokens, against SDPA over the batch padded to its longest
   context (bf16, flash; a lower bound of a dense engine's cost, which would also mask).
6. **Model decode**: a transformers Llama with random weights (no checkpoint reaches an offline GPU
   machine) whose attention is shaped as Llama-3-8B's (8 KV heads x 128, GQA 4; 4 layers), bf16 on
   CUDA: greedy decode steps through ``DynamicCache`` (sdpa) and through ``KVQCache`` on the Triton
   backend (``attn_implementation="kvq"``: each layer's blocks and window in one fused call), 32k
   prompt tokens at batch 1 and 16; step time, KV bytes held, and the first step's logits against
   ``DynamicCache``'s (relative error, same argmax).

Ends with one summary table of ratios (reference time / kvq time; numba vs Triton: Triton time /
numba time; fused window: unfused time / fused time) and the list of what the budget skipped.

Budget: ``--budget`` seconds (default 400) for this script, split between the sections
(conformance stops at 40 % of it; the fused window step keeps 10 %, the paged step 25 % when it
runs; the model decode keeps 15 %); an item that would overrun prints SKIPPED and is listed at the end. Exit status 1 when a
conformance check or a timed item fails (or the fused and unfused window answers disagree).
The real run never uses Triton's interpreter (``TRITON_INTERPRET`` is removed before import).

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
#: the order GPU backends are served in (the budget may not reach the last); others after, torch last
PRIORITY = ("triton", "numba")
#: input dtype per backend where it differs from bfloat16 (numba-cuda has no bfloat16 arrays: a
#: bf16 CUDA tensor would go through the host)
INPUT_DTYPE = {"numba": "float16"}
#: backends whose kernels run on torch's current stream, so a CUDA graph can capture them
#: (numba launches on its own stream)
NO_GRAPHS = {"numba"}
#: the paged spec: OScaR INT2 with 16-token key groups (a page holds whole groups at 16 and 32)
PAGED_SPEC = ("oscar", {"bits": 2, "key_group": 16})
#: the fused window step: (packed tokens, batch) shapes, and the exact window's tokens
WINDOW_SHAPES = ((8192, 1), (8192, 16), (32768, 1))
WINDOW_TOKENS = 64
#: the model decode section: a Llama with random weights, attention shaped as Llama-3-8B's
MODEL = {"num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128, "intermediate_size": 2816, "vocab_size": 32000}
MODEL_SHAPES = ((32768, 1), (32768, 16))  # prompt tokens, batch
MODEL_CONFIGS = ("fp", "oscar:bits=2", "octopus:bits=3")  # DynamicCache first: the reference
MODEL_BACKEND = "triton"
MODEL_STEPS = 16
#: the dry run's model: tiny, two layers, a 160-token prompt, 3 timed steps
DRY_MODEL = ({"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 256, "vocab_size": 256}, ((160, 1),), 3)


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
    paged_batches: tuple[int, ...]
    page_sizes: tuple[int, ...]
    paged_lens: tuple[int, int]  # context lengths drawn in [lo, hi] (multiples of 16)


FULL = Plan("cuda", (4096, 32768, 131072), (1, 16), 8, 128, 4, reps=20, examples=5,
            paged_batches=(16, 64), page_sizes=(16, 32), paged_lens=(256, 8192))
DRY = Plan("cpu", (80,), (1, 2), 2, 64, 4, reps=1, examples=1,
           paged_batches=(2,), page_sizes=(16,), paged_lens=(16, 48))
#: the dry run's fused window step: 96 packed tokens (blocks of 48, 24, 12, 12), batch 2, an 8-token window
DRY_WINDOW = (((96, 2),), 8)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for the whole script")
    p.add_argument("--backends", nargs="*", default=None, help="only these backends (default: every GPU backend)")
    p.add_argument("--skip", nargs="*", default=["torch-compiled"], help="backends to leave out")
    return p.parse_args(argv)


class Clock:
    """The script's time budget, and what it made the script skip."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.start = time.monotonic()
        self.end = self.start + budget
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.end - time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.start

    def skip(self, what: str, why: str = "budget") -> None:
        print(f"SKIPPED {what}: {why}", flush=True)
        self.skipped.append(f"{what} ({why})")


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the summary: ``ref_s / kvq_s`` is the ratio (> 1: kvq faster)."""

    section: str
    backend: str
    method: str
    shape: str
    kvq_s: float
    ref_s: float

    @property
    def ratio(self) -> float:
        return self.ref_s / self.kvq_s if self.kvq_s else float("nan")


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

    def rank(item: tuple[str, list[str]]) -> tuple[int, str]:
        name = item[0]
        return (PRIORITY.index(name) if name in PRIORITY else len(PRIORITY) + (name == "torch"), name)

    return dict(sorted(found.items(), key=rank))


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


def conformance(plan: Plan, backends: dict[str, list[str]], clock: Clock) -> list[str]:
    """Runs the suite per (backend, method) until 40 % of the budget is used; returns the failures."""
    import numpy as np
    import torch

    from kvq_core import testing

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(plan.device)

    failures = []
    print("\n== 1. conformance against the NumPy reference on", plan.device)
    for backend, methods in backends.items():
        for method in methods:
            if clock.used() > 0.4 * clock.budget:
                clock.skip(f"conformance {backend}/{method}")
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


def failed(errors: list[str], what: str, exc: BaseException) -> None:
    """A timed item that raised: printed with its traceback's last frames and added to ``errors``."""
    errors.append(f"{what}: {type(exc).__name__}")
    print(f"FAIL {what}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    traceback.print_exc(limit=4)


def release(plan: Plan) -> None:
    """Hands the freed GPU memory of the last shape back (the next shape may be larger)."""
    import torch

    if plan.device == "cuda":
        torch.cuda.empty_cache()


def best(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def _us(t: float | None) -> str:
    return f"{t * 1e6:10.1f}" if t is not None else "         -"


# --------------------------------------------------------------------------------------------
# 2-3. encode and attend
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


def label(tokens: int, batch: int) -> str:
    """``"128k b1"``: a timed shape in the summary."""
    return f"{tokens // 1024}k b{batch}" if tokens >= 1024 else f"{tokens} b{batch}"


def shapes(plan: Plan) -> list[tuple[int, int]]:
    """(tokens, batch) in the order timed: the goal's first, then by size."""
    method, tokens, batch, _ = GOAL
    all_ = sorted(((t, b) for t in plan.tokens for b in plan.batches), key=lambda s: (s[0] * s[1], s))
    goal = (tokens, batch) if (tokens, batch) in all_ else None
    return ([goal] if goal else []) + [s for s in all_ if s != goal]


def benchmarks(plan: Plan, backends: dict[str, list[str]], clock: Clock, reserve: float,
               errors: list[str]) -> list[Row]:
    """Encode throughput and attend vs SDPA while more than ``reserve`` seconds are left; a failing
    item is printed and added to ``errors``."""
    import torch

    from kvq_core import registry
    from kvq_core.api import Quantizer
    from kvq_core.contract import KernelContext

    rows: list[Row] = []
    print(f"\n== 2-3. encode and attend: {plan.kv_heads} KV heads x {plan.head_dim}, GQA {plan.gqa}, bf16 input "
          f"(numba: float16), times per call in microseconds")
    print(f"{'backend':>10} {'method':<11} {'batch':>5} {'tokens':>7} {'encode_us':>10} {'enc_Mtok/s':>10} "
          f"{'attend_us':>10} {'eager_us':>10} {'sdpa_gqa':>10} {'sdpa_fold':>10} {'sdpa/kvq':>8}")
    for tokens, batch in shapes(plan):
        if clock.left() < reserve + 20:
            clock.skip(f"attend tokens={tokens} batch={batch}")
            continue
        q, k, v = _inputs(plan, batch, tokens)
        sdpa_gqa, sdpa_fold = sdpa_times(q, k, v, plan)
        sdpa = best(sdpa_gqa, sdpa_fold)
        for backend, methods in backends.items():
            dtype = getattr(torch, INPUT_DTYPE.get(backend, "bfloat16"))
            qb, kb, vb = (x.to(dtype) for x in (q, k, v))
            for method in methods:
                if method not in METHODS:
                    continue
                if clock.left() < reserve + 15:
                    clock.skip(f"attend {backend}/{method} tokens={tokens} batch={batch}")
                    continue
                try:
                    spec = registry.make_spec(method, head_dim=plan.head_dim, **METHODS[method])
                    quant = Quantizer(spec, backend)
                    reps = max(1, plan.reps // 5)
                    enc = eager_time(lambda: (quant.encode_keys(kb), quant.encode_values(vb)), reps, plan.device)
                    pk, pv = quant.encode_keys(kb), quant.encode_values(vb)
                    ctx = KernelContext(spec, 0, pk.shape, spec.constants(plan.kv_heads, 0))
                    scale = plan.head_dim ** -0.5

                    def attend() -> Any:
                        return quant.kernels.attend(qb, pk.fields, pv.fields, ctx, scale)

                    graph = None if backend in NO_GRAPHS else graph_time(attend, plan.reps, plan.device)
                    eager = eager_time(lambda: quant.attend(qb, pk, pv), plan.reps, plan.device)
                    kvq = best(graph, eager)
                    ratio = sdpa / kvq if sdpa and kvq else float("nan")
                    if sdpa and kvq:
                        rows.append(Row("attend vs SDPA", backend, method, label(tokens, batch), kvq, sdpa))
                    rate = batch * tokens / enc / 1e6
                    print(f"{backend:>10} {method:<11} {batch:>5} {tokens:>7} {_us(enc)} {rate:10.2f} "
                          f"{_us(graph)} {_us(eager)} {_us(sdpa_gqa)} {_us(sdpa_fold)} {ratio:8.2f}", flush=True)
                    del pk, pv
                except Exception as exc:  # noqa: BLE001
                    failed(errors, f"bench {backend}/{method} batch={batch} tokens={tokens}", exc)
            del qb, kb, vb
        del q, k, v
        release(plan)
    return rows


def numba_vs_triton(rows: list[Row]) -> list[Row]:
    """Triton time / numba time per (method, shape) both timed (> 1: numba faster)."""
    times = {(r.backend, r.method, r.shape): r.kvq_s for r in rows}
    return [Row("numba vs triton", "numba", method, shape, t, times[("triton", method, shape)])
            for (backend, method, shape), t in times.items()
            if backend == "numba" and ("triton", method, shape) in times]


# --------------------------------------------------------------------------------------------
# 4. the fused window step (kvq::attend_window)
# --------------------------------------------------------------------------------------------
def window_blocks(tokens: int) -> list[int]:
    """Block lengths of a layer holding ``tokens`` packed tokens: halving, as KVQCache's joins leave them."""
    lens = [tokens // 2, tokens // 4, tokens // 8]
    return [*lens, tokens - sum(lens)]


def window_step(plan: Plan, backends: dict[str, list[str]], clock: Clock, reserve: float,
                errors: list[str]) -> list[Row]:
    """The fused ``attend_window`` of a backend's kernel class (the ``kvq::attend_window`` op's body) vs
    the unfused reference body, while more than ``reserve`` seconds are left, for backends whose
    kernel class fuses it; a failing or disagreeing item is printed and added to ``errors``."""

    from kvq_core import registry
    from kvq_core.api import Quantizer
    from kvq_core.torch_ops import run
    from kvq_core.torch_ops.torch_kernels import context
    from kvq_torch.common import TorchMethod

    shapes_, w = DRY_WINDOW if plan.device == "cpu" else (WINDOW_SHAPES, WINDOW_TOKENS)
    rows: list[Row] = []
    print(f"\n== 4. fused window step: attend_window over 4 packed blocks + a {w}-token window, "
          f"{plan.kv_heads} KV heads x {plan.head_dim}, GQA {plan.gqa}, one query token; unfused = the op's "
          f"reference body (blocks decoded, one softmax); microseconds per call")
    print(f"{'backend':>10} {'method':<11} {'batch':>5} {'tokens':>7} {'fused_us':>10} {'unfused_us':>10} "
          f"{'speedup':>8} {'max_diff':>9}")
    scale = plan.head_dim ** -0.5
    for tokens, batch in shapes_:
        q, k, v = _inputs(plan, batch, tokens + w, seed=2)
        for backend, methods in backends.items():
            for method in methods:
                if method not in METHODS:
                    continue
                spec = registry.make_spec(method, head_dim=plan.head_dim, **METHODS[method])
                impl = run.kernel(backend, spec.to_json())
                if not isinstance(impl, TorchMethod) or type(impl).attend_window is TorchMethod.attend_window:
                    continue  # no fused kernel of its own: the op body is the reference
                if clock.left() < reserve + 15:
                    clock.skip(f"window {backend}/{method} tokens={tokens} batch={batch}")
                    continue
                try:
                    quant = Quantizer(spec, backend)
                    blocks, at = [], 0
                    for n in window_blocks(tokens):
                        blocks.append((quant.encode_keys(k[:, :, at:at + n]), quant.encode_values(v[:, :, at:at + n])))
                        at += n
                    wk, wv = k[:, :, tokens:], v[:, :, tokens:]
                    parts = [(pk.fields, pv.fields, pk.shape[2]) for pk, pv in blocks]
                    ctx = context(spec.to_json(), 0, (batch, plan.kv_heads, tokens, plan.head_dim), q.device)

                    def fused() -> Any:
                        return impl.attend_window(q, parts, wk, wv, ctx, scale)

                    def unfused() -> Any:
                        return TorchMethod.attend_window(impl, q, parts, wk, wv, ctx, scale)

                    diff = (fused()[0].float() - unfused()[0].float()).abs().max().item()
                    t_fused = best(graph_time(fused, plan.reps, plan.device), eager_time(fused, plan.reps, plan.device))
                    t_unfused = best(graph_time(unfused, plan.reps, plan.device),
                                     eager_time(unfused, plan.reps, plan.device))
                    rows.append(Row("fused window", backend, method, label(tokens, batch), t_fused, t_unfused))
                    print(f"{backend:>10} {method:<11} {batch:>5} {tokens:>7} {_us(t_fused)} {_us(t_unfused)} "
                          f"{t_unfused / t_fused:8.2f} {diff:9.2e}", flush=True)
                    if not diff <= 1e-3:  # float32 outputs (tf32x3 products)
                        errors.append(f"window {backend}/{method} batch={batch} tokens={tokens}: max diff {diff:.3g}")
                    del blocks, parts
                except Exception as exc:  # noqa: BLE001
                    failed(errors, f"window {backend}/{method} batch={batch} tokens={tokens}", exc)
        del q, k, v
        release(plan)
    return rows


# --------------------------------------------------------------------------------------------
# 5. paged decode (the serving issue's kvq::attend_paged)
# --------------------------------------------------------------------------------------------
def paged_op() -> Any:
    """``torch.ops.kvq.attend_paged`` when this checkout has it (and its test cases), else None."""
    import torch

    try:
        import kvq_core.torch_ops.ops  # noqa: F401 - defines the kvq:: ops
        import kvq_core.testing.paged  # noqa: F401 - paged_case
    except ImportError:
        return None
    return getattr(torch.ops.kvq, "attend_paged", None)


def paged_backends(spec: Any, backends: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(backend, label) timed: every GPU backend with a paged kernel of its own for the spec, and
    the torch fallback (the op bodies serve a backend without one by it)."""
    from kvq_core.torch_ops import run

    fallback = type(run.paged_kernel(run.PAGED_FALLBACK, spec.to_json()))
    out = [(b, b) for b in backends if b != run.PAGED_FALLBACK and _paged_impl(run, b, spec) not in (None, fallback)]
    return [*out, (run.PAGED_FALLBACK, f"{run.PAGED_FALLBACK} (fallback)")]


def _paged_impl(run: Any, backend: str, spec: Any) -> type | None:
    """The class of ``backend``'s paged kernel for the spec (the fallback's when it has none)."""
    try:
        return type(run.paged_kernel(backend, spec.to_json()))
    except Exception:  # noqa: BLE001 - no paged kernel at all
        return None


def paged(plan: Plan, backends: dict[str, list[str]], clock: Clock, op: Any, errors: list[str],
          reserve: float) -> list[Row]:
    """``kvq::attend_paged`` decode steps (one query token per request) vs SDPA on the padded batch,
    while more than ``reserve`` seconds are left; a failing item is printed and added to ``errors``."""
    import numpy as np

    from kvq_core import registry
    from kvq_core.api import Quantizer
    from kvq_core.testing.paged import paged_case

    method, params = PAGED_SPEC
    spec = registry.make_spec(method, head_dim=plan.head_dim, **params)
    timed = paged_backends(spec, backends)
    rows: list[Row] = []
    hk, hq, d = plan.kv_heads, plan.kv_heads * plan.gqa, plan.head_dim
    print(f"\n== 5. paged decode: kvq::attend_paged, {method} {params}, {hk} KV heads x {d}, GQA {plan.gqa}, "
          f"context lengths drawn in {list(plan.paged_lens)}; SDPA over the batch padded to its longest; "
          f"microseconds per step")
    print(f"{'backend':>18} {'batch':>5} {'page':>4} {'tokens':>8} {'max_len':>7} {'paged_us':>10} "
          f"{'sdpa_pad':>10} {'sdpa/kvq':>8}")
    encoder = Quantizer(spec, "torch")
    for batch in plan.paged_batches:
        for page in plan.page_sizes:
            if clock.left() < reserve + 15:
                clock.skip(f"paged batch={batch} page={page}")
                continue
            rng = np.random.default_rng(batch * 100 + page)
            lo, hi = plan.paged_lens
            lens = [int(n) for n in rng.integers(lo // 16, hi // 16 + 1, batch) * 16]
            case = paged_case(encoder, block_size=page, kv_heads=hk, q_heads=hq, code_lens=lens, q_lens=[1] * batch,
                              seed=batch + page, device=plan.device)
            q, kpad, vpad = _inputs(plan, batch, max(lens), seed=1)
            sdpa_gqa, sdpa_fold = sdpa_times(q, kpad, vpad, plan)
            sdpa = best(sdpa_gqa, sdpa_fold)
            del kpad, vpad
            for backend, label in timed:
                if clock.left() < reserve + 10:
                    clock.skip(f"paged {label} batch={batch} page={page}")
                    continue
                try:
                    def step(backend=backend) -> Any:
                        return op(backend, spec.to_json(), 0, *case.args(), d ** -0.5, None, None, None, None)

                    t = best(None if backend in NO_GRAPHS else graph_time(step, plan.reps, plan.device),
                             eager_time(step, plan.reps, plan.device))
                    ratio = sdpa / t if sdpa and t else float("nan")
                    if sdpa and t:
                        rows.append(Row("paged decode", label, method, f"b{batch} p{page} mixed", t, sdpa))
                    print(f"{label:>18} {batch:>5} {page:>4} {sum(lens):>8} {max(lens):>7} {_us(t)} {_us(sdpa)} "
                          f"{ratio:8.2f}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    failed(errors, f"paged {label} batch={batch} page={page}", exc)
            del case
            release(plan)
    return rows


# --------------------------------------------------------------------------------------------
# 6. model decode (KVQCache in a transformers model on the GPU)
# --------------------------------------------------------------------------------------------
def model_decode(plan: Plan, clock: Clock, errors: list[str]) -> list[Row]:
    """Greedy decode steps of a random-weight Llama through DynamicCache and KVQCache (Triton), per
    prompt shape, while time is left; a failing cache is printed and added to ``errors``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvq_core.integrations.hf import register
    from kvq_core.integrations.hf.cache_arg import cache_kwargs
    from kvq_core.tools.bench.decode import attn_impl, greedy_step
    from kvq_core.tools.eval.caches import build_cache, parse_config, stored

    dims, shapes_, steps = DRY_MODEL if plan.device == "cpu" else (MODEL, MODEL_SHAPES, MODEL_STEPS)
    register()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if plan.device == "cuda" else torch.float32
    model = LlamaForCausalLM(LlamaConfig(**dims)).to(device=plan.device, dtype=dtype).eval()
    kv, d = dims["num_key_value_heads"], dims["head_dim"]
    rows: list[Row] = []
    print(f"\n== 6. model decode: a random-weight Llama, {dims['num_hidden_layers']} layers, {kv} KV heads x {d}, "
          f"GQA {dims['num_attention_heads'] // kv}, {dtype}; KVQCache on {MODEL_BACKEND}; median of {steps} greedy "
          f"steps (milliseconds); logits of the first step against DynamicCache's")
    print(f"{'cache':<16} {'batch':>5} {'tokens':>7} {'prefill_s':>9} {'step_ms':>9} {'vs_fp':>6} {'kv_MB':>9} "
          f"{'kv/fp':>6} {'rel_err':>8} {'argmax':>7}")
    for tokens, batch in shapes_:
        ids = torch.randint(0, dims["vocab_size"], (batch, tokens), device=plan.device)
        ref: dict[str, Any] = {}
        for text in MODEL_CONFIGS:
            if clock.left() < 10:
                clock.skip(f"model {text} tokens={tokens} batch={batch}")
                continue
            cfg = parse_config(text)
            cache = None
            try:
                model.set_attn_implementation(attn_impl(cfg))
                cache = build_cache(cfg, model.config, backend=MODEL_BACKEND, attention="codes")
                with torch.no_grad():
                    t0 = time.perf_counter()
                    tok = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
                    _sync(plan.device)
                    prefill = time.perf_counter() - t0
                    first = model(tok, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].float()
                    tok = first.argmax(-1, keepdim=True)
                    times = []
                    for _ in range(steps + 1):  # the first: warm-up
                        t0 = time.perf_counter()
                        tok = greedy_step(model, tok, cache)
                        _sync(plan.device)
                        times.append(time.perf_counter() - t0)
                step = statistics.median(times[1:])
                nbytes = stored(cache, 2 * batch * kv * d)["bytes"]
                if cfg.kind == "fp":
                    ref = {"step": step, "bytes": nbytes, "logits": first}
                    rel, same = 0.0, 1.0
                else:
                    rows.append(Row("model decode", MODEL_BACKEND, cfg.label, label(tokens, batch), step, ref["step"]))
                    rel = ((first - ref["logits"]).norm() / ref["logits"].norm()).item()
                    same = (first.argmax(-1) == ref["logits"].argmax(-1)).float().mean().item()
                vs = ref["step"] / step if ref else float("nan")
                ratio_b = nbytes / ref["bytes"] if ref else float("nan")
                print(f"{cfg.label:<16} {batch:>5} {tokens:>7} {prefill:9.2f} {step * 1e3:9.3f} {vs:6.2f} "
                      f"{nbytes / 1e6:9.1f} {ratio_b:6.3f} {rel:8.2e} {same:7.2f}", flush=True)
            except Exception as exc:  # noqa: BLE001
                failed(errors, f"model {cfg.label} batch={batch} tokens={tokens}", exc)
            del cache
            release(plan)
        del ids
    return rows


def summary(rows: list[Row], clock: Clock) -> None:
    """The one table of ratios, then what the budget skipped."""
    print("\n== summary: reference time / kvq time (> 1: kvq faster; numba vs triton: triton time / numba time; "
          "fused window: unfused time / fused time)")
    print(f"{'section':<16} {'backend':<18} {'method':<11} {'shape':<14} {'kvq_us':>10} {'ref_us':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r.section:<16} {r.backend:<18} {r.method:<11} {r.shape:<14} {_us(r.kvq_s)} {_us(r.ref_s)} "
              f"{r.ratio:7.2f}")
    if not rows:
        print("(nothing timed)")
    print(f"\nskipped by the budget: {len(clock.skipped)}" + "".join(f"\n  {s}" for s in clock.skipped))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # the real run compiles every kernel
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
    op = paged_op()
    print("paged decode step:", "kvq::attend_paged found" if op is not None else
          "skipped (no torch.ops.kvq.attend_paged in this checkout)")
    failures = conformance(plan, backends, clock)
    model_reserve = 0.15 * clock.budget if MODEL_BACKEND in backends else 0.0
    reserve = model_reserve + (0.25 * clock.budget if op is not None else 0.0)
    errors: list[str] = []
    rows = benchmarks(plan, backends, clock, reserve + 0.1 * clock.budget, errors)
    rows += numba_vs_triton(rows)
    rows += window_step(plan, backends, clock, reserve, errors)
    if op is not None:
        rows += paged(plan, backends, clock, op, errors, model_reserve)
    if model_reserve:
        rows += model_decode(plan, clock, errors)

    method, tokens, batch, want = GOAL
    if args.dry_run:
        tokens = plan.tokens[-1]
    got = next((r.ratio for r in rows if r.section == "attend vs SDPA" and r.backend == "triton"
                and r.method == method and r.shape == label(tokens, batch)), None)
    summary(rows, clock)
    if got is not None:
        verdict = "PASS" if got >= want else "MISS"
        note = " (dry run: shapes differ, not meaningful)" if args.dry_run else ""
        print(f"\nGOAL {method} INT2 attend >= {want:g}x SDPA bf16 at {tokens} tokens, batch {batch}: "
              f"{got:.2f}x {verdict}{note}")
    else:
        print(f"\nGOAL {method} INT2 attend at {tokens} tokens, batch {batch}: not measured")
    print(f"\nconformance failures: {len(failures)}")
    for f in failures:
        print("  " + f[:500])
    print(f"time left in the budget: {clock.left():.0f}s")
    print(f"timing failures: {len(errors)}")
    for e in errors:
        print("  " + e)
    return 1 if failures or errors else 0


if __name__ == "__main__":
    sys.exit(main())
