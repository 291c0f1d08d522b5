"""A compiled quantization-aware training step: a tiny Llama with K/V fake-quantized in attention
(``attn_implementation="kvq-qat"``), forward + backward + optimizer step in one
``torch.compile(fullgraph=True)`` graph, equal to the same step run eagerly."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers")

import tiny_models  # noqa: E402
from kvq_core.integrations.hf import qat  # noqa: E402

pytestmark = pytest.mark.compile

LR = 0.05


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss, backward, the gradients, a plain SGD update (``torch.optim``'s ``step`` graph-breaks on
    purpose), gradients cleared."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-LR)
            p.grad = None
    return loss.detach(), grads


@pytest.mark.parametrize("method,settings", [("oscar", {"bits": 2, "residual": 16})])
def test_compiled_training_step_equals_eager(method: str, settings: dict) -> None:
    eager = tiny_models.build("llama").train()
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp_logits = eager(input_ids=ids).logits
        qat.prepare(eager, method, qat_backend="torch", **settings)
        assert float((eager(input_ids=ids).logits - fp_logits).abs().max()) > 1e-2  # K/V are fake-quantized
    compiled = copy.deepcopy(eager)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        step = torch.compile(lambda x: _step(compiled, x), fullgraph=True)  # raises on any graph break
        c_loss, c_grads = step(ids)
        c_loss2, _ = step(ids)  # a second step reuses the graph
    assert not torch._dynamo.utils.counters["graph_break"]

    e_loss, e_grads = _step(eager, ids)
    e_loss2, _ = _step(eager, ids)
    assert torch.isfinite(c_loss) and abs(float(c_loss) - float(e_loss)) < 1e-4
    assert abs(float(c_loss2) - float(e_loss2)) < 1e-4 and float(e_loss2) < float(e_loss)  # the step trained
    names = [n for n, p in eager.named_parameters() if p.requires_grad]
    for name, cg, eg in zip(names, c_grads, e_grads):
        assert torch.allclose(cg, eg, rtol=1e-3, atol=1e-5), (name, (cg - eg).abs().max())
    k_proj = names.index("model.layers.0.self_attn.k_proj.weight")
    assert float(e_grads[k_proj].abs().sum()) > 0  # gradients reach the keys through the fake quantization
    for (name, pc), pe in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.allclose(pc, pe, rtol=1e-3, atol=1e-5), name
