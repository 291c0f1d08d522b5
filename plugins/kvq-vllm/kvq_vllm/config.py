"""Which kvq codec a vLLM engine uses: ``additional_config={"kvq": {...}}``, else ``$KVQ_VLLM``.

The settings are a dict ``{"method": "octopus", "bits": 3, ...}``: ``method`` names the kvq
method, ``backend`` the kvq kernel backend (default ``"auto"``: numba on CPU when installed,
triton on CUDA when installed, else torch), and every other key is a parameter of the method's
spec. ``head_dim`` comes from the model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kvq_core import registry
from kvq_core.errors import SpecError
from kvq_core.spec import MethodSpec

ENV = "KVQ_VLLM"
DEFAULT_BACKEND = "auto"


@dataclass(frozen=True)
class CodecConfig:
    """A kvq method's parameters (without head_dim) and the kernel backend that runs them."""

    method: str
    params: tuple[tuple[str, Any], ...]
    backend: str = DEFAULT_BACKEND

    def spec(self, head_dim: int) -> MethodSpec:
        """The spec for a model with ``head_dim``."""
        return registry.make_spec(self.method, head_dim=head_dim, **dict(self.params))

    def attend_backend(self, device: Any) -> str:
        """The kvq backend of ``kvq::attend_paged`` and ``kvq::write_paged`` on ``device`` ("auto": numba
        on CPU, triton on CUDA, when installed and working; else torch, the reference; a backend
        without its own kernel for the method runs torch's)."""
        if self.backend != "auto":
            return self.backend
        preferred = {"cpu": "numba", "cuda": "triton"}.get(str(torch_device_type(device)))
        if preferred and registry.backend_status(preferred)[0]:
            return preferred
        return "torch"

    def describe(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"{self.method}({params}) on kvq backend {self.backend!r}"


def parse(settings: Any, source: str) -> CodecConfig:
    """A :class:`CodecConfig` from a settings dict (or its JSON text); ``source`` names where it came from."""
    if isinstance(settings, str):
        try:
            settings = json.loads(settings)
        except json.JSONDecodeError as exc:
            raise SpecError("kvq-vllm", source, settings, f'JSON such as {{"method": "octopus", "bits": 3}} ({exc})') from None
    if not isinstance(settings, dict) or not isinstance(settings.get("method"), str):
        raise SpecError("kvq-vllm", source, settings, 'a dict with a "method" name, e.g. {"method": "octopus", "bits": 3}')
    params = {k: v for k, v in settings.items() if k not in ("method", "backend")}
    if "head_dim" in params:
        raise SpecError("kvq-vllm", "head_dim", params["head_dim"], "no head_dim: it comes from the model")
    backend = settings.get("backend", DEFAULT_BACKEND)
    known = [b.name for b in registry.list_backends()]
    if backend != "auto" and backend not in known:
        raise SpecError("kvq-vllm", "backend", backend, f'"auto" or a kvq backend: {", ".join(known)}')
    config = CodecConfig(settings["method"], tuple(sorted(params.items())), backend)
    config.spec(128)  # validate the parameters now, with the error naming them
    return config


def torch_device_type(device: Any) -> str:
    """``"cpu"``, ``"cuda"``, ... of a device or its name."""
    return getattr(device, "type", None) or str(device).split(":")[0]


_seen: list[CodecConfig | None] = []


def active_codec(vllm_config: Any = None, *, required: bool = False) -> CodecConfig | None:
    """The codec of this process's engine.

    Read from ``vllm_config`` (else vLLM's current config) and remembered, since some vLLM hooks
    (``customize_spec``) run without a current config after the model was built with one.
    With ``required``, no codec is a :class:`SpecError` saying how to choose one.
    """
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        _seen[:] = [from_vllm(getattr(vllm_config, "additional_config", None))]
    codec = _seen[0] if _seen else from_vllm(None)
    if codec is None and required:
        raise SpecError("kvq-vllm", "additional_config", None,
                        f'additional_config={{"kvq": {{"method": "octopus", "bits": 3}}}} or ${ENV} set to such JSON')
    return codec


def from_vllm(additional_config: Any) -> CodecConfig | None:
    """The codec of an engine: ``additional_config["kvq"]``, else ``$KVQ_VLLM``, else None (stock attention)."""
    if isinstance(additional_config, dict) and additional_config.get("kvq") is not None:
        return parse(additional_config["kvq"], 'additional_config["kvq"]')
    if os.environ.get(ENV):
        return parse(os.environ[ENV], f"${ENV}")
    return None


def tp_head_offset(tp_rank: int, tp_size: int, total_kv_heads: int) -> int:
    """The global index of tensor-parallel rank ``tp_rank``'s first kv head, as vLLM shards them: each
    rank holds ``total_kv_heads // tp_size`` heads, or, with fewer heads than ranks, every head is
    replicated on ``tp_size // total_kv_heads`` consecutive ranks (``QKVParallelLinear``)."""
    for name, value, low in (("tp_size", tp_size, 1), ("total_kv_heads", total_kv_heads, 1)):
        if value < low:
            raise SpecError("kvq-vllm", name, value, f"an integer >= {low}")
    if not 0 <= tp_rank < tp_size:
        raise SpecError("kvq-vllm", "tp_rank", tp_rank, f"a rank in [0, {tp_size})")
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise SpecError("kvq-vllm", "tensor_parallel_size", tp_size,
                        f"a divisor or a multiple of the model's {total_kv_heads} kv heads")
    return tp_rank * total_kv_heads // tp_size
