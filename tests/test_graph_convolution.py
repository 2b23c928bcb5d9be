"""Convolutions as one matrix product (`mixprec.graph.convolution`).

References: ``F.conv2d`` in fp64 for the product's arithmetic, the bf16 convolution kernel's
own error against fp64 for its numerics, eager ``mixprec.autocast`` and the uncompiled
TrainStep for the graphs that use it. The route taken is forced in the graph tests (timings
differ between machines); the timing decision itself is tested with fixed timings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.graph import kernels
from mixprec.graph.convolution import convolution_by_matmuls, decomposable
from mixprec.graph.routes import Routes

#: (input shape, weight shape, stride, padding, dilation): every kind the route takes.
ELIGIBLE = [
    ((3, 8, 5, 5), (6, 8, 1, 1), 1, 0, 1),  # 1x1
    ((3, 8, 6, 5), (6, 8, 1, 1), 2, 0, 1),  # 1x1, strided (a ResNet downsample)
    ((3, 8, 1, 1), (6, 8, 3, 3), 1, 1, 1),  # 3x3 on a 1x1 map: only the centre tap
    ((3, 8, 2, 2), (6, 8, 3, 3), 2, 1, 1),  # 3x3 at stride 2 on a 2x2 map: one output
    ((2, 4, 6, 6), (5, 4, 2, 2), 2, 0, 1),  # 2x2 at stride 2: patches tile the map
    ((2, 4, 7, 7), (5, 4, 2, 2), 3, 1, 2),  # dilated, stride >= extent
    ((2, 4, 1, 9), (5, 4, 3, 3), (1, 3), 1, 1),  # one output row, tiled columns
    ((2, 4, 3, 6), (5, 4, 3, 1), (1, 2), 0, 1),  # one output row, strided 1-wide columns
    ((2, 4, 1, 5), (5, 4, 5, 1), (1, 2), (2, 0), (1, 1)),  # padding rows left out, with taps
]


def _conv_case(shapes, dtype, bias=True, channels_last=False, seed=0):
    xs, ws, stride, padding, dilation = shapes
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(xs, generator=g, dtype=torch.float64)
    w = torch.randn(ws, generator=g, dtype=torch.float64) * 0.1
    b = torch.randn(ws[0], generator=g, dtype=torch.float64) if bias else None
    out = F.conv2d(x, w, b, stride, padding, dilation)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)

    def run(fn):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        xx = x.to(dtype).contiguous(memory_format=fmt).requires_grad_()
        ww = w.to(dtype).requires_grad_()
        bb = b.to(dtype).requires_grad_() if bias else None
        y = fn(xx, ww, bb, stride, padding, dilation)
        y.backward(grad.to(dtype))
        return [y.detach(), xx.grad, ww.grad] + ([bb.grad] if bias else []), y

    return run


@pytest.mark.parametrize("shapes", ELIGIBLE, ids=lambda s: f"{s[0]}-{s[1]}-s{s[2]}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_the_product_is_the_convolution_in_fp64(shapes, bias):
    run = _conv_case(shapes, torch.float64, bias)
    ref, ref_out = run(F.conv2d)
    got, out = run(convolution_by_matmuls)
    assert decomposable((ref_out.bfloat16(), torch.zeros(shapes[1], dtype=torch.bfloat16),
                         None, *shapes[2:]), {}) is None  # fmt: skip
    assert out.shape == ref_out.shape and out.is_contiguous()
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_channels_last_input_gives_a_channels_last_result():
    run = _conv_case(ELIGIBLE[1], torch.float64, channels_last=True)
    ref, _ = run(F.conv2d)
    got, out = run(convolution_by_matmuls)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shapes", ELIGIBLE[:4], ids=lambda s: f"{s[0]}-{s[1]}-s{s[2]}")
def test_in_bf16_its_error_is_the_convolution_kernels(shapes):
    """Output, input, weight and bias gradients: one fp32 sum, one rounding, as the kernel."""
    ref, _ = _conv_case(shapes, torch.float64, seed=1)(F.conv2d)
    native, _ = _conv_case(shapes, torch.bfloat16, seed=1)(F.conv2d)
    product, _ = _conv_case(shapes, torch.bfloat16, seed=1)(convolution_by_matmuls)

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    for n, p, r in zip(native, product, ref, strict=True):
        assert err(p, r) <= 1.25 * err(n, r) + 1e-4, (err(p, r), err(n, r))


@pytest.mark.parametrize(
    ("args", "kwargs", "why"),
    [
        (((2, 4, 4, 4), (4, 4, 3, 3), 1, 1), {}, "patches overlap"),
        (((2, 4, 4, 4), (4, 2, 1, 1)), {"groups": 2}, "grouped"),
        (((2, 4, 4, 4), (4, 4, 1, 1)), {"padding": "same"}, "not plain integers"),
        (((4, 4, 4), (4, 4, 1, 1)), {}, "batched 2-D 16-bit"),
        (((2, 4, 9, 8), (4, 4, 1, 1)), {}, "more than 64 output positions"),
    ],
    ids=["overlap", "grouped", "same", "unbatched", "large-map"],
)
def test_the_route_is_offered_only_where_it_keeps_the_arithmetic(args, kwargs, why):
    xs, ws, *rest = args
    x, w = torch.zeros(xs, dtype=torch.bfloat16), torch.zeros(ws, dtype=torch.bfloat16)
    assert why in decomposable((x, w, None, *rest), kwargs)
    assert "16-bit" in decomposable((x.float(), w.float(), None), {})
    assert decomposable((x, w.float(), None), {}) is not None


def test_the_decision_times_both_routes_once_per_shape(monkeypatch):
    timings = iter([(2.0, 1.0), (1.0, 0.95), (3.0, 1.0), (2.0, 1.0)])
    calls = []

    def fake_time(*routes, rounds=3):
        for route in routes:  # both run, on real tensors, forward and backward
            route()
        calls.append(len(routes))
        return next(timings)

    monkeypatch.setattr(kernels, "_time_routes", fake_time)
    monkeypatch.setattr(kernels, "_family_in_fp32", lambda family, low: False)
    monkeypatch.setattr(kernels, "_CONVOLUTION_CACHE", {})
    x = torch.zeros(2, 8, 2, 2, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(16, 8, 1, 1, dtype=torch.bfloat16)
    choice = kernels.decide_convolution((x, w, None, 2), {})
    assert choice.route == "matmuls" and choice.native_ms == 2.0 and choice.matmuls_ms == 1.0
    assert "one matrix product is the faster" in str(choice) and "2 ms" in choice.reason
    assert kernels.decide_convolution((x, w, None, 2), {}) == choice  # cached: no second timing
    # Within the kernels' margin the convolution keeps its family's route.
    assert kernels.decide_convolution((x, w, None, 1), {}) is None
    # Arguments by keyword (a bias among them) are timed alike.
    bias = torch.zeros(16, dtype=torch.bfloat16)
    assert kernels.decide_convolution((x,), {"weight": w, "bias": bias, "stride": 2}).route == (
        "matmuls"
    )
    # A frozen layer (nothing needs a gradient) is timed as a forward alone, under its own key.
    assert kernels.decide_convolution((x.detach(), w, None, 2), {}).route == "matmuls"
    assert calls == [2, 2, 2, 2] and len(kernels._CONVOLUTION_CACHE) == 4


class _Net(nn.Module):
    """Small maps, many channels, and one 3x3 at stride 1 (overlapping: keeps the kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 32, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.wide = nn.Conv2d(32, 64, 2, stride=2)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.down(F.relu(self.stem(x)))))
        return self.head(self.wide(h).flatten(1))


