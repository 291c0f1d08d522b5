"""Write a tiny random llama GGUF (Q4_1 weights) that transformers loads, for download-free tests.

The recipe follows ``shared/specs/platform.md`` section 5: ``gguf.GGUFWriter``, 2-D weights
quantized to Q4_1 with ``gguf.quants.quantize``, and llama.cpp's Q/K row permutation (which
transformers' GGUF loader reverses), so the loaded ``LlamaForCausalLM`` computes with exactly
the dequantized weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

GGUF_NAME = "tiny-llama-Q4_1.gguf"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` of q/k rows (convert_hf_to_gguf.py), inverse of transformers' reverse."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(
    directory: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ffn: int = 128,
    vocab: int = 256,
    context: int = 2048,
    seed: int = 0,
    name: str = GGUF_NAME,
    tokenizer: bool = False,
) -> Path:
    """Write the GGUF into ``directory`` and return its path. All 2-D weights are Q4_1. With
    ``tokenizer`` it also carries a byte-level BPE tokenizer (the 256 bytes, no merges, as GPT-2
    spells bytes; ``vocab`` must be 256), so ``AutoTokenizer`` loads from it as from a real GGUF."""
    import gguf

    rng = np.random.default_rng(seed)
    q41 = gguf.GGMLQuantizationType.Q4_1
    path = Path(directory) / name
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-kvq-test")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if tokenizer:
        _add_byte_tokenizer(writer, vocab)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def add_q(name_: str, w: np.ndarray) -> None:
        writer.add_tensor(name_, gguf.quants.quantize(w, q41), raw_dtype=q41)

    def add_f32(name_: str, w: np.ndarray) -> None:
        writer.add_tensor(name_, w.astype(np.float32))

    add_q("token_embd.weight", mat(vocab, hidden, 1.0))
    for i in range(layers):
        add_f32(f"blk.{i}.attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(hidden))
        add_q(f"blk.{i}.attn_q.weight", _permute(mat(heads * head_dim, hidden, 0.35), heads))
        add_q(f"blk.{i}.attn_k.weight", _permute(mat(kv_heads * head_dim, hidden, 0.35), kv_heads))
        add_q(f"blk.{i}.attn_v.weight", mat(kv_heads * head_dim, hidden, 0.2))
        add_q(f"blk.{i}.attn_output.weight", mat(hidden, heads * head_dim, 0.2))
        add_f32(f"blk.{i}.ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(hidden))
        add_q(f"blk.{i}.ffn_gate.weight", mat(ffn, hidden, 0.2))
        add_q(f"blk.{i}.ffn_up.weight", mat(ffn, hidden, 0.2))
        add_q(f"blk.{i}.ffn_down.weight", mat(hidden, ffn, 0.2))
    add_f32("output_norm.weight", np.ones(hidden))
    add_q("output.weight", mat(vocab, hidden, 0.5))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_byte_tokenizer(writer, vocab: int) -> None:
    """GPT-2's byte-to-unicode alphabet as the token list: every text encodes, one token per byte."""
    if vocab != 256:
        raise ValueError(f"a byte tokenizer needs vocab=256, got {vocab}")
    # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + i
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([alphabet[b] for b in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_scores([0.0] * 256)  # no merges: transformers derives them from the scores (none here)
    writer.add_bos_token_id(ord("\x02"))  # STX / ETX: bytes no test text holds
    writer.add_eos_token_id(ord("\x03"))


def load_tiny_llama(directory: str | Path, **kwargs):
    """Write (if absent) and load the tiny GGUF as an fp32 ``LlamaForCausalLM`` in eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(directory) / kwargs.get("name", GGUF_NAME)
    if not path.exists():
        write_tiny_llama_gguf(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval()
