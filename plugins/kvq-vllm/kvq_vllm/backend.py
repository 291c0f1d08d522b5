"""kvq as a vLLM attention backend: packed pages in vLLM's own block manager.

- :meth:`KVQAttentionBackend.customize_spec` turns a layer's KV spec into ``uint8`` pages whose
  per-(token, kv head) cell is one :class:`kvq_core.paged.PageLayout` row (packed K then V), so
  vLLM's allocator, prefix cache and preemption work on packed bytes unchanged;
- :class:`KVQMetadataBuilder` describes each step once, for every layer: the batch's query
  boundaries, block table and coded lengths (and, for OScaR and KIVI, the step's
  :class:`~kvq_vllm.plan.GroupPlan`);
- :meth:`KVQAttentionImpl.do_kv_cache_update` is one ``kvq::write_paged`` call: the step's new K/V
  encoded into their rows at ``slot_mapping``; for a token-group codec it stages the open group's
  exact K/V and writes each group that completes (:mod:`kvq_vllm.plan`);
- :meth:`KVQAttentionImpl.forward` is one ``kvq::attend_paged`` call for the whole batch: every
  request's queries (decode, chunked prefill, a prefix-cache tail, recompute, speculative
  verification) attend causally over its pages, read through the block table, and its staged tail.

Neither ``forward`` nor ``do_kv_cache_update`` reads a tensor on the host. Refused at engine start
with a :class:`~kvq_core.errors.SpecError` naming the setting: sliding windows, ALiBi, logit
soft-capping, attention sinks, encoder attention, a quantized ``kv_cache_dtype``, a block size that is
not a multiple of the codec's key group, head dims the codec's spec does not take.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import kvq_core.torch_ops.ops  # noqa: F401  (defines the kvq:: ops)
from kvq_core import registry
from kvq_core.errors import SpecError
from kvq_core.paged import PageLayout
from kvq_vllm.config import CodecConfig, active_codec, tp_head_offset
from kvq_vllm.plan import GroupPlan, StagingPool, group_rows, plan_step, stage_tokens
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
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
        return [MultipleOf(1)]  # the codec's key group is checked with a SpecError naming block_size

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)  # token-major pages: one step's rows are contiguous per block

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Multiples of 16; the codec's spec has the last word (a SpecError naming head_dim at start)."""
        return head_size >= 16 and head_size % 16 == 0

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pages of ``uint8`` rows: ``state_content_bytes`` = one row's bytes (packed K + V per token and head)."""
        if spec.state_content_bytes is not None:
            return spec
        layout = PageLayout(active_codec(required=True).spec(spec.head_size), spec.block_size, spec.num_kv_heads)
        return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=layout.row_bytes)


def staging_slots(vllm_config: Any) -> int:
    """Staging slots of a token-group codec: one open group per running request, twice that with
    speculative decoding (a rollback may reopen the group before), and a few spare for LRU slack."""
    seqs = vllm_config.scheduler_config.max_num_seqs
    return seqs * (2 if vllm_config.speculative_config is not None else 1) + 4


def staging_bytes(vllm_config: Any, layout: PageLayout, layers: int, dtype: torch.dtype) -> int:
    """Bytes of every layer's staging buffers (exact K and V of the open groups)."""
    per_slot = 2 * layout.kv_heads * layout.group * layout.spec.head_dim * dtype.itemsize
    return staging_slots(vllm_config) * per_slot * layers


@dataclass
class KVQMetadata(AttentionMetadata):
    """One step for every layer: query boundaries, block table and coded lengths (device tensors)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    code_lens: torch.Tensor  # int32 [num_reqs]: tokens read from the pages (all of them for per-token codecs)
    plan: GroupPlan | None  # token-group codecs only


class KVQMetadataBuilder(AttentionMetadataBuilder[KVQMetadata]):
    """Builds :class:`KVQMetadata` once per step; owns the staging slots of a token-group codec."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        codec = active_codec(vllm_config, required=True)
        self.layout = PageLayout(codec.spec(kv_cache_spec.head_size), kv_cache_spec.block_size,
                                 kv_cache_spec.num_kv_heads)
        self.pool = StagingPool(staging_slots(vllm_config)) if self.layout.group > 1 else None

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """Per-token codecs: the metadata is vLLM's own persistent buffers and neither forward nor the
        cache update reads a tensor on the host, so uniform single-token decode batches can be
        captured. Token-group codecs: the step plan is built on the host with per-step sizes: never."""
        codec = active_codec(vllm_config, required=True)
        spec = codec.spec(kv_cache_spec.head_size)
        layout = PageLayout(spec, kv_cache_spec.block_size, kv_cache_spec.num_kv_heads)
        return AttentionCGSupport.NEVER if layout.group > 1 else AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVQMetadata:
        cam = common_attn_metadata
        n = cam.num_reqs
        qsl, seq_lens, table = cam.query_start_loc[: n + 1], cam.seq_lens[:n], cam.block_table_tensor[:n]
        plan = None
        if self.pool is not None:  # the host plan: once per step, here, never in forward
            plan = plan_step(self.pool, self.layout.group, self.layout.block_size,
                             cam.query_start_loc_cpu[: n + 1].numpy(), seq_lens.cpu().numpy(),
                             table.cpu().numpy(), device=self.device)
        return KVQMetadata(num_actual_tokens=cam.num_actual_tokens, query_start_loc=qsl, block_table=table,
                           code_lens=plan.code_lens if plan is not None else seq_lens, plan=plan)