def _always_product(monkeypatch):
    def decide(args, kwargs):
        shapes = (tuple(args[0].shape), tuple(args[1].shape))
        return kernels.KernelChoice("aten.conv2d", shapes, "bf16", "matmuls", 1.0, None,
                                    "forced by the test", 0.5)  # fmt: skip

    monkeypatch.setattr(kernels, "decide_convolution", decide)


@pytest.mark.compile
def test_a_compiled_graph_computes_routed_convolutions_as_products(monkeypatch):
    _always_product(monkeypatch)
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 3, 4, 4)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    ref.float().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    amp = mixprec.AmpBackend(dtype="bf16", backend="aot_eager", kernels="auto")
    out = torch.compile(model, backend=amp)(x)
    out.float().sum().backward()
    routed = [c for c in amp.kernel_choices if c.route == "matmuls"]
    assert [c.shapes for c in routed] == [((4, 16, 4, 4), (32, 16, 1, 1)),
                                          ((4, 32, 2, 2), (64, 32, 2, 2))]  # fmt: skip
    assert "forced by the test" in amp.kernel_summary()
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for got, want in zip([p.grad for p in model.parameters()], ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


@pytest.mark.compile
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_trainstep_keeps_one_graph_with_products(monkeypatch, level):
    _always_product(monkeypatch)
    torch.manual_seed(0)
    steps = []
    for compile_arg in (False, {"backend": "aot_eager", "kernels": "auto"}):
        torch.manual_seed(0)
        model = _Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        steps.append(mixprec.TrainStep(model, opt, F.cross_entropy, opt_level=level,
                                       dtype="bf16", compile=compile_arg))  # fmt: skip
    eager, step = steps
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 5, (4,), generator=g)
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=2e-2, atol=2e-2)
    assert "(one graph)" in step.reason and step.graphs_compiled == 1
    assert "matmuls: forced by the test" in step.explain()
    for a, b in zip(step.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_routes_leave_other_calls_alone():
    routes = Routes(lambda args, kwargs: pytest.fail("asked about a refused call"))
    x = torch.randn(1, 2, 4, 4)
    with routes:
        y = F.conv2d(x, torch.randn(3, 2, 3, 3), padding=1)  # fp32: not offered
    assert y.shape == (1, 3, 4, 4) and routes.choices == []


@pytest.mark.compile
def test_native_kernels_leave_every_convolution_to_its_kernel(monkeypatch):
    monkeypatch.setattr(
        kernels, "decide_convolution", lambda args, kwargs: pytest.fail("timed under 'native'")
    )
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 3, 4, 4)
    amp = mixprec.AmpBackend(dtype="bf16", backend="aot_eager", kernels="native")
    out = torch.compile(model, backend=amp)(x)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert amp.kernel_choices == [] and torch.equal(out, ref)
