"""FP8 on a GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper): the real kernels.

Skipped elsewhere. Checks what the CPU cannot: ``torch._scaled_mm``'s CUDA constraints (layouts,
scale shapes, dims multiple of 16, bf16 output for rowwise) are met by every product of every
recipe, including token counts that are not multiples of 16; the GPU's results equal the
emulated path up to accumulation order; and a TrainStep with FP8 layers captured as a CUDA
graph gives its eager steps' numbers, overflows included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.fp8 import Fp8Linear, Fp8Recipe, fp8_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)",
    ),
]

RECIPES = ["tensorwise", "delayed", "rowwise"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [64, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_products_match_the_emulated_path(recipe, tokens, dtype):
    torch.manual_seed(0)
    real = Fp8Linear(128, 256, recipe=recipe, device="cuda", dtype=dtype)
    emu = Fp8Linear(128, 256, recipe=Fp8Recipe.named(recipe).replace(emulate=True, name=recipe),
                    device="cuda", dtype=dtype)  # fmt: skip
    emu.load_state_dict(real.state_dict())
    x = torch.randn(tokens, 128, device="cuda", dtype=dtype)
    g = torch.randn(tokens, 256, device="cuda", dtype=dtype)
    outs = []
    for layer in (real, emu):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(g)
        outs.append((out.float(), xi.grad.float(), layer.weight.grad.float()))
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-3 * b.abs().max().item())


@pytest.mark.parametrize("recipe", RECIPES)
def test_captured_fp8_trainstep_equals_eager_steps(recipe):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                   torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                   torch.nn.Linear(128, 10)).cuda()  # fmt: skip

    g = torch.Generator(device="cuda").manual_seed(1)
    batches = []
    for i in range(12):
        x = torch.randn(32, 64, device="cuda", generator=g)
        if i in (5, 9):
            x[0, 0] = float("inf")
        batches.append((x, torch.randint(0, 10, (32,), device="cuda", generator=g)))
    kw = dict(opt_level="O2", dtype="bf16", fp8=recipe, loss_scale=1024.0)
    a, b = model(), model()
    # Capture turns the lr into an fp32 device tensor (the fused kernel then reads 1e-3 rounded
    # to fp32): the eager reference gets the same, or the two runs differ in the last bit.
    lr = torch.tensor(1e-3, device="cuda")
    eager = mixprec.TrainStep(a, torch.optim.AdamW(a.parameters(), lr=lr, fused=True,
                              capturable=True), F.cross_entropy, capture="eager", **kw)  # fmt: skip
    captured = mixprec.TrainStep(b, torch.optim.AdamW(b.parameters(), lr=1e-3, fused=True),
                                 F.cross_entropy, **kw)  # fmt: skip
    ref = [eager(x, y) for x, y in batches]
    got = [captured(x, y) for x, y in batches]
    assert captured.captured, captured.reason
    for r, o in zip(ref, got, strict=True):
        assert torch.equal(r, o) or (r.isnan() and o.isnan())
    for (_, la), (_, lb) in zip(fp8_layers(a), fp8_layers(b), strict=True):
        assert torch.equal(la.fp8_history, lb.fp8_history)
        assert torch.equal(la.fp8_scale, lb.fp8_scale)


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_quantisation_gives_the_eager_layer_bit_for_bit(recipe):
    """On CUDA the quantisation runs compiled by default (`mixprec.fp8.fused`): Triton's casts
    must give the eager kernels' FP8 bytes, so the layer's output and gradients are equal."""
    from mixprec.fp8 import fused

    torch.manual_seed(0)
    layer = Fp8Linear(128, 256, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(37, 128, device="cuda", dtype=torch.bfloat16) * 3
    g = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    try:
        for mode in ("eager", "compiled"):
            fused.set_quantize_mode(mode)
            state = {k: v.clone() for k, v in layer.state_dict().items()}
            xi = x.clone().requires_grad_(True)
            layer.weight.grad = None
            out = layer(xi)
            out.backward(g)
            outs.append((out, xi.grad, layer.weight.grad))
            layer.load_state_dict(state)  # the same amax histories for both modes
    finally:
        fused.set_quantize_mode(None)
    assert fused.failures() == {}
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
