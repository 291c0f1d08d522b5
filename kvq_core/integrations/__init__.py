"""Where kvq meets other software: :mod:`~kvq_core.integrations.hf` (transformers caches and the
``"kvq"`` attention) and :mod:`~kvq_core.integrations.onnx` (export). The vLLM plugin is the
``kvq-vllm`` distribution under ``plugins/``. Integrations build on the library (``kvq_core``'s
other modules) and never the other way round (tests/test_layers.py)."""
