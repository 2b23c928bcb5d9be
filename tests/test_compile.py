"""mixprec.autocast under torch.compile: one frame, no graph break caused by mixprec, and the
same numbers as eager, along the eager -> aot_eager -> inductor backend ladder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec

pytestmark = pytest.mark.compile

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    )


CUDA_RULES = mixprec.Policy(table="cuda")  # exercises fp32 and fp32_output rules on CPU


def test_region_inside_compiled_function_is_one_frame():
    model, x = _model(), torch.randn(8, 16)

    def step(x):
        with mixprec.autocast("cpu", policy=CUDA_RULES):
            y = model(x)
            return F.softmax(y, -1), y

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    probs, y = compiled(x)
    ref_probs, ref_y = step(x)
    assert counter.frame_count == 1
    assert (probs.dtype, y.dtype) == (torch.float32, torch.bfloat16)
    assert torch.equal(probs, ref_probs) and torch.equal(y, ref_y)


def test_compiled_function_inside_region_is_one_frame(state_tracing):
    model, x = _model(), torch.randn(8, 16)
    counter = CompileCounter()
    compiled = torch.compile(lambda x: F.log_softmax(model(x), -1), backend=counter,
                             fullgraph=True)  # fmt: skip
    with mixprec.autocast("cpu", policy=CUDA_RULES):
        out = compiled(x)
        ref = F.log_softmax(model(x), -1)
    assert counter.frame_count == 1
    assert out.dtype == torch.float32 and torch.equal(out, ref)


def test_default_region_in_compiled_training_step_no_graph_break():
    model, x, y = _model(), torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss_fn(x, y):
        with mixprec.autocast("cpu"):
            return F.cross_entropy(model(x), y)

    explanation = torch._dynamo.explain(loss_fn)(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_backend_ladder_forward_and_backward(backend):
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    model, x = _model(), torch.randn(8, 16)

    def loss_fn(x):
        with mixprec.autocast("cpu", policy=CUDA_RULES):
            return model(x).float().pow(2).mean()

    loss = loss_fn(x)
    loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
    c_loss = compiled(x)
    c_loss.backward()
    tol = 0 if backend != "inductor" else 2e-2  # inductor fuses and may reorder bf16 math
    assert torch.allclose(c_loss, loss, rtol=tol, atol=tol)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        assert torch.allclose(p.grad, g, rtol=tol, atol=tol)


def test_losses_behind_torch_c_nn_follow_torch_lists_under_compile(state_tracing):
    """dynamo consults a torch function mode only for functions in
    torch.overrides.get_overridable_functions(). F.cross_entropy, F.mse_loss and friends are
    inlined down to torch._C._nn functions outside that set, so no mode sees them in a compiled
    region. The region's torch autocast state is on, though, so torch's dispatcher casts their
    aten ops by its own lists when the graph is traced: with the default policy the result equals
    eager (fp32 losses). What remains is documented (docs/policy.md, "torch.compile"): an edit of
    such an op does not reach a compiled region."""
    x, y = torch.randn(4, 8, dtype=torch.bfloat16), torch.randint(0, 8, (4,))

    def losses(x, y):
        with mixprec.autocast("cpu"):
            return F.cross_entropy(x, y), F.mse_loss(x, x), torch.log_softmax(x.float(), -1)

    eager = losses(x, y)
    compiled = torch.compile(losses, backend="aot_eager", fullgraph=True)(x, y)
    assert [t.dtype for t in eager] == [t.dtype for t in compiled] == [torch.float32] * 3
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)

    edited = mixprec.Policy().move("mse_loss", to="passthrough")

    def edited_loss(x):
        with mixprec.autocast("cpu", policy=edited):
            return F.mse_loss(x, x * 2)

    torch._dynamo.reset()
    assert edited_loss(x).dtype == torch.bfloat16
    assert torch.compile(edited_loss, backend="aot_eager")(x).dtype == torch.float32  # the gap


@pytest.fixture(params=["setters", "with-statement"])
def state_tracing(request, monkeypatch):
    """Both ways a region sets torch's autocast state in a trace: the setters (torch 2.13's
    dynamo traces them) and a with-statement around torch.autocast (torch 2.11's only way)."""
    from mixprec import _compat

    traceable = _compat.autocast_state_traceable()
    if request.param == "setters" and not traceable:
        pytest.skip("this torch's dynamo cannot trace torch's autocast setters")
    monkeypatch.setattr(_compat, "_TRACEABLE", [request.param == "setters"])
    return request.param


def test_model_code_reading_torch_state_inside_compiled_region(state_tracing):
    a = torch.randn(8, 8)

    def step(a):
        with mixprec.autocast("cpu"):
            on = torch.is_autocast_enabled("cpu")
            low = a @ a
            with torch.autocast("cpu", enabled=False):
                high = a @ a
        return low, high, on

    counter = CompileCounter()
    low, high, on = torch.compile(step, backend=counter, fullgraph=True)(a)
    assert counter.frame_count == 1 and on is True
    assert (low.dtype, high.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(high, a @ a)


def test_tensor_attributes_read_inside_a_compiled_region_are_their_own():
    """Dynamo handed back the previous attribute's value when the region's mode asked whether
    dynamo was tracing before an attribute getter: x.is_nested read as x.dtype, and
    nn.MultiheadAttention's input checks failed under mixprec.compile."""
    x = torch.randn(2, 8, 32)

    def attributes(x):
        return x.dtype, x.is_nested, x.requires_grad, x.is_sparse, x.dtype == torch.float32

    want = attributes(x)
    with mixprec.autocast("cpu"):
        assert torch.compile(attributes, backend="eager")(x) == want
    torch._dynamo.reset()
    assert mixprec.compile(attributes, backend="eager", kernels="native")(x) == want

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    with mixprec.autocast("cpu"):
        eager = mha(x, x, x, need_weights=False)[0]
    compiled = mixprec.compile(mha, backend="aot_eager", kernels="native")
    out = compiled(x, x, x, need_weights=False)[0]
    assert out.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(out, eager)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_region_opened_inside_a_compiled_function_around_attention_is_one_graph(backend):
    """``Tensor.unflatten`` (inside ``F.multi_head_attention_forward``) calls zero-argument
    ``super()``, which dynamo cannot inline when a mode hands the method over: the whole frame
    fell back to eager, and under aot_eager the region's output came back fp32."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)

    def ours(x):
        with mixprec.autocast("cpu"):
            return mha(x, x, x, need_weights=False)[0], x.unflatten(-1, (4, 4))

    def reference(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mha(x, x, x, need_weights=False)[0], x.unflatten(-1, (4, 4))

    counter = CompileCounter() if backend == "eager" else backend
    out, unflat = torch.compile(ours, backend=counter, fullgraph=True)(x)
    want, want_unflat = reference(x)
    assert out.dtype == want.dtype == torch.bfloat16
    assert torch.equal(out, want) and torch.equal(unflat, want_unflat)
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    (want_grad,) = torch.autograd.grad(want.float().sum(), x)
    assert torch.equal(grad, want_grad)
    if backend == "eager":
        assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_edited_policy_holds_under_compile(backend, state_tracing):
    # layer_norm moved to fp32 (torch's CPU list leaves it alone) and mm taken out of the list:
    # the guards that keep torch's dispatcher off trace without a graph break.
    policy = mixprec.Policy().move("layer_norm", to="fp32").move("mm", to="passthrough")
    a = torch.randn(8, 8)

    def f(a):
        with mixprec.autocast("cpu", policy=policy):
            return F.layer_norm(a.bfloat16(), (8,)), torch.mm(a, a)

    counter = CompileCounter() if backend == "eager" else backend
    ln, mm = torch.compile(f, backend=counter, fullgraph=True)(a)
    assert (ln.dtype, mm.dtype) == (torch.float32, torch.float32)
    e_ln, e_mm = f(a)
    assert torch.equal(ln, e_ln) and torch.equal(mm, e_mm)
    if backend == "eager":
        assert counter.frame_count == 1


def test_trainstep_compile_keeps_the_loss_in_fp32():
    model = _model()
    step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                             compile={"backend": "aot_eager", "fullgraph": True})  # fmt: skip
    model2 = _model()
    ref = mixprec.TrainStep(model2, torch.optim.SGD(model2.parameters(), lr=0.1), F.cross_entropy,
                            compile=False)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        got, want = step(x, y), ref(x, y)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_functions_met_later_do_not_recompile_compiled_code():
    # Dynamo guards on what a traced __torch_function__ reads. Functions first met after a
    # compile (torch internals, torch.ops overloads, property getters, user callables) must not
    # change it: that would recompile every compiled function, and a property getter as a dict
    # key broke dynamo's guards outright.
    model, x = _model(), torch.randn(8, 16)
    counter = CompileCounter()
    compiled = torch.compile(lambda x: model(x).sum(), backend=counter)
    with mixprec.autocast("cpu"):
        compiled(x)
        torch.ops.aten.relu.default(x)
        _ = x.shape, x.dtype, x.T
        mixprec.float_function(lambda t: t * 2)(x)
        compiled(x)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_user_functions_keep_their_category_in_a_compiled_region(backend, state_tracing):
    # Dynamo evaluates has_torch_function as false for plain tensors, so no mode sees a
    # declared function's call: its body used to be inlined past the policy (bf16 where the
    # user asked for fp32).
    w = torch.randn(16, 16)
    seen = []

    @mixprec.float_function
    def island(x, w):
        seen.append(torch.is_autocast_enabled("cpu"))
        return x @ w

    @mixprec.half_function
    def low(x):
        return x @ x.t()

    def f(x):
        return island(x @ w, w), low(x.double().float())

    x = torch.randn(8, 16)
    with mixprec.autocast("cpu"):
        want = f(x)
    counter = CompileCounter() if backend == "eager" else backend
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    with mixprec.autocast("cpu"):
        got = compiled(x)
    assert [t.dtype for t in want] == [t.dtype for t in got] == [torch.float32, torch.bfloat16]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert seen == [False, False]  # the body ran with autocast off, eagerly and in the trace


def test_a_cuda_bf16_region_in_compiled_code_asks_for_bf16_support_at_trace_time_only(
    monkeypatch, state_tracing
):
    """torch 2.11's dynamo cannot trace torch.cuda.is_bf16_supported (a graph break; fullgraph
    raises): the region's check is a constant of the process, asked while tracing, not traced."""
    asked = []

    def untraceable() -> bool:
        asked.append(torch.compiler.is_compiling())
        torch._dynamo.graph_break()  # what torch 2.11 does with the real one, made explicit
        return True

    if not torch.cuda.is_available():
        if torch.version.cuda is not None:
            pytest.skip("CUDA faked on a CUDA build without a driver fails inside dynamo")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        # dynamo saves and restores the CUDA RNG state around a trace when CUDA is available
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", untraceable)
    x = torch.randn(4, 4)

    def step(x):
        with mixprec.autocast("cuda", dtype="bf16"):
            return x * 2  # CPU tensors: the CUDA region is what is checked, not the math

    counter = CompileCounter()
    out = torch.compile(step, backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1 and torch.equal(out, x * 2)
    assert asked  # it was asked (once per trace, eagerly)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "an old GPU")
    with pytest.raises(mixprec.AutocastError, match="no bf16 support"):
        step(x)


def test_compiled_region_guards_the_dispatch_table_not_each_of_its_keys():
    """A traced lookup in the mode's memo (about 1,400 functions) made dynamo guard the memo's
    keys one by one: on the H100, mixprec.autocast + compile ran at 1.16-1.23x torch.autocast +
    compile's time, its guard checks 4x torch's. Traced code now reads the rule by an index baked
    in at trace time, so the guards do not grow with the number of functions called."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def body(x, w):
        y = F.gelu(F.linear(x, w)).softmax(-1)
        y = torch.exp(y) + torch.log1p(y.abs()) - torch.tanh(y) * torch.sigmoid(y)
        y = F.layer_norm(y, y.shape[-1:]) @ w.t()
        return (torch.cumsum(y, -1).mean() + torch.logsumexp(y, -1).sum()
                + torch.norm(y) + torch.var(y) + torch.prod(y.clamp(0.5, 1.5)))  # fmt: skip

    def f(x, w):
        with mixprec.autocast("cpu"):
            return body(x, w)

    torch._dynamo.reset()
    torch.compile(f, backend="eager")(torch.randn(4, 16), torch.randn(16, 16))
    (entry,) = _debug_get_cache_entry_list(f.__code__)
    guards = str(entry.guard_manager)
    assert guards.count("dict.keys") <= 6, guards.count("dict.keys")
