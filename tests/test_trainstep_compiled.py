"""TrainStep's compiled whole step on the CPU (`mixprec.step.compiled`, `mixprec.graph.kernels`).

The reference is the same TrainStep run uncompiled (``compile=False``), which test_trainstep.py
checks against the hand-written loop bit for bit. The compiled step must agree with it to fp32
rounding where it computes (inductor fuses and reorders fp32 arithmetic) and exactly where it
skips: an overflowing step leaves every parameter, optimizer state tensor and step counter with
its bits, and the scale moves exactly as eagerly (powers of two). Most tests compile with
``aot_eager`` (the same graphs, run by eager kernels: seconds, not tens of seconds); the ones
marked ``inductor`` run the real compiler, whose fusion is what the skip must survive.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.graph.kernels import KERNEL_MODES, choose_kernels
from mixprec.step.compiled import StepUpdate, tensor_lr
from tests.test_trainstep import _batches, _model

pytestmark = pytest.mark.compile

FAST = {"backend": "aot_eager", "kernels": "native"}
OVERFLOWS = {3, 7, 8}
OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
}


def _pair(make_opt, compile_arg, level="O1", dtype="fp16", clip=0.5):
    """An uncompiled and a compiled TrainStep over identical models, with the same scaler rule.

    The uncompiled one's lr is a tensor too, as the compiled step holds it (`tensor_lr`):
    torch's optimizers take another arithmetic path for a tensor lr (last-ulp differences
    that Adam's normalisation amplifies), and what is compared here is compiling, not that.
    """
    steps = []
    for c in (False, compile_arg):
        model = _model()
        kw = {"scaler": mixprec.GradScaler("cpu", growth_interval=4)} if dtype == "fp16" else {}
        step = mixprec.TrainStep(model, make_opt(model.parameters()), F.cross_entropy,
                                 opt_level=level, dtype=dtype, clip_grad_norm=clip, compile=c,
                                 **kw)  # fmt: skip
        if c is False:
            tensor_lr(step.optimizer.optimizer)
        steps.append(step)
    return steps


def _state_bits(step: mixprec.TrainStep) -> list[torch.Tensor]:
    """Every parameter, master, optimizer state tensor and scaler tensor, copied."""
    inner = step.optimizer.optimizer
    out = [p.detach().clone() for p in step.model.parameters()]
    for group in inner.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            out += [v.clone() for v in inner.state.get(p, {}).values() if torch.is_tensor(v)]
    return out


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _tolerance(opt_name: str) -> dict[str, float]:
    # Compiled code computes Adam's bias corrections in fp32 tensors where eager torch takes
    # them in Python doubles: a last-ulp difference in the first update, which Adam's
    # normalisation makes visible (a weight whose gradient is near 0 moves by up to lr * 1e-3)
    # and the fp16 forward carries on. SGD stays within fp32 rounding of eager.
    return {"rtol": 1e-3, "atol": 1e-4} if "adam" in opt_name else {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_compiled_o1_fp16_step_matches_eager_and_skips_exactly(opt_name):
    eager, step = _pair(OPTIMIZERS[opt_name], FAST)
    batches = _batches(12, overflows=OVERFLOWS)
    tol = _tolerance(opt_name)
    for i, (x, y) in enumerate(batches):
        before = _state_bits(step)
        want, got = eager(x, y), step(x, y)
        if i in OVERFLOWS:
            # Skipped inside the compiled graph: nothing moved, to the bit.
            assert step.compiled, step.reason
            assert _bitwise(before, _state_bits(step))
        torch.testing.assert_close(got, want, equal_nan=True, **tol)
    assert "compiled step" in step.reason
    torch.testing.assert_close(list(step.model.parameters()), list(eager.model.parameters()),
                               **tol)  # fmt: skip
    ours, theirs = step.scaler.stats()["losses"][0], eager.scaler.stats()["losses"][0]
    assert ours == theirs  # scale, trackers, steps, skips: the same trajectory
    assert ours["skipped"] >= len(OVERFLOWS)
    # The whole step as one graph, never recompiled; a fused kernel is kept out of graphs by
    # torch, which leaves the forward and an update graph on each side of it.
    assert step.graphs_compiled == (3 if "fused" in opt_name else 1), step.explain()
    assert ("fused kernel" in step.explain()) == ("fused" in opt_name)


@pytest.mark.slow
def test_inductor_o1_adamw_fuses_the_update_and_still_skips_exactly():
    # The real compiler: the where-restore is fused into AdamW's loop.
    eager, step = _pair(OPTIMIZERS["adamw"], {"kernels": "native"})
    batches = _batches(8, overflows={4})
    for i, (x, y) in enumerate(batches):
        before = _state_bits(step)
        want, got = eager(x, y), step(x, y)
        if i == 4:
            assert step.compiled and _bitwise(before, _state_bits(step))
        torch.testing.assert_close(got, want, equal_nan=True, **_tolerance("adamw"))
    torch.testing.assert_close(list(step.model.parameters()), list(eager.model.parameters()),
                               **_tolerance("adamw"))  # fmt: skip
    assert step.scaler.stats()["losses"][0] == eager.scaler.stats()["losses"][0]


def test_update_graph_narrows_inductors_fusion_search_unless_the_caller_says_otherwise(
    monkeypatch,
):
    # The update's nodes all read the skip flag and the inverse scale; inductor's default
    # search pairs each with 64 others through them (tens of seconds for ResNet-50's update).
    seen: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    model = _model()
    _, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                                dtype="bf16")  # fmt: skip
    StepUpdate(opt, None, None)
    StepUpdate(opt, None, {"options": {"max_fusion_buffer_group_pairwise_attempts": 64, "x": 1}})
    StepUpdate(opt, None, {"mode": "max-autotune"})  # torch.compile takes mode or options
    StepUpdate(opt, None, {"backend": "aot_eager"})
    assert seen[0]["options"] == {"max_fusion_buffer_group_pairwise_attempts": 8}
    assert seen[1]["options"] == {"max_fusion_buffer_group_pairwise_attempts": 64, "x": 1}
    assert "options" not in seen[2] and seen[2]["mode"] == "max-autotune"
    assert "options" not in seen[3]


@pytest.mark.slow
def test_inductor_o2_masters_skip_and_copy_back():
    eager, step = _pair(OPTIMIZERS["sgd-momentum"], {"kernels": "native"}, level="O2")
    batches = _batches(8, overflows={5})
    for i, (x, y) in enumerate(batches):
        before = _state_bits(step)
        want, got = eager(x, y), step(x, y)
        if i == 5:
            assert step.compiled and _bitwise(before, _state_bits(step))
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3, equal_nan=True)
    masters = list(mixprec.master_params(step.optimizer))
    assert all(m.dtype == torch.float32 for m in masters)
    # The fp16 weights are the masters, rounded: the copy-back ran inside the graph.
    low = [p for p in step.model.parameters() if p.dtype == torch.float16]
    assert low and all(torch.equal(p, m.half()) for p, m in zip(low, step.optimizer._masters,
                                                                   strict=True))  # fmt: skip
    assert all(p.grad is None for p in low)  # the gradients live in the masters, as eagerly
    torch.testing.assert_close(masters, list(mixprec.master_params(eager.optimizer)),
                               rtol=1e-3, atol=1e-4)  # fmt: skip


def test_bf16_o1_and_o3_without_a_scaler():
    for level in ("O1", "O3"):
        eager, step = _pair(OPTIMIZERS["adamw"], FAST, level=level, dtype="bf16", clip=None)
        for x, y in _batches(5, overflows=()):
            torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-2, atol=1e-2)
        assert step.compiled and step.scaler is None
        torch.testing.assert_close(list(step.model.parameters()),
                                   list(eager.model.parameters()),
                                   rtol=1e-2, atol=1e-2)  # fmt: skip


def test_first_step_creates_state_eagerly_and_a_skipped_one_creates_none():
    _, step = _pair(OPTIMIZERS["adamw"], FAST)
    batches = _batches(4, overflows={0})
    step(*batches[0])  # overflows: decided on the host, creates no state
    assert not step.compiled and "creates optimizer state" in step.reason
    assert not step.optimizer.optimizer.state
    step(*batches[1])
    assert not step.compiled and step.optimizer.optimizer.state
    step(*batches[2])
    assert step.compiled and step.graphs_compiled == 1  # the whole step, as one graph


def test_lr_schedule_never_recompiles():
    eager, step = _pair(OPTIMIZERS["adamw"], FAST, clip=None)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(s.optimizer, max_lr=0.05, total_steps=30,
                                                  cycle_momentum=False)
              for s in (eager, step)]  # fmt: skip
    for x, y in _batches(30, overflows=()):
        torch.testing.assert_close(step(x, y), eager(x, y), **_tolerance("adamw"))
        for s in scheds:
            s.step()
    assert step.graphs_compiled == 1, step.explain()
    assert any("lr held as a 0-dim tensor" in n for n in step.notes)
    lr = step.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and float(lr) == pytest.approx(scheds[0].get_last_lr()[0])


def test_a_scheduler_made_after_compiled_steps_sees_the_optimizer_step():
    # torch warns "lr_scheduler.step() before optimizer.step()" unless the step it wrapped ran.
    _, step = _pair(OPTIMIZERS["sgd-momentum"], FAST)
    batches = _batches(5, overflows=())
    for x, y in batches[:3]:
        step(x, y)
    sched = torch.optim.lr_scheduler.StepLR(step.optimizer, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches[3:]:
            step(x, y)
            sched.step()
    assert step.compiled
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_a_hyperparameter_that_keeps_changing_stops_the_compiled_update():
    # OneCycleLR also cycles Adam's beta1, a Python float the graph bakes in.
    eager, step = _pair(OPTIMIZERS["adamw"], FAST, clip=None)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(s.optimizer, max_lr=0.05, total_steps=12)
              for s in (eager, step)]  # fmt: skip
    for x, y in _batches(12, overflows=()):
        torch.testing.assert_close(step(x, y), eager(x, y), **_tolerance("adamw"))
        for s in scheds:
            s.step()
    assert not step.compiled and "betas of param group 0" in step.reason
    assert step.graphs_compiled <= 2 + 4  # stopped before dynamo's limit (8) could hide it
    assert "hold the value in a 0-dim tensor" in step.explain()


def test_new_input_shape_compiles_once_more():
    _, step = _pair(OPTIMIZERS["sgd-momentum"], FAST)
    for x, y in _batches(4, overflows=()):
        step(x, y)
    before = step.graphs_compiled
    for x, y in _batches(3, overflows=(), batch=5):
        step(x, y)
    assert step.compiled and step.graphs_compiled > before
    assert "compiled" in step.explain()


def test_checkpoint_from_a_compiled_step_loads_into_an_eager_one_and_back():
    batches = _batches(12, overflows={5})
    _, whole = _pair(OPTIMIZERS["adamw"], FAST)
    for x, y in batches:
        whole(x, y)
    _, first = _pair(OPTIMIZERS["adamw"], FAST)
    for x, y in batches[:4]:
        first(x, y)
    saved = first.state_dict()
    groups = (
        saved["optimizer"].get("param_groups") or saved["optimizer"]["optimizer"]["param_groups"]
    )
    assert isinstance(groups[0]["lr"], float)  # loads anywhere
    eager, _ = _pair(OPTIMIZERS["adamw"], FAST)
    eager.load_state_dict(saved)
    for x, y in batches[4:8]:
        eager(x, y)
    _, last = _pair(OPTIMIZERS["adamw"], FAST)
    last.load_state_dict(eager.state_dict())
    for x, y in batches[8:]:
        last(x, y)
    assert last.compiled
    torch.testing.assert_close(list(last.model.parameters()), list(whole.model.parameters()),
                               **_tolerance("adamw"))  # fmt: skip
    assert last.scaler.stats()["losses"][0] == whole.scaler.stats()["losses"][0]


def test_fallbacks_say_why():
    model = _model()
    with pytest.raises(mixprec.PolicyError, match="compile=False forbids"):
        mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                          capture="compile", compile=False)  # fmt: skip
    with pytest.raises(mixprec.PolicyError, match="'compile'"):
        mixprec.TrainStep(_model(), torch.optim.SGD(_model().parameters(), lr=0.1),
                          F.cross_entropy, capture="compiled")  # fmt: skip

    # A watch runs Python hooks on every call: eager, and the reason says so.
    _, step = _pair(OPTIMIZERS["adamw"], FAST)
    batches = _batches(4, overflows=())
    step(*batches[0])
    with mixprec.watch_nonfinite(step.model):
        step(*batches[1])
        assert not step.compiled and "watch_nonfinite" in step.reason
    step(*batches[2])
    assert step.compiled

    # State the graph would freeze (a Python number): eager, with the reason; or an error.
    class PyState(torch.optim.SGD):
        def step(self, closure=None):
            out = super().step(closure)
            for p in self.state:
                self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
            return out

    for capture in ("auto", "compile"):
        model = _model()
        step = mixprec.TrainStep(model, PyState(model.parameters(), lr=0.1, momentum=0.5),
                                 F.cross_entropy, dtype="bf16", compile=FAST,
                                 capture=capture)  # fmt: skip
        step(*batches[0])
        if capture == "compile":
            with pytest.raises(mixprec.TrainStepError, match="cannot compile the step: .*'calls'"):
                step(*batches[1])
        else:
            step(*batches[1])
            assert not step.compiled and "Python int" in step.reason
            assert "not compiled" in step.explain()


def test_step_update_blockers_name_the_cause():
    model = _model()
    _, opt = mixprec.initialize(model, torch.optim.LBFGS(model.parameters()), "O1", dtype="bf16")
    assert "closure" in StepUpdate.blocker(opt)
    model = _model()
    _, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                                dtype="fp16", num_losses=2)  # fmt: skip
    assert "num_losses=2" in StepUpdate.blocker(opt)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_blocker_that_needs_no_state_is_named_from_the_first_step(momentum):
    # SGD without momentum never reports its state complete beside a sync scaler: the reason
    # must name the scaler, not promise a compiled update "from the next step" forever.
    batches = _batches(4, overflows=())
    for capture in ("auto", "compile"):
        model = _model()
        step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                 momentum=momentum), F.cross_entropy, dtype="fp16",
                                 scaler=mixprec.GradScaler("cpu", skip_mode="sync"),
                                 compile=FAST, capture=capture)  # fmt: skip
        if capture == "compile":
            with pytest.raises(mixprec.TrainStepError, match="skip_mode='sync'"):
                step(*batches[0])
            continue
        for batch in batches:
            step(*batch)
            assert not step.compiled
            assert "skip_mode='sync'" in step.reason, step.reason
            assert "from the next step" not in step.reason


# ------------------------------------------------------------------ kernel choice


def test_fp32_route_computes_the_low_precision_result():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
    x = torch.randn(32, 64)
    outs = {}
    for mode in ("native", "fp32"):
        torch._dynamo.reset()
        amp = mixprec.AmpBackend(dtype="bf16", backend="aot_eager", kernels=mode)
        out = torch.compile(model, backend=amp)(x)
        out.float().sum().backward()
        outs[mode] = (out, [p.grad.clone() for p in model.parameters()], amp)
        model.zero_grad()
    (native, g_native, _), (routed, g_routed, amp) = outs["native"], outs["fp32"]
    assert routed.dtype == native.dtype == torch.bfloat16  # the policy's dtype is kept
    assert [c.route for c in amp.kernel_choices] == ["fp32", "fp32"]
    # The same bf16 products summed in fp32, rounded once: at most one bf16 ulp apart.
    torch.testing.assert_close(routed.float(), native.float(), rtol=2**-7, atol=1e-3)
    exact = model.double()(x.double())
    model.float()
    err_native = (native.double() - exact).abs().max()
    err_routed = (routed.double() - exact).abs().max()
    assert err_routed <= 1.5 * err_native
    for a, b in zip(g_routed, g_native, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_auto_keeps_whichever_route_measured_faster(monkeypatch):
    from mixprec.graph import kernels

    for native_ms, fp32_ms, route in (
        (40.0, 2.0, "fp32"),
        (2.0, 3.0, "native"),
        (2.0, 1.9, "native"),
    ):  # within the margin: native
        kernels._CACHE.clear()
        monkeypatch.setattr(kernels, "_time_pair", lambda a, b, t=(native_ms, fp32_ms): t)
        torch._dynamo.reset()
        amp = mixprec.AmpBackend(dtype="bf16", backend="eager", kernels="auto")
        model = torch.nn.Linear(16, 16)
        out = torch.compile(model, backend=amp)(torch.randn(4, 16))
        assert out.dtype == torch.bfloat16
        (choice,) = amp.kernel_choices
        assert choice.route == route and choice.native_ms == native_ms
        assert ("no fast bf16 matmul kernel" in choice.reason) == (route == "fp32")
        assert "aten.linear(4x16, 16x16, 16) bf16" in amp.kernel_summary()
    kernels._CACHE.clear()


def test_one_real_probe_per_family_decides_every_shape():
    from mixprec.graph import kernels

    kernels._CACHE.clear()
    torch._dynamo.reset()
    amp = mixprec.AmpBackend(dtype="bf16", backend="eager", kernels="auto")
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 48),
        torch.nn.Linear(48, 16),
        torch.nn.Unflatten(1, (1, 4, 4)),
        torch.nn.Conv2d(1, 4, 3),
    )
    torch.compile(model, backend=amp)(torch.randn(8, 32))
    first, second, conv = amp.kernel_choices
    assert first.native_ms > 0 and first.fp32_ms > 0
    assert (first.native_ms, first.fp32_ms) == (second.native_ms, second.fp32_ms)
    assert "matmul probe" in first.reason and "convolution probe" in conv.reason
    assert set(kernels._CACHE) == {("matmul", torch.bfloat16), ("convolution", torch.bfloat16)}


def test_the_probe_times_the_fp32_route_in_fp32_inside_an_autocast_region(monkeypatch):
    """TrainStep's O1 forward compiles inside its autocast region: the probe must not inherit
    it (the fp32 route then ran in bf16, both routes timed the slow kernel and, cached, every
    later choice in the process kept the 16-bit kernel: 840 ms against fp32's 32 ms a step)."""
    from mixprec.graph import kernels

    dtypes: list[torch.dtype] = []
    real_mm = torch.nn.functional.linear

    def timed(a, b, rounds=3):
        a()
        b()
        return 2.0, 1.0

    def linear(x, w, *rest):
        dtypes.append(torch.mm(x.reshape(-1, x.shape[-1]), w.t()).dtype)
        return real_mm(x, w, *rest)

    kernels._CACHE.clear()
    monkeypatch.setattr(kernels, "_time_pair", timed)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), mixprec.autocast("cpu", dtype="bf16"):
            assert kernels.probe("matmul", torch.bfloat16) == (2.0, 1.0)
    finally:
        kernels._CACHE.clear()
    assert torch.float32 in dtypes, dtypes  # the fp32 route multiplied in fp32


