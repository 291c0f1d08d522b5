"""Tiny random-weight decoder models built from transformers configs (nothing downloaded), one
per architecture family kvq must serve: 2 layers, hidden 64 where the family allows it (Phi-3
and GPT-NeoX are wider to get their real head dims 96 and 80), 128-token vocabulary."""
from __future__ import annotations

from typing import Any

import torch
import transformers as tf

COMMON = dict(vocab_size=128, pad_token_id=0, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
#: sliding window of the sliding-window models: prompts in the tests are longer
SLIDING_WINDOW = 16


def configs() -> dict[str, Any]:
    """name -> config; a name not shipped by the installed transformers is absent."""
    makers = {
        "llama": lambda: tf.LlamaConfig(**SMALL, **COMMON),
        "qwen2": lambda: tf.Qwen2Config(**SMALL, **COMMON),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, head_dim=32, **COMMON),
        # MistralConfig: sliding_window on every layer (Mistral v0.1 style)
        "mistral": lambda: tf.MistralConfig(**SMALL, sliding_window=SLIDING_WINDOW, **COMMON),
        # hybrid: local (sliding) and global layers
        "gemma3": lambda: tf.Gemma3TextConfig(**SMALL, head_dim=32, sliding_window=SLIDING_WINDOW,
                                              layer_types=["sliding_attention", "full_attention"], **COMMON),
        "phi3": lambda: tf.Phi3Config(hidden_size=192, intermediate_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, **COMMON),  # head_dim 96
        "gpt_neox": lambda: tf.GPTNeoXConfig(hidden_size=160, intermediate_size=128, num_attention_heads=2,
                                             **COMMON),  # head_dim 80, partial rotary
        "olmo2": lambda: tf.Olmo2Config(**SMALL, **COMMON),
        "granite": lambda: tf.GraniteConfig(**SMALL, attention_multiplier=0.2, **COMMON),
        # multi-head latent attention: the cache holds the 32-wide latent and the 16-wide rope part
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, **COMMON),
    }
    out = {}
    for name, make in makers.items():
        try:
            out[name] = make()
        except AttributeError:  # not in this transformers
            continue
    return out


def build(name: str, attn: str = "sdpa") -> torch.nn.Module:
    """The tiny model ``name`` with seeded random weights, in eval mode."""
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(configs()[name], attn_implementation=attn).eval()
