"""bf16 operands promoted to fp32 inside an op instead of copied to fp32 first: the same bits.

The log-prob division and the SwiGLU product take bf16 operands directly (PyTorch upcasts them
exactly on load), which saves a cast launch each on a GPU. The checks: equal bits to the explicit
fp32 copies, forward and gradients, on the CPU and on a GPU. Negative controls: the same expressions
rounded to bf16 before the op differ."""
import pytest
import torch

import zmrl.batch_invariant as bi
from tests.bitwise import bit_pattern as _bits
from zmrl.model.logprobs import token_logprobs
from zmrl.model.mlp import _swiglu
from zmrl.model.projections import BASE

BF16 = torch.bfloat16
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


@DEVICES
def test_bf16_logits_give_the_fp32_copys_log_probs(device):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 300, generator=g) * torch.logspace(-2, 2, 64)[:, None]).to(BF16).to(device)
    tokens = torch.randint(0, 300, (64,), generator=g).to(device)
    for t in (0.7, 1.0, 1.3):
        got = token_logprobs(logits, tokens, t)
        assert got.dtype == torch.float32
        assert torch.equal(_bits(got), _bits(token_logprobs(logits.float(), tokens, t))), t
    # control: only the division changed, to bf16 (then upcast): the rounded scaled logits move the bits
    ref = token_logprobs(logits.float(), tokens, 0.7)
    scaled_bf16 = (logits / torch.full((64, 1), 0.7, dtype=BF16, device=device)).float()
    control = token_logprobs(scaled_bf16, tokens, 1.0)  # T = 1: a division by exactly 1.0 keeps every value
    assert not torch.equal(control, ref)


@DEVICES
def test_swiglu_promotes_up_inside_the_product(device):
    g = torch.Generator().manual_seed(1)
    d, i = 32, 48
    w = {"mlp.gate_proj.weight": torch.randn(i, d, generator=g).to(BF16).to(device),
         "mlp.up_proj.weight": torch.randn(i, d, generator=g).to(BF16).to(device),
         "mlp.down_proj.weight": torch.randn(d, i, generator=g).to(BF16).to(device)}
    x = torch.randn(20, d, generator=g).to(BF16).to(device)

    def composed(product):
        gate = BASE.linear("mlp.gate_proj.weight", x, w["mlp.gate_proj.weight"])
        up = BASE.linear("mlp.up_proj.weight", x, w["mlp.up_proj.weight"])
        return BASE.linear("mlp.down_proj.weight", product(gate, up), w["mlp.down_proj.weight"])

    got = _swiglu(BASE, "mlp.", w, x)
    assert torch.equal(_bits(got), _bits(composed(lambda gt, up: (bi.silu(gt) * up.float()).to(BF16))))
    # control: the product in bf16
    assert not torch.equal(got, composed(lambda gt, up: bi.silu(gt).to(BF16) * up))


@DEVICES
def test_the_promoted_products_gradients_are_the_fp32_copys(device):
    # autograd casts each input's gradient back to its dtype once: through the promotion as
    # through .float(), so the product's gradients keep their bits
    g = torch.Generator().manual_seed(2)
    gate0, up0 = ((torch.randn(20, 48, generator=g) * 3).to(BF16).to(device) for _ in range(2))
    upstream = torch.randn(20, 48, generator=g).to(BF16).to(device)
    grads = []
    for promote in (lambda up: up, lambda up: up.float()):
        gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
        (bi.silu(gate) * promote(up)).to(BF16).backward(upstream)
        grads.append((gate.grad, up.grad))
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*grads))
    # control: rounding silu to bf16 first moves the gradients' bits
    gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    (bi.silu(gate).to(BF16) * up).backward(upstream)
    assert not torch.equal(up.grad, grads[0][1])
