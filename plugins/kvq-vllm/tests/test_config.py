"""Codec settings (no vLLM): additional_config first, $KVQ_VLLM as fallback, errors naming the value."""
from __future__ import annotations

import pytest

from kvq_core.errors import SpecError
from kvq_vllm.config import ENV, from_vllm, parse, tp_head_offset


def test_additional_config_gives_the_spec_with_the_models_head_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, '{"method": "fp16"}')
    codec = from_vllm({"kvq": {"method": "octopus", "bits": 3}})
    assert (codec.method, codec.backend) == ("octopus", "auto")
    spec = codec.spec(64)
    assert (spec.method, spec.bits, spec.head_dim) == ("octopus", 3, 64)


def test_environment_is_the_fallback_and_none_means_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert from_vllm({}) is None and from_vllm(None) is None
    monkeypatch.setenv(ENV, '{"method": "turboquant", "bits": 3, "backend": "torch-compiled"}')
    codec = from_vllm({"other": 1})
    assert (codec.method, dict(codec.params), codec.backend) == ("turboquant", {"bits": 3}, "torch-compiled")


@pytest.mark.parametrize("settings,named", [
    ({"method": "octopus", "bits": 9}, "bits"),
    ({"method": "octopus", "head_dim": 64}, "head_dim"),
    ({"bits": 3}, "additional_config"),
    ("{not json", "additional_config"),
])
def test_bad_settings_name_what_is_wrong(settings: object, named: str) -> None:
    with pytest.raises(SpecError, match=named):
        parse(settings, 'additional_config["kvq"]')


def test_tp_head_offset_follows_vllms_sharding() -> None:
    """Partitioned heads: rank r starts at r * heads / tp; fewer heads than ranks: each head is replicated
    on tp / heads consecutive ranks (vLLM's QKVParallelLinear shard_rank = tp_rank // replicas)."""
    assert [tp_head_offset(r, 1, 3) for r in range(1)] == [0]
    assert [tp_head_offset(r, 2, 4) for r in range(2)] == [0, 2]
    assert [tp_head_offset(r, 4, 8) for r in range(4)] == [0, 2, 4, 6]
    assert [tp_head_offset(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [tp_head_offset(r, 8, 1) for r in range(8)] == [0] * 8
    with pytest.raises(SpecError, match="tensor_parallel_size=2"):
        tp_head_offset(0, 2, 3)
    with pytest.raises(SpecError, match="tp_rank=2"):
        tp_head_offset(2, 2, 4)
