"""The vLLM plugin's cache write per layer and step on the CPU: ``kvq::write_paged`` on numba (one
call: the numba encoders, the row bytes written straight into the pages) against the write it
replaces (``kvq::encode`` of K and V through the plugin's numba adapter as field tensors,
``PageLayout.pack``, an index scatter by the slots) and the torch backend's ``kvq::write_paged`` (the reference).

    python bench/paged_write.py [--repeats 7] [--out bench/results/paged_write.md]

Shape: SmolLM2-135M (3 KV heads, head_dim 64), token-major pages of 32 tokens, float32 K/V.
Per-token codecs (OCTOPUS): a decode step of 8 tokens and a 512-token prefill chunk; token-group
codecs (OScaR, KIVI): one 32-token group completing, and a 512-token chunk (16 groups). Each repeat
times every path in turn over many calls; figures are medians over the repeats, microseconds per
call of the process's CPU time (on the shared 2-core machine wall time mostly measures the other
processes) and of wall time. Last, the token-group codecs' staging copy per layer of a decode step
of 8 requests (``kvq_vllm.plan.stage_tokens`` of K and V; the plan is built once per step). Prints
the CPU capability and ``uptime`` with the figures. Run with ``PYTHONPATH`` naming another tree's
``.`` and ``backends`` to time that tree's kernels with the same script (before/after).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import kvq_core
import kvq_core.torch_ops.ops  # noqa: F401
from kvq_core import registry
from kvq_core.constants import constants
from kvq_core.torch_ops.torch_kernels import context, field_names, spec_from_json
from kvq_core.contract import KernelContext
from kvq_core.paged import PageLayout, step_blocks
from kvq_torch.common import TorchMethod

HK, D, PAGE, BLOCKS, LAYER = 3, 64, 32, 256, 7
CODECS = [("octopus", {"bits": 3}, (8, 512)), ("oscar", {"bits": 2}, (32, 512)), ("kivi", {"bits": 2}, (32, 512))]


class _BeforeEncode(TorchMethod):
    """The plugin's encode adapter before ``kvq::write_paged`` (``kvq_vllm/numba_encode.py``): a
    ``kvq::encode`` kernel running the numba kernels on NumPy views, fields back as tensors."""

    def __init__(self, spec) -> None:  # noqa: ANN001
        super().__init__(spec)
        self.kernels = registry.kernel_factory("numba", spec.method)(spec)

    def _run(self, encode, x: torch.Tensor, ctx) -> dict:  # noqa: ANN001
        arr = x.detach().to(torch.float32).numpy()
        shape = tuple(int(s) for s in x.shape)
        fields = encode(arr, KernelContext(self.spec, ctx.layer, shape, constants(self.spec, shape[1], ctx.layer)))
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in fields.items()}

    def encode_keys(self, k: torch.Tensor, ctx) -> dict:  # noqa: ANN001
        return self._run(self.kernels.encode_keys, k, ctx)

    def encode_values(self, v: torch.Tensor, ctx) -> dict:  # noqa: ANN001
        return self._run(self.kernels.encode_values, v, ctx)


@functools.lru_cache(maxsize=None)
def _before_kernel(spec_json: str) -> _BeforeEncode:
    return _BeforeEncode(spec_from_json(spec_json))


@torch.library.custom_op("kvq_bench::encode_before", mutates_args=())
def encode_before(spec_json: str, layer: int, kind: str, x: torch.Tensor) -> list[torch.Tensor]:
    """``kvq::encode``'s body (:func:`kvq_core.torch_ops.run.encode`) with the adapter above as the
    kernel: the op the plugin called before (its backend entry is gone from kvq)."""
    impl = _before_kernel(spec_json)
    ctx = context(spec_json, layer, x.shape, x.device)
    fields = impl.encode_keys(x, ctx) if kind == "keys" else impl.encode_values(x, ctx)
    return [fields[name].contiguous() for name in field_names(impl.spec, kind)]


def before(spec, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor):  # noqa: ANN001
    """The plugin's write before ``kvq::write_paged``: ``kvq::encode`` of K and V (the adapter above),
    ``PageLayout.pack``, an index scatter (padding clamped into block 0)."""
    layout = PageLayout(spec, PAGE, HK)
    names = {kind: field_names(spec, kind) for kind in ("keys", "values")}
    spec_json = spec.to_json()

    def encode(kind: str, x: torch.Tensor) -> dict:
        return dict(zip(names[kind], encode_before(spec_json, LAYER, kind, x)))

    def run() -> None:
        k, v = step_blocks(key, layout.group), step_blocks(value, layout.group)
        rows = layout.pack(encode("keys", k), encode("values", v))
        at = slots.to(torch.long).clamp(min=0)
        pages[at // PAGE, :, at % PAGE] = rows.permute(0, 2, 1, 3).reshape(-1, HK, layout.row_bytes)
    return run


def per_call_us(fn, calls: int) -> tuple[float, float]:  # noqa: ANN001
    """(CPU, wall) microseconds per call over ``calls`` calls."""
    c, t = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.process_time() - c) / calls * 1e6, (time.perf_counter() - t) / calls * 1e6


def staging_us(repeats: int, requests: int = 8, group: int = 32) -> tuple[float, float]:
    """Median (CPU, wall) us of one layer's staging copy (K and V) in a decode step of ``requests``
    requests whose open groups already have their slots."""
    sys.path.insert(0, str(Path(kvq_core.__file__).resolve().parents[1] / "plugins" / "kvq-vllm"))  # kvq_core's tree
    from kvq_vllm.plan import StagingPool, plan_step, stage_tokens

    pool = StagingPool(requests + 4)
    seq = np.array([70 + 5 * r for r in range(requests)])  # after the step; no group completes
    table = np.arange(requests * 4).reshape(requests, 4)
    start = (seq - 1) // group * group
    plan_step(pool, group, PAGE * 2, np.concatenate([[0], np.cumsum(seq - 1 - start)]), seq - 1, table)  # the open groups
    plan = plan_step(pool, group, PAGE * 2, np.arange(requests + 1), seq, table)
    tail_k, tail_v = (torch.zeros(requests + 4, HK, group, D) for _ in range(2))
    qkv = torch.randn(requests, 3 * HK * D)
    key, value = qkv[:, HK * D:2 * HK * D].view(requests, HK, D), qkv[:, 2 * HK * D:].view(requests, HK, D)

    def run() -> None:
        stage_tokens(plan, tail_k, key)
        stage_tokens(plan, tail_v, value)
    per_call_us(run, 10)
    times = [per_call_us(run, 4000) for _ in range(repeats)]
    return statistics.median(c for c, _ in times), statistics.median(w for _, w in times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/paged_write.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines = [f"cpu capability {torch.backends.cpu.get_cpu_capability()}, torch threads 1; uptime: {uptime}", "",
             "CPU us per call (wall us in brackets)", "",
             "| codec | tokens | before | write_paged numba | write_paged torch | before / numba (CPU) |",
             "|---|---:|---:|---:|---:|---:|"]
    print(lines[0])
    rng = np.random.default_rng(0)
    for method, params, sizes in CODECS:
        spec = kvq_core.make_spec(method, head_dim=D, **params)
        layout = PageLayout(spec, PAGE, HK)
        pages = torch.zeros(BLOCKS, PAGE, HK, layout.row_bytes, dtype=torch.uint8).permute(0, 2, 1, 3)
        for n in sizes:
            # a decode step: tokens of different requests at scattered slots; a group or a chunk: consecutive slots
            if layout.group == 1 and n < PAGE:
                slots = torch.from_numpy(rng.permutation(BLOCKS * PAGE)[:n])
            else:
                slots = torch.arange(n) + PAGE * int(rng.integers(1, BLOCKS - n // PAGE - 1))
            qkv = torch.randn(n, 3 * HK * D)  # K and V are views of the model's qkv output, as in vLLM
            key, value = qkv[:, HK * D:2 * HK * D].view(n, HK, D), qkv[:, 2 * HK * D:].view(n, HK, D)
            spec_json = spec.to_json()  # once, as the plugin does
            paths = {
                "before": before(spec, key, value, pages, slots),
                "numba": lambda: torch.ops.kvq.write_paged("numba", spec_json, LAYER, key, value, pages, slots),
                "torch": lambda: torch.ops.kvq.write_paged("torch", spec_json, LAYER, key, value, pages, slots),
            }
            calls = 400 if n < 64 else 40
            for fn in paths.values():
                per_call_us(fn, 3)  # compile / warm up
            times = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, fn in paths.items():
                    times[name].append(per_call_us(fn, calls))
            cpu = {name: statistics.median(c for c, _ in t) for name, t in times.items()}
            wall = {name: statistics.median(w for _, w in t) for name, t in times.items()}
            ratio = statistics.median(b[0] / f[0] for b, f in zip(times["before"], times["numba"]))
            cell = {name: f"{cpu[name]:.1f} ({wall[name]:.0f})" for name in paths}
            line = (f"| {method}-{params['bits']} | {n} | {cell['before']} | {cell['numba']} | {cell['torch']} | "
                    f"{ratio:.2f}x |")
            lines.append(line)
            print(line, flush=True)
    stage = staging_us(args.repeats)
    lines += ["", f"staging of 8 decode tokens per layer, K and V (kvq_vllm.plan.stage_tokens): CPU {stage[0]:.1f} us "
              f"(wall {stage[1]:.1f})"]
    print(lines[-1])
    lines.append("")
    lines.append(f"uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
