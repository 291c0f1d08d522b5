"""Sliding-window layers in kvq codes: the eviction plan (plain integers) and, with the exact
fp16 codec, the K/V and mask sizes a KVQLayer hands the model equal transformers'
DynamicSlidingWindowLayer step for step, for both flush policies and any residual."""
from __future__ import annotations

import warnings

import pytest

from kvq_core.integrations.hf.window import Eviction, plan_eviction, view_start

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_view_start():
    assert [view_start(n, 4) for n in (0, 1, 3, 4, 5, 10)] == [0, 0, 0, 1, 2, 7]
    assert view_start(100, None) == 0


@pytest.mark.parametrize(
    ("blocks", "evicted", "target", "granule", "expected"),
    [
        ((4, 4), 0, 0, 1, Eviction(0, 0, 0)),  # nothing to drop
        ((4, 4), 0, 4, 0, Eviction(1, 0, 4)),  # exactly one whole block
        ((4, 4), 0, 6, 1, Eviction(1, 2, 6)),  # per-token: cut inside the second block
        ((4, 4), 0, 6, 0, Eviction(1, 0, 4)),  # a layout that never splits: the straddling block stays whole
        ((4, 8), 0, 11, 2, Eviction(1, 6, 10)),  # token groups of 2: cut after the last whole group
        ((4, 8), 0, 9, 4, Eviction(1, 4, 8)),
        ((4, 8), 0, 7, 4, Eviction(1, 0, 4)),  # no whole group of the straddling block is out yet
        ((4, 4), 0, 11, 0, Eviction(2, 0, 11)),  # past every block: window tokens go too
        ((3,), 5, 7, 1, Eviction(0, 2, 7)),  # blocks start at the previous eviction
        ((), 2, 9, 0, Eviction(0, 0, 9)),
    ],
)
def test_plan_eviction(blocks, evicted, target, granule, expected):
    assert plan_eviction(blocks, evicted, target, granule) == expected


@pytest.mark.parametrize("flush", ["block", "sliding"])
@pytest.mark.parametrize("residual", [0, 1, 3, 8, 20])
@pytest.mark.parametrize("window", [2, 5, 12])  # (window 1 hits a transformers slicing quirk: -0)
def test_fp16_layer_matches_dynamic_sliding_window_layer(flush, residual, window):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from kvq_core import make_spec
    from kvq_core.integrations.hf import KVQLayer

    spec = make_spec("fp16", head_dim=16, storage="float32")
    ours = KVQLayer(spec, spec, layer_idx=0, backend="numpy", residual=residual, flush=flush, sliding_window=window,
                    attention="dequant")
    ref = DynamicSlidingWindowLayer(sliding_window=window)
    g = torch.Generator().manual_seed(residual * 100 + window)
    for step in (7, 1, 1, 3, 1, 1, 1, 9, 1, 1):
        k, v = torch.randn(2, 2, step, 16, generator=g), torch.randn(2, 2, step, 16, generator=g)
        assert ours.get_mask_sizes(step) == ref.get_mask_sizes(step)
        got, want = ours.update(k, v), ref.update(k, v)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert ours.get_seq_length() == ref.get_seq_length()
        stored = ours.cumulative_length - ours.evicted
        assert stored == min(ours.cumulative_length, window - 1)  # per-token codec: exactly the window
        assert ours.packed_length - ours.evicted == sum(ours.block_tokens)
        assert ours.packed_bytes == sum(pk.nbytes() + pv.nbytes() for pk, pv in ours.blocks)  # kept by difference


@pytest.mark.parametrize("backend", ["numpy", "auto"])
@pytest.mark.parametrize("method", ["oscar", "kivi"])
def test_a_hybrid_model_reads_sliding_layers_from_codes_with_at_most_one_decoded_group(method, backend):
    """A Gemma-3-style model (5 sliding layers to 1 global, head_dim 64, 1 KV head) under the default
    attention: where a window edge falls inside a token group, that group alone is decoded (its
    hidden tokens left out) and the rest is read from codes, so no layer ever holds more than one
    decoded group, and every step's logits equal dequant mode's (decoded history, model's own sdpa)."""
    import transformers as tf

    from kvq_core.integrations.hf import KVQCache, cache_kwargs

    window, group = 40, 32
    config = tf.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        sliding_window=window, layer_types=["sliding_attention"] * 5 + ["full_attention"], num_hidden_layers=6,
        vocab_size=128, pad_token_id=0, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(1))
    group_bytes = 1 * 1 * group * (64 + 64) * 4  # batch x kv heads x group tokens x (K + V dims) x float32
    logits = {}
    for attention in ("dequant", "auto"):
        model.config._attn_implementation = "sdpa"
        cache = KVQCache(model.config, method, backend=backend, bits=2, residual=8, attention=attention)
        steps, peak = [], 0
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(ids, **cache_kwargs(model, cache))
            for _ in range(48):  # the window edge crosses two group boundaries
                steps.append(out.logits[:, -1])
                out = model(steps[-1].argmax(-1, keepdim=True), **cache_kwargs(model, cache))
                peak = max(peak, *(layer.decoded_bytes() for layer in cache.kvq_layers[:5]))
        logits[attention] = torch.stack(steps)
        if attention == "auto":
            assert model.config._attn_implementation == "kvq" and all(layer.codes_mode for layer in cache.kvq_layers)
            assert 0 < peak <= group_bytes, peak  # an edge group was decoded, never more than one per layer
            assert cache.kvq_layers[5].decoded_bytes() == 0
    torch.testing.assert_close(logits["auto"], logits["dequant"], rtol=1e-4, atol=1e-4)
