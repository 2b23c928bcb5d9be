"""Attention as two matrix products (`mixprec.graph.attention`) and its choice per shape.

References: torch's SDPA in fp64 for the numbers (the decomposition must be as close to it as
torch's fused bf16 kernel is), torch's fused kernel for the layout and the masks' meaning, and
the uncompiled model for what a compiled graph with the rewrite computes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.models import GPT, GPTConfig
from mixprec.graph import attention, kernels
from mixprec.graph.attention import attention_by_matmuls

pytestmark = pytest.mark.compile

B, H, T, E = 2, 4, 48, 32


def _qkv(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, E, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _masks():
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(T, T, generator=g) > 0.3
    keep[5] = False  # a row that attends to nothing: zeros, as torch's math path gives
    return {
        "none": {},
        "causal": {"is_causal": True},
        "causal, scale": {"is_causal": True, "scale": 0.3},
        "bool mask": {"attn_mask": keep},
        "float mask": {"attn_mask": torch.randn(B, 1, T, T, generator=g).bfloat16()},
    }


@pytest.mark.parametrize("kind", list(_masks()))
def test_two_products_are_as_close_to_fp64_as_the_fused_kernel(kind):
    kw = _masks()[kind]
    q, k, v = _qkv()
    grad = torch.randn(B, H, T, E, generator=torch.Generator().manual_seed(2)).bfloat16()

    def run(fn, tensors, **extra):
        ins = [t.detach().requires_grad_() for t in tensors]
        out = fn(*ins, **extra)
        out.backward(grad.to(out.dtype))
        return [out.detach(), *(t.grad for t in ins)]

    wide = {a: (b.double() if torch.is_tensor(b) and b.is_floating_point() else b)
            for a, b in kw.items()}  # fmt: skip
    exact = run(F.scaled_dot_product_attention, [t.double() for t in (q, k, v)], **wide)
    if kind == "bool mask":  # torch's fp64 reference gives NaN on the empty row; math gives 0
        exact = [torch.nan_to_num(t, nan=0.0) for t in exact]
    fused = run(F.scaled_dot_product_attention, (q, k, v), **kw)
    ours = run(attention_by_matmuls, (q, k, v), **kw)
    for name, a, f, x in zip(("out", "dq", "dk", "dv"), ours, fused, exact, strict=True):
        assert a.dtype == torch.bfloat16, name
        err_ours = ((a.double() - x).norm() / x.norm()).item()
        err_fused = ((torch.nan_to_num(f.double()) - x).norm() / x.norm()).item()
        # bf16's half-ulp is 2**-9 = 0.2%: both are a few tenths of a percent from fp64.
        assert err_ours <= max(1.5 * err_fused, 2**-8), (name, err_ours, err_fused)
    if kind == "bool mask":
        assert torch.equal(ours[0][:, :, 5], torch.zeros_like(ours[0][:, :, 5]))


def test_the_output_can_be_laid_out_as_the_fused_kernels():
    q, k, v = _qkv()
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    order = tuple(sorted(range(4), key=lambda d: -fused.stride(d)))
    ours = attention_by_matmuls(q, k, v, is_causal=True, dim_order=order)
    assert ours.stride() == fused.stride() and ours.shape == fused.shape
    torch.testing.assert_close(ours, attention_by_matmuls(q, k, v, is_causal=True))


def _force(monkeypatch, route):
    """Make the per-shape probe report `route` as the fastest (the real timings vary)."""
    timings = {"native": (1.0, 9.0, 9.0), "fp32": (9.0, 1.0, 9.0), "matmuls": (9.0, 9.0, 1.0)}
    real = kernels._time_routes

    def timed(*routes, **kw):
        return timings[route] if len(routes) == 3 else real(*routes, **kw)

    monkeypatch.setattr(kernels, "_time_routes", timed)
    kernels._ATTENTION_CACHE.clear()


@pytest.mark.parametrize("route", ["matmuls", "fp32", "native"])
def test_a_compiled_gpt_takes_the_measured_route_and_computes_the_same(monkeypatch, route):
    _force(monkeypatch, route)
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=H, n_embd=H * E)
    model = GPT(cfg)
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(3))

    def loss_of(m):
        return F.cross_entropy(m(tokens).float().flatten(0, 1), tokens.flatten())

    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        want = loss_of(model)
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    amp = mixprec.AmpBackend(dtype="bf16", backend="aot_eager", kernels="auto")
    got = torch.compile(lambda: loss_of(model), backend=amp)()
    got.backward()
    choices = [c for c in amp.kernel_choices if "attention" in c.op]
    assert [c.route for c in choices] == [route] * 2
    assert choices[0].shapes == ((B, H, T, E),) * 3
    assert choices[0].matmuls_ms == (1.0 if route == "matmuls" else 9.0)
    assert route in str(choices[0]) and "at these shapes" in choices[0].reason
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for p, g in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=5e-2, atol=5e-3)
    kernels._ATTENTION_CACHE.clear()


def test_the_fused_kernel_stays_where_the_products_cannot_stand_in(monkeypatch):
    _force(monkeypatch, "matmuls")
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(0)
    big = [torch.randn(17, 16, 256, 8, generator=g).bfloat16() for _ in range(3)]
    cases = {
        "dropout": (
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, dropout_p=0.5),
            (q, k, v),
        ),
        "gqa": (
            lambda a, b, c: F.scaled_dot_product_attention(a, b[:, :2], c[:, :2], enable_gqa=True),
            (q, k, v),
        ),
        "scores": (lambda a, b, c: F.scaled_dot_product_attention(a, b, c), big),
    }
    for name, (fn, args) in cases.items():
        torch._dynamo.reset()
        amp = mixprec.AmpBackend(dtype="bf16", backend="eager", kernels="auto")
        torch.compile(fn, backend=amp)(*[a.detach() for a in args])
        (choice,) = amp.kernel_choices
        # the family's route (measured once per process), never the products
        assert choice.route != "matmuls" and choice.matmuls_ms is None, name
    traced = torch.fx.symbolic_trace(
        lambda a, b, c: torch.ops.aten.scaled_dot_product_attention(a, b, c)
    )
    node = next(n for n in traced.graph.nodes if n.op == "call_function")
    for arg, val in zip(node.args, big, strict=True):
        arg.meta["val"] = val
    assert "MiB" in attention.decomposable(node)
    kernels._ATTENTION_CACHE.clear()


def test_the_real_probe_times_three_routes_once_per_shape():
    kernels._ATTENTION_CACHE.clear()
    q, k, v = (t.detach() for t in _qkv())
    for _ in range(2):  # the second graph reuses the first one's timings
        torch._dynamo.reset()
        amp = mixprec.AmpBackend(dtype="bf16", backend="eager", kernels="auto")
        out = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                            backend=amp)(q, k, v)  # fmt: skip
        (choice,) = amp.kernel_choices
        assert out.dtype == torch.bfloat16
        assert min(choice.native_ms, choice.fp32_ms, choice.matmuls_ms) > 0
        assert choice.route in ("native", "fp32", "matmuls") and "at these shapes" in choice.reason
    assert len(kernels._ATTENTION_CACHE) == 1
    kernels._ATTENTION_CACHE.clear()


def test_the_scores_backward_keeps_the_16_bit_inputs_and_a_learned_mask_gets_its_gradient():
    q, k, v = _qkv()
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention_by_matmuls(q, k, v, is_causal=True)
    out.float().sum().backward()
    # No fp32 copy of q or k is kept for backward (autograd through q.float() @ k.float()
    # would keep both, and run the backward's two GEMMs in fp32).
    assert (torch.float32, q.numel()) not in saved
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16
    mask = torch.randn(T, T, generator=torch.Generator().manual_seed(4)).requires_grad_()
    grads = []
    for fn in (F.scaled_dot_product_attention, attention_by_matmuls):
        mask.grad = None
        fn(*(t.detach() for t in (q, k, v)), attn_mask=mask.bfloat16()).float().sum().backward()
        grads.append(mask.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0.05, atol=0.05)
