"""kvq as a vLLM attention backend: packed pages in vLLM's own block manager.

- :meth:`KVQAttentionBackend.customize_spec` turns a layer's KV spec into ``uint8`` pages whose
  per-(token, kv head) cell is one :class:`~kvq_vllm.paged.PageLayout` row (packed K then V),
  so vLLM's allocator, prefix cache and preemption work on packed bytes unchanged;
- :meth:`KVQAttentionImpl.do_kv_cache_update` encodes the step's new K/V (``kvq::encode``) and
  scatters the rows by ``slot_mapping``;
- :meth:`KVQAttentionImpl.forward` attends per request over the pages its ``block_table``
  names: a one-token query (decode) through ``kvq::attend`` on the packed fields, a longer one
  (prefill, chunked prefill, a prefix-cache hit, recompute after preemption) by decoding the
  request's context (``kvq::decode``) and causal SDPA.

Every token, including the step's own, is attended from its stored code, so a request's
output does not depend on how its prompt was chunked, cached or recomputed.
Not supported (a clear error at engine start): sliding windows, ALiBi, logit soft-capping,
attention sinks, encoder attention, quantized ``kv_cache_dtype``, CUDA graphs; head dims are those
the kvq spec accepts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

import kvq_core.dispatch.ops  # noqa: F401  (defines the kvq:: ops)
from kvq_core import registry
from kvq_core.dispatch.torch_kernels import field_names
from kvq_core.errors import KVQError
from kvq_vllm.config import CodecConfig, active_codec
from kvq_vllm.paged import PageLayout, read_tokens, write_slots
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout


class KVQAttentionBackend(AttentionBackend):
    """vLLM's view of kvq: packed ``uint8`` pages, kvq kernels (see the module docstring)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM resolves backends by enum name; the plugin registers itself as CUSTOM

    @staticmethod
    def get_impl_cls() -> type["KVQAttentionImpl"]:
        return KVQAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KVQMetadataBuilder"]:
        return KVQMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)  # token-major pages: one step's rows are contiguous per block

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Multiples of 16; the codec's spec has the last word (a SpecError naming head_dim at start)."""
        return head_size >= 16 and head_size % 16 == 0

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pages of ``uint8`` rows: ``state_content_bytes`` = packed K + packed V bytes per token and head."""
        if spec.state_content_bytes is not None:
            return spec
        layout = PageLayout(active_codec(required=True).spec(spec.head_size))
        return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=layout.row_bytes)


@dataclass
class KVQMetadata(AttentionMetadata):
    """Per-step batch description: request boundaries and lengths as host ints (one loop per request)."""

    num_actual_tokens: int
    query_start_loc: list[int]  # num_reqs + 1 entries
    seq_lens: list[int]  # context length of each request, this step's tokens included
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor


class KVQMetadataBuilder(AttentionMetadataBuilder[KVQMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVQMetadata:
        cam = common_attn_metadata
        n = cam.num_reqs
        return KVQMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=cam.query_start_loc_cpu[: n + 1].tolist(),
            seq_lens=cam.seq_lens[:n].cpu().tolist(),
            block_table=cam.block_table_tensor,
            slot_mapping=cam.slot_mapping,
        )


def _unsupported(what: str) -> KVQError:
    return KVQError(f"kvq-vllm: {what} is not supported by the kvq attention backend")


class KVQAttentionImpl(AttentionImpl[KVQMetadata]):
    """Encode into, and attend from, packed pages with one kvq codec (all layers of the engine)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **kwargs: Any) -> None:
        for what, bad in (("ALiBi", alibi_slopes is not None), ("a sliding window", sliding_window is not None),
                          ("logit soft-capping", bool(logits_soft_cap)), ("attention sinks", sinks is not None),
                          (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
                          (f"kv_cache_dtype={kv_cache_dtype!r}", kv_cache_dtype != "auto")):
            if bad:
                raise _unsupported(what)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.codec: CodecConfig = active_codec(get_current_vllm_config(), required=True)
        self.spec = self.codec.spec(head_size)
        self.spec_json = self.spec.to_json()
        self.pages = PageLayout(self.spec)
        self.names = {kind: field_names(self.spec, kind) for kind in ("keys", "values")}
        registry.backend_info(self.codec.backend)  # loads the kvq backend: its kvq:: table entries
        self._layers: dict[str, int] = {}

    def _layer(self, layer: AttentionLayer) -> int:
        """The model layer index (per-layer codec constants, e.g. OCTOPUS's signs, depend on it)."""
        name = layer.layer_name
        if name not in self._layers:
            self._layers[name] = extract_layer_index(name)
        return self._layers[name]

    def _encode(self, kind: str, x: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        """Fields of ``x [n, kv_heads, d]`` encoded as one ``[1, kv_heads, n, d]`` block."""
        block = x.permute(1, 0, 2).unsqueeze(0)
        fields = torch.ops.kvq.encode(self.codec.backend, self.spec_json, layer, kind, block)
        return dict(zip(self.names[kind], fields))

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Encode this step's K/V and write their rows at ``slot_mapping``."""
        n = slot_mapping.shape[0]
        if n == 0:
            return
        index = self._layer(layer)
        rows = self.pages.pack(self._encode("keys", key[:n], index), self._encode("values", value[:n], index))
        write_slots(kv_cache, rows[0].permute(1, 0, 2), slot_mapping)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KVQMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of each request's queries over its packed context, written into ``output``."""
        if output_scale is not None or output_block_scale is not None:
            raise _unsupported("fused output quantization")
        if attn_metadata is None:  # the profiling run
            return output
        index = self._layer(layer)
        qsl, meta = attn_metadata.query_start_loc, attn_metadata
        for r, tokens in enumerate(meta.seq_lens):
            start, stop = qsl[r], qsl[r + 1]
            if stop == start:
                continue
            rows = read_tokens(kv_cache, meta.block_table[r], tokens)
            kf, vf = self.pages.unpack(rows)
            q = query[start:stop].permute(1, 0, 2).unsqueeze(0)  # [1, q_heads, L, d]
            shape = [1, self.num_kv_heads, tokens, self.head_size]
            if stop - start == 1:
                out = self._attend(q, kf, vf, shape, index)
            else:
                out = self._prefill(q, kf, vf, shape, index)
            output[start:stop] = out[0].permute(1, 0, 2).to(output.dtype)
        return output

    def _attend(self, q: torch.Tensor, kf: dict, vf: dict, shape: list[int], layer: int) -> torch.Tensor:
        """One query token over the packed context: ``kvq::attend`` (the codec scores from its codes)."""
        out, _ = torch.ops.kvq.attend(self.codec.backend, self.spec_json, layer, q,
                                      [kf[n] for n in self.names["keys"]], [vf[n] for n in self.names["values"]],
                                      shape, self.scale)
        return out

    def _prefill(self, q: torch.Tensor, kf: dict, vf: dict, shape: list[int], layer: int) -> torch.Tensor:
        """L query tokens, the last L of the context: decode the context, causal SDPA (GQA)."""
        backend = self.codec.backend
        k = torch.ops.kvq.decode(backend, self.spec_json, layer, "keys", [kf[n] for n in self.names["keys"]], shape)
        v = torch.ops.kvq.decode(backend, self.spec_json, layer, "values", [vf[n] for n in self.names["values"]], shape)
        length, tokens = q.shape[2], shape[2]
        mask = torch.ones(length, tokens, dtype=torch.bool, device=q.device).tril(tokens - length)
        return F.scaled_dot_product_attention(q.to(torch.float32), k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)
