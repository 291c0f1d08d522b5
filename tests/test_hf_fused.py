"""The "kvq" attention function's fused decode step and its prefill, on a tiny llama GGUF.

- A codes-mode step with packed blocks makes one ``Quantizer.attend_window`` call per layer
  (numba on the CPU: every block and the exact window in one online softmax; torch: one
  ``kvq::attend_window`` op, the reference), never a per-block ``attend`` and merge, and its
  logits equal the merge path's.
- A step whose K/V are all exact (the prefill) runs transformers' sdpa: no logits materialised.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
pytest.importorskip("numba")

sys.path.insert(0, str(Path(__file__).parent))
from tiny_gguf import load_tiny_llama  # noqa: E402

from kvq_core.api import Quantizer  # noqa: E402
from kvq_core.integrations.hf import KVQCache, cache_kwargs, register  # noqa: E402
from kvq_core.integrations.hf import attention as kvq_attention  # noqa: E402

from transformers import DynamicCache  # noqa: E402

transformers.logging.set_verbosity_error()
register()

#: OScaR INT2 and KIVI INT4 take the numba vector kernel at head_dim 32; OCTOPUS any head_dim
FUSED = [("oscar", {"bits": 2}), ("octopus", {"bits": 3}), ("kivi", {"bits": 4})]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = load_tiny_llama(tmp_path_factory.mktemp("gguf32"), head_dim=32, seed=1, name="tiny-hd32.gguf")
    m.set_attn_implementation("kvq")
    yield m
    m.set_attn_implementation("sdpa")


def _ids(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


class _Calls:
    """Counts calls of Quantizer methods (the real ones run)."""

    def __init__(self, monkeypatch):
        self.n = {"attend": 0, "attend_window": 0}
        for name in self.n:
            real = getattr(Quantizer, name)

            def counted(q, *args, _real=real, _name=name, **kwargs):
                self.n[_name] += 1
                return _real(q, *args, **kwargs)
            monkeypatch.setattr(Quantizer, name, counted)


def _steps(model, cache, ids, prompt):
    """Logits of a prefill of ``prompt`` tokens, then one decode step per remaining token."""
    with torch.no_grad():
        out = [model(ids[:, :prompt], **cache_kwargs(model, cache)).logits[:, -1:]]
        for i in range(prompt, ids.shape[1]):
            out.append(model(ids[:, i:i + 1], **cache_kwargs(model, cache)).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("method,params", FUSED)
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_one_kernel_call_per_layer_and_step_equal_to_the_merge_path(model, monkeypatch, backend, method, params):
    """Every layer of every decode step makes one fused call, and the per-block attend + merge path gives
    the same attention output on the same cache state (both computed at each layer; comparing two whole
    runs instead lets a 1e-5 difference flip a code in a later flush, which moved logits by 6e-3 on an
    AVX-512 Xeon)."""
    ids = _ids(60, seed=3)
    layers = model.config.num_hidden_layers
    cache = KVQCache(model.config, method, backend, residual=8, stride=1, **params)  # stride 1: several blocks
    calls = _Calls(monkeypatch)
    real = kvq_attention.attend_codes
    diffs, merge_calls = [], []

    def both(query, key, value, ctx, mask, scale):
        fused = real(query, key, value, ctx, mask, scale)
        before = dict(calls.n)
        with monkeypatch.context() as m:
            m.setattr(Quantizer, "fuses_window", lambda self, q: False)  # the per-block attend + merge path
            merged = real(query, key, value, ctx, mask, scale)
        merge_calls.append(calls.n["attend"] - before["attend"])
        calls.n.update(before)  # count the fused path's calls only
        diffs.append(float((fused - merged).abs().max() / merged.abs().max()))
        return fused
    monkeypatch.setattr(kvq_attention, "attend_codes", both)
    _steps(model, cache, ids, 36)
    steps = ids.shape[1] - 36
    assert len(cache.layers[0].blocks) >= 2  # several blocks (the window flushes every 8 tokens)
    assert calls.n == {"attend": 0, "attend_window": layers * steps}
    assert len(diffs) == layers * steps and min(merge_calls) >= 1
    assert max(diffs) < 2e-5, max(diffs)


def test_a_layer_checks_its_blocks_once_per_flush(model, monkeypatch):
    """Decode steps between two flushes reuse the layer's plan of its blocks (``Quantizer.plan_window``: the
    blocks checked and converted once); a flush, which changes the blocks, makes a new one."""
    made = []
    real = Quantizer.plan_window
    monkeypatch.setattr(Quantizer, "plan_window", lambda q, blocks, **kw: made.append(q.layer) or real(q, blocks, **kw))
    cache = KVQCache(model.config, "oscar", "numba", residual=8, bits=2)
    ids = _ids(60, seed=4)
    joins = 0
    with torch.no_grad():
        model(ids[:, :36], **cache_kwargs(model, cache))
        for i in range(36, ids.shape[1]):
            first = cache.layers[0]
            blocks, packed = len(first.blocks), first.packed_length
            model(ids[:, i:i + 1], **cache_kwargs(model, cache))
            joins += first.packed_length > packed and len(first.blocks) <= blocks  # flushed, and joined
            for layer in cache.layers:  # a plan never outlives a block it holds (a join frees the joined blocks)
                plan = layer._plan
                assert plan is None or all(any(pk is b for b, _ in layer.blocks) for pk, _ in plan.pairs)
    layers, steps = model.config.num_hidden_layers, ids.shape[1] - 36
    flushes = steps // 8 + 1
    assert joins >= 1 and sorted(set(made)) == list(range(layers))
    assert len(made) <= layers * flushes < layers * steps, (len(made), layers, flushes, steps)


def test_a_chunk_over_packed_blocks_is_fused_and_causal(model, monkeypatch):
    """A multi-token step over packed history (chunked prefill): one call, causal in the window."""
    ids = _ids(50, seed=5)
    logits = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Quantizer, "fuses_window", lambda self, q: False)
        cache = KVQCache(model.config, "oscar", "numba", residual=8, bits=2)
        calls = _Calls(monkeypatch)
        with torch.no_grad():
            model(ids[:, :30], **cache_kwargs(model, cache))
            logits[fused] = model(ids[:, 30:], **cache_kwargs(model, cache)).logits
        assert calls.n["attend_window"] == (model.config.num_hidden_layers if fused else 0)
    assert torch.allclose(logits[True], logits[False], atol=1e-4, rtol=1e-4)


def _largest_allocation(model, cache, ids):
    """The largest CPU memory any single op of the forward allocated (torch profiler), bytes."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(ids, **cache_kwargs(model, cache))
    return max(e.self_cpu_memory_usage for e in prof.key_averages())


def test_prefill_runs_sdpa_without_materialising_logits(model, monkeypatch):
    ids = _ids(8192, seed=7)
    cfg = model.config
    called = []
    monkeypatch.setattr(kvq_attention, "attend_codes", lambda *a, **k: called.append(1))
    kvq = _largest_allocation(model, KVQCache(cfg, "oscar", "numba", residual=128, bits=2), ids)
    assert not called  # the prefill never reached the codes path
    model.set_attn_implementation("sdpa")
    try:
        sdpa = _largest_allocation(model, DynamicCache(config=cfg), ids)
    finally:
        model.set_attn_implementation("kvq")
    logits_bytes = 4 * cfg.num_attention_heads * ids.shape[1] ** 2  # one layer's float32 logits: 1 GiB here
    assert kvq <= 1.25 * sdpa + (1 << 20), (kvq, sdpa)
    assert kvq < logits_bytes / 8, (kvq, logits_bytes)
