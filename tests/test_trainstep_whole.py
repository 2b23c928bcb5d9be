"""TrainStep's whole step as one graph on the CPU (`mixprec.step.whole`).

References: the same TrainStep in two graphs (``compile={"one_graph": False}``), which
test_trainstep_compiled.py holds to the uncompiled step, and the uncompiled step itself for an
exact skip. One graph must give the two-graph step's results to fp32 rounding, skip exactly,
and say when and why it is not used.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.models import GPT, GPTConfig
from mixprec.step.batch import BatchError
from mixprec.step.compiled import tensor_lr
from tests.test_trainstep import _batches, _model
from tests.test_trainstep_compiled import _bitwise, _state_bits

pytestmark = pytest.mark.compile

FAST = {"backend": "aot_eager", "kernels": "native"}


def _steps(make_opt, level, dtype, compile_args, **makers):
    """One TrainStep per compile argument, over identical models (`makers`: keyword factories,
    a scaler for each, say)."""
    out = []
    for c in compile_args:
        model = _model()
        kw = {k: make() for k, make in makers.items()}
        step = mixprec.TrainStep(model, make_opt(model.parameters()), F.cross_entropy,
                                 opt_level=level, dtype=dtype, compile=c, **kw)  # fmt: skip
        if c is False:
            tensor_lr(step.optimizer.optimizer)
        out.append(step)
    return out


def test_from_the_second_step_the_step_is_one_graph():
    (step,) = _steps(lambda p: torch.optim.AdamW(p, lr=1e-2), "O1", "bf16", [FAST])
    reasons = [step(x, y) is not None and step.reason for x, y in _batches(4, overflows=())]
    # The first step makes the optimizer's state eagerly, its forward uncompiled (compiled
    # once, as part of the whole step, from the next).
    assert "runs eagerly" in reasons[0] and "creates optimizer state" in reasons[0]
    assert all("(one graph)" in r for r in reasons[1:]), reasons
    assert step.graphs_compiled == 1
    assert "one graph: yes" in step.explain()
    # The gradients the graph wrote are plain tensors in the parameters' buffers.
    assert all(p.grad is not None and not p.grad.requires_grad for p in step.model.parameters())


@pytest.mark.parametrize(
    ("level", "opt"),
    [("O1", lambda p: torch.optim.AdamW(p, lr=1e-2)),
     ("O2", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))],
    ids=["O1-adamw", "O2-sgd-momentum"],
)  # fmt: skip
def test_one_graph_computes_what_two_graphs_compute(level, opt):
    two, one = _steps(opt, level, "bf16", [{**FAST, "one_graph": False}, FAST])
    tol = {"rtol": 1e-3, "atol": 1e-4} if level == "O1" else {"rtol": 1e-5, "atol": 1e-6}
    for x, y in _batches(6, overflows=()):
        torch.testing.assert_close(one(x, y), two(x, y), **tol)
    assert "(one graph)" in one.reason and "(one graph)" not in two.reason
    assert "one graph: no: compile={'one_graph': False} was requested" in two.explain()
    torch.testing.assert_close(list(one.model.parameters()), list(two.model.parameters()), **tol)


@pytest.mark.slow
def test_inductor_one_graph_fp16_skips_exactly_and_scales_as_eagerly():
    eager, step = _steps(lambda p: torch.optim.AdamW(p, lr=1e-2), "O1", "fp16",
                         [False, {"kernels": "native"}],
                         scaler=lambda: mixprec.GradScaler("cpu", growth_interval=4))  # fmt: skip
    for i, (x, y) in enumerate(_batches(8, overflows={2, 5})):
        before = _state_bits(step)
        want, got = eager(x, y), step(x, y)
        if i in (2, 5):  # skipped inside the one graph: every bit kept
            assert "(one graph)" in step.reason and _bitwise(before, _state_bits(step))
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-3, atol=1e-4)
    assert step.scaler.stats()["losses"][0] == eager.scaler.stats()["losses"][0]


#: Attention timings (fused, fused in fp32, products) that make each route the fastest.
_ATTENTION_TIMES = {"native": (1.0, 3.0, 3.0), "fp32": (3.0, 1.0, 2.0), "matmuls": (3.0, 2.0, 1.0)}


@pytest.mark.parametrize("route", ["matmuls", "fp32", "native"])
def test_attention_by_each_route_stays_one_graph(monkeypatch, route):
    """The route is taken while the whole step is recorded (`mixprec.graph.routes`); the
    two-graph step takes it on its forward graph. Both give the same step."""
    from mixprec.graph import kernels

    def fake_time(*routes, rounds=3):
        for run in routes:
            run()
        return _ATTENTION_TIMES[route] if len(routes) == 3 else (1.0, 2.0)

    monkeypatch.setattr(kernels, "_time_routes", fake_time)
    monkeypatch.setattr(kernels, "_ATTENTION_CACHE", {})
    monkeypatch.setattr(kernels, "_CACHE", {})
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    steps = []
    for one_graph in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
        steps.append(mixprec.TrainStep(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3),
            compute_loss=lambda m, t: F.cross_entropy(m(t).float().flatten(0, 1), t.flatten()),
            dtype="bf16",
            compile={"backend": "aot_eager", "kernels": "auto", "one_graph": one_graph},
        ))  # fmt: skip
    two, one = steps
    for _ in range(4):
        torch.testing.assert_close(one(tokens), two(tokens), rtol=1e-3, atol=1e-3)
    assert "(one graph)" in one.reason and "one graph: yes" in one.explain()
    for step in (one, two):
        assert (
            f"aten.scaled_dot_product_attention(2x2x16x8, 2x2x16x8, 2x2x16x8) bf16: {route}:"
            in (step.explain())
        )
    # AdamW moves a weight whose gradient is near zero by up to lr a step whatever its size (in
    # either direction), so where bf16 gradients summed in another order differ in sign two
    # runs may part by 2 lr a step: 4 steps, lr 1e-3, at most 8e-3; the bulk agrees closely.
    pairs = list(zip(one.model.parameters(), two.model.parameters(), strict=True))
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=0, atol=8e-3)
    apart = torch.cat([(a - b).detach().abs().flatten() for a, b in pairs])
    assert apart.mean() < 1e-4 and (apart > 1e-4).float().mean() < 0.05


def test_the_one_graph_key_is_listed_among_the_valid_ones():
    model = _model()
    with pytest.raises(mixprec.PolicyError, match="one_graph=False"):
        mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                          dtype="bf16", compile={"one_grahp": False})  # fmt: skip


def test_an_empty_compile_dict_compiles_with_torchs_defaults():
    # compile={} used to compile the forward yet report (and run the update) eagerly.
    model = _model()
    empty = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              F.cross_entropy, dtype="bf16", compile={})  # fmt: skip
    for x, y in _batches(3, overflows=()):
        empty(x, y)
    assert empty.compiled and "(one graph)" in empty.reason, empty.reason


def test_a_users_own_graph_with_gradients_and_attention_compiles_through_the_graph_pass():
    # Outside TrainStep too: the graph compiles, attention by the route its timing chose.
    torch.manual_seed(0)
    q = torch.randn(2, 2, 8, 4, requires_grad=True)

    def grad_of_attention(q):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        (g,) = torch.autograd.grad(out.float().square().sum(), [q])
        return g

    amp = mixprec.AmpBackend(dtype="bf16", backend="aot_eager", kernels="auto")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = torch.compile(grad_of_attention, backend=amp)(q)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    (want,) = torch.autograd.grad(out.float().square().sum(), [q])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert len(amp.reports) == 1


def test_a_batch_that_does_not_fit_says_so_as_in_two_graphs():
    """An error of the user's model on a later batch is a `BatchError` naming the batch, in one
    graph as in two (it was dynamo's raw error)."""
    messages = []
    for one_graph in (True, False):
        model = _model()
        step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 F.cross_entropy, dtype="bf16",
                                 compile={**FAST, "one_graph": one_graph})  # fmt: skip
        batches = _batches(3, overflows=())
        for x, y in batches:
            step(x, y)
        x, y = batches[0]
        with pytest.raises(BatchError) as info:
            step(x[:, :-1], y)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert (
        "the batch does not fit the model" in messages[0]
        and "batch[0] (model input)" in (messages[0])
    )
