"""kvq-vllm: kvq's compressed KV cache as a vLLM attention-backend plugin (no vLLM fork).

Choose a codec with ``LLM(..., additional_config={"kvq": {"method": "octopus", "bits": 3}})`` or
``KVQ_VLLM='{"method": "octopus", "bits": 3}'``; see ``plugins/kvq-vllm/README.md``.
"""
