"""kvq's Triton backend: GPU kernels for encode, decode and fused split-KV decode attention
over the packed cache (runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``)."""
