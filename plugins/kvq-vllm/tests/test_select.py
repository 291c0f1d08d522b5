"""What vLLM's CPU_ATTN entry resolves to with the plugin installed (needs vLLM; no engine)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from kvq_vllm import config, plugin  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_seen", [])
    monkeypatch.delenv(config.ENV, raising=False)
    plugin.register()


def test_entries_point_at_the_plugin() -> None:
    assert AttentionBackendEnum.CUSTOM.get_path() == "kvq_vllm.backend.KVQAttentionBackend"
    assert AttentionBackendEnum.CPU_ATTN.get_path() == "kvq_vllm.select.CPUBackend"


def test_without_kvq_settings_cpu_attn_is_vllms_own() -> None:
    assert AttentionBackendEnum.CPU_ATTN.get_class().__name__ == "CPUAttentionBackend"


def test_with_kvq_settings_cpu_attn_is_kvq_with_packed_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    monkeypatch.setenv(config.ENV, '{"method": "octopus", "bits": 3}')
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend.__name__ == "KVQAttentionBackend" and backend.get_name() == "CUSTOM"
    spec = FullAttentionSpec(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.float32)
    packed = backend.customize_spec(spec)
    assert packed.dtype == torch.uint8 and packed.state_content_bytes == 2 * (28 + 4)
    assert spec.page_size_bytes / packed.page_size_bytes == 8.0
    assert [backend.supports_head_size(d) for d in (64, 96, 128, 72, 8)] == [True, True, True, False, False]


def test_what_kvq_cannot_serve_is_a_spec_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvq_core.errors import SpecError
    from kvq_vllm.backend import KVQAttentionBackend, KVQAttentionImpl

    with pytest.raises(SpecError, match="sliding_window"):
        KVQAttentionImpl(9, 64, 0.125, 3, sliding_window=16)
    with pytest.raises(SpecError, match="kv_cache_dtype"):
        KVQAttentionImpl(9, 64, 0.125, 3, kv_cache_dtype="fp8")
    monkeypatch.setenv(config.ENV, '{"method": "oscar", "bits": 2}')
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    with pytest.raises(SpecError, match="block_size"):  # OScaR's 32-token key groups would straddle pages
        KVQAttentionBackend.customize_spec(spec)
    packed = KVQAttentionBackend.customize_spec(FullAttentionSpec(block_size=64, num_kv_heads=3, head_size=64,
                                                                  dtype=torch.float32))
    assert packed.state_content_bytes == 50  # 16 + 8 + 2 key bytes, 16 + 8 value bytes per row
    with pytest.raises(SpecError, match="backend"):
        config.parse({"method": "octopus", "backend": "cuda-magic"}, "additional_config")


def test_forward_and_cache_update_read_no_tensor_on_the_host() -> None:
    import inspect

    from kvq_vllm import plan
    from kvq_vllm.backend import KVQAttentionImpl

    for fn in (KVQAttentionImpl.forward, KVQAttentionImpl.do_kv_cache_update, plan.stage_tokens, plan.group_rows):
        body = inspect.getsource(fn)
        for sync in (".item(", ".tolist(", ".cpu(", ".numpy(", "bool(", "int(", "float("):
            assert sync not in body, (fn.__qualname__, sync)
