"""kvq-fp8: an FP8 KV cache method for kvq, shipped as a separately installed plugin.

``get_quantizer("fp8", format="e4m3" | "e5m2", scale="token" | "head")``; see
:mod:`kvq_fp8.spec` for the method and :mod:`kvq_fp8.formats` for the exact rounding.
"""
__version__ = "0.1.0"