def test_kernel_mode_errors_list_the_options():
    with pytest.raises(mixprec.PolicyError) as err:
        mixprec.AmpBackend(kernels="fastest")
    for mode in KERNEL_MODES:
        assert repr(mode) in str(err.value)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert choose_kernels(gm, "cuda") == []  # GPUs: not measured


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_resumed_compiled_run_equals_the_uninterrupted_one_bit_for_bit(dtype):
    """A checkpoint stores the lr as a float; the resumed step holds it as a tensor again (a
    float lr is another graph constant: the resumed run drifted by an fp32 rounding), and its
    first step runs the compiled update, as the uninterrupted run's does (a freshly loaded
    scaler had no skip flag yet, and the update ran eagerly, said to be creating state)."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(5)]  # fmt: skip

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 4))  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return mixprec.TrainStep(model, opt, F.cross_entropy, dtype=dtype, compile=FAST)

    whole = build()
    for x, y in batches:
        whole(x, y)
    first = build()
    for x, y in batches[:3]:
        first(x, y)
    resumed = build()
    resumed.load_state_dict(first.state_dict())
    for x, y in batches[3:]:
        resumed(x, y)
        assert resumed.compiled and "compiled" in resumed.reason, resumed.reason
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def _accumulate_grad_copies(step: mixprec.TrainStep, x: torch.Tensor, y: torch.Tensor) -> int:
    """How many copies autograd's AccumulateGrad made during one (compiled) step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(x, y)
    count = 0
    for event in prof.events():
        parent = event.cpu_parent
        while event.name == "aten::copy_" and parent is not None:
            if "AccumulateGrad" in parent.name:
                count += 1
                break
            parent = parent.cpu_parent
    return count


@pytest.mark.slow
def test_compiled_conv_step_returns_gradients_in_the_weights_layout():
    # Inductor runs CPU convolutions channels-last; left on, every conv weight's gradient came
    # back channels-last and AccumulateGrad copied it into the weight's layout each step.
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
            torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10),
        )  # fmt: skip

    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    copies = {}
    # The two-graph step, where autograd accumulates the compiled backward's gradients (as one
    # graph, the step writes them into the weights' buffers itself).
    two = {"one_graph": False}
    inductors = {**two, "options": {"layout_optimization": True}}
    for name, compile_arg in (("kept", two), ("inductor's", inductors)):
        model = net()
        step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 F.cross_entropy, dtype="bf16", compile=compile_arg)  # fmt: skip
        for _ in range(3):
            step(x, y)
        assert step.compiled, step.explain()
        copies[name] = _accumulate_grad_copies(step, x, y)
        assert ("layout optimization off" in step.explain()) == (name == "kept")
    assert copies == {"kept": 0, "inductor's": 2}  # the two conv weights, copied
    # A model with no convolution weight compiles with inductor's own settings.
    model = _model()
    plain = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              F.cross_entropy, dtype="bf16")  # fmt: skip
    assert not any("layout" in note for note in plain.notes)