def refuse(setting: str, value: Any, expected: str) -> SpecError:
    """What this backend cannot serve, as the SpecError that stops the engine at start."""
    return SpecError("kvq-vllm", setting, value, expected)


class KVQAttentionImpl(AttentionImpl[KVQMetadata]):
    """Encode into, and attend from, packed pages with one kvq codec (all layers of the engine)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **kwargs: Any) -> None:
        if sliding_window is not None:
            raise refuse("sliding_window", sliding_window,
                         "full attention: kvq-vllm does not serve sliding-window layers yet (it would take a window "
                         "argument in kvq::attend_paged masking positions older than the window, and freeing the "
                         "pages vLLM drops behind it)")
        for setting, value, bad, expected in (
                ("alibi_slopes", alibi_slopes, alibi_slopes is not None, "None: no ALiBi"),
                ("logits_soft_cap", logits_soft_cap, bool(logits_soft_cap), "None: no logit soft-capping"),
                ("sinks", "a tensor", sinks is not None, "None: no attention sinks"),
                ("attn_type", attn_type, attn_type != AttentionType.DECODER, "decoder attention"),
                ("kv_cache_dtype", kv_cache_dtype, kv_cache_dtype != "auto", '"auto": kvq is the cache codec')):
            if bad:
                raise refuse(setting, value, expected)
        vllm_config = get_current_vllm_config()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        # per-head constants by global kv head: a TP rank codes its heads as the TP=1 engine does
        self.head_offset = tp_head_offset(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                                          vllm_config.model_config.get_total_num_kv_heads())
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.codec: CodecConfig = active_codec(vllm_config, required=True)
        self.spec = self.codec.spec(head_size)
        self.spec_json = self.spec.to_json()
        self.layout = PageLayout(self.spec, vllm_config.cache_config.block_size, self.num_kv_heads)
        device = vllm_config.device_config.device
        self.backend = self.codec.attend_backend(device)
        registry.backend_info(self.backend)  # loads the registry, whose kernel tables the kvq:: ops read
        self._layers: dict[str, int] = {}
        self.tail_k = self.tail_v = None
        if self.layout.group > 1:
            # Allocated with the model, before vLLM sizes the KV cache, so its capacity is what is left.
            g = self.layout.group
            shape = (staging_slots(vllm_config), self.num_kv_heads, g, head_size)
            dtype = vllm_config.model_config.dtype
            self.tail_k = torch.zeros(shape, dtype=dtype, device=device)
            self.tail_v = torch.zeros(shape, dtype=dtype, device=device)

    def _layer(self, layer: AttentionLayer) -> int:
        """The model layer index (per-layer codec constants, e.g. OCTOPUS's signs, depend on it)."""
        name = layer.layer_name
        if name not in self._layers:
            self._layers[name] = extract_layer_index(name)
        return self._layers[name]

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """This step's K/V into their rows at ``slot_mapping`` (a token-group codec: its plan), one ``kvq::write_paged``."""
        index = self._layer(layer)
        if self.layout.group == 1:
            n = slot_mapping.shape[0]
            if n:  # padding slots (-1) write nothing
                torch.ops.kvq.write_paged(self.backend, self.spec_json, index, key[:n], value[:n], kv_cache,
                                          slot_mapping, self.head_offset)
            return
        plan = self._metadata(layer).plan
        stage_tokens(plan, self.tail_k, key)
        stage_tokens(plan, self.tail_v, value)
        if plan.groups:
            torch.ops.kvq.write_paged(self.backend, self.spec_json, index, group_rows(plan, self.tail_k, key),
                                      group_rows(plan, self.tail_v, value), kv_cache, plan.write_slot,
                                      self.head_offset)

    @staticmethod
    def _metadata(layer: AttentionLayer) -> KVQMetadata:
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):  # speculative decoding: [0] is the target model's
            meta = meta[0]
        return meta[layer.layer_name] if isinstance(meta, dict) else meta

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KVQMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Every request's queries over its packed context (and staged tail): one ``kvq::attend_paged``."""
        if output_scale is not None or output_block_scale is not None:
            raise refuse("output quantization", "fused", "none: kvq attention writes the model's dtype")
        if attn_metadata is None:  # the profiling run
            return output
        meta, plan = attn_metadata, attn_metadata.plan
        n = meta.num_actual_tokens
        tails = (self.tail_k, self.tail_v, plan.tail_slot, plan.tail_lens) if plan is not None else (None,) * 4
        out, _ = torch.ops.kvq.attend_paged(self.backend, self.spec_json, self._layer(layer), query[:n],
                                            kv_cache, meta.block_table, meta.code_lens, meta.query_start_loc,
                                            self.scale, *tails, self.head_offset)
        output[:n] = out.to(output.dtype)
        return output
