"""Modules kept in fp32 (the policy's ``fp32_modules``), online healing and `tune_policy`.

References: a module kept in fp32 must compute exactly what the same module computes in fp32
under ``torch.autocast(enabled=False)`` with its inputs cast up by hand (eager and compiled);
a healed run must continue exactly as a run started with the healed policy; a healthy run with
``heal=True`` must be bit for bit the run without it; `tune_policy`'s measured magnitudes are
checked against an fp32 forward hook. fp16 numerics are IEEE on the CPU, so the overflows are
real ones (the CUDA op table makes the CPU region behave as a GPU's would).
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.heal.online import HealCheckpointError
from mixprec.levels.optimizer import AmpCheckpointError
from mixprec.policy.fp32_modules import select_fp32

from .helpers import no_host_reads

GPU = "table=cuda"  # torch.autocast's CUDA lists on the CPU: the region a GPU run would get
FAST = {"backend": "aot_eager", "kernels": "native"}


class FF(nn.Module):
    """T5's feed-forward: wi -> relu -> wo (no biases)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.wi = nn.Linear(d, 4 * d, bias=False)
        self.wo = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wi(x)))


class Net(nn.Module):
    """inp -> (residual) ff(ln(h) * gain) -> ln2 -> head; `big` scales wo past fp16's range."""

    def __init__(self, d: int = 16, big: float = 1.0, gain: float = 30.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.ln = nn.LayerNorm(d)
        self.ff = FF(d)
        self.ln2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)
        self.gain = gain
        with torch.no_grad():
            self.ff.wi.weight.mul_(30.0)
            self.ff.wo.weight.mul_(big)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.ff(self.ln(h) * self.gain)
        return self.head(self.ln2(h))


def overflowing() -> Net:
    torch.manual_seed(0)
    return Net(big=300.0)  # wo's output reaches ~2.5e5 in fp32: inf in fp16


def healthy() -> Net:
    torch.manual_seed(0)
    return Net(big=1.0, gain=1.0)


def data(n: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(n)]


def loop(model: nn.Module, opt: mixprec.AmpOptimizer, batches) -> list[float]:
    """Apex's loop: forward, scale_loss, step; the losses as floats."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    opt._scaling.flush()
    return losses


# ------------------------------------------------------------------ the policy's fp32 modules


def test_policy_string_form_round_trips_and_dedupes():
    p = mixprec.Policy.from_string("compute=fp16,fp32=softmax,fp32_modules=ff.wo+blocks.*.attn")
    assert p.fp32_modules == ("ff.wo", "blocks.*.attn")
    assert mixprec.Policy.from_string(str(p)) == p
    assert p.keep_fp32("ff.wo", "head").fp32_modules == ("ff.wo", "blocks.*.attn", "head")
    assert p.without_fp32("ff.wo").fp32_modules == ("blocks.*.attn",)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("fp32_modules=a b", "not valid.*no spaces"),
        ("fp32_modules@cuda=ff", "without a scope"),
        ("fp32_module=ff", "Did you mean 'fp32_modules'"),
    ],
)
def test_policy_refuses_bad_module_selectors(text, match):
    with pytest.raises(mixprec.PolicyError, match=match):
        mixprec.Policy.from_string(text)
    with pytest.raises(mixprec.PolicyError, match="tuple of module names"):
        mixprec.Policy(fp32_modules="ff.wo")
    with pytest.raises(mixprec.PolicyError, match="does not keep 'x'"):
        mixprec.Policy().without_fp32("x")


def test_selectors_match_names_and_globs_and_collapse_nested():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    assert select_fp32(model, ["0.*"]) == ["0.0", "0.1"]
    assert select_fp32(model, ["0", "0.1"]) == ["0"]  # the parent's region covers the child
    with pytest.raises(mixprec.PolicyError, match="no module of that name.*Closest names: '0.1'"):
        select_fp32(model, ["0.2"])


def _by_hand(model: Net, x: torch.Tensor) -> torch.Tensor:
    """Net's forward under torch.autocast with ff.wo computed in fp32 by hand."""
    with torch.autocast("cpu", dtype=torch.float16):
        h = model.inp(x)
        a = torch.relu(model.ff.wi(model.ln(h) * model.gain))
        with torch.autocast("cpu", enabled=False):
            a = model.ff.wo(a.float())
        return model.head(model.ln2(h + a))


def test_a_kept_module_computes_what_the_same_module_computes_in_fp32_by_hand():
    # torch.autocast's CPU table lowers linear like CUDA's: the reference is torch's own.
    model = overflowing()
    x = torch.randn(4, 8)
    ref = _by_hand(model, x)
    init, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                                 dtype="fp16", policy="fp32_modules=ff.wo")  # fmt: skip
    out = init(x)
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref)
    seen = {}
    init.ff.wo.register_forward_hook(lambda m, a, o: seen.update(inp=a[0].dtype, out=o.dtype))
    init.ff.wi.register_forward_hook(lambda m, a, o: seen.update(wi=o.dtype))
    init(x)
    assert seen == {"inp": torch.float32, "out": torch.float32, "wi": torch.float16}


def test_a_kept_module_compiles_to_the_same_values_as_eager():
    model = overflowing()
    x = torch.randn(4, 8)
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                                  dtype="fp16", policy=f"{GPU},fp32_modules=ff.wo")  # fmt: skip
    eager = model(x)
    compiled = mixprec.compile(lambda t: model(t), policy=f"{GPU},fp32_modules=ff.wo",
                               dtype="fp16", device_type="cpu", **FAST)  # fmt: skip
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(compiled(x), eager)


def test_fp32_modules_are_refused_where_they_cannot_work_and_change_nothing():
    model = overflowing()
    with pytest.raises(mixprec.PolicyError, match="works at O1.*overflow again"):
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                           dtype="fp16", policy="fp32_modules=ff.wo")  # fmt: skip
    with pytest.raises(mixprec.PolicyError, match="works at O1"):
        mixprec.describe("O3", device_type="cuda", heal=True)
    with pytest.raises(mixprec.PolicyError, match="no module of that name.*'ff.wo'"):
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                           dtype="fp16", policy="fp32_modules=ff.w0")  # fmt: skip
    assert not model._forward_pre_hooks and not model.ff.wo._forward_pre_hooks
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_heal_config_validates_and_describe_says_what_heal_does():
    with pytest.raises(mixprec.PolicyError, match="overflows=5 exceeds window=3"):
        mixprec.HealConfig(overflows=5, window=3)
    with pytest.raises(mixprec.PolicyError, match="not a HealConfig field.*'overflows'"):
        mixprec.describe("O1", device_type="cuda", heal={"overflow": 2})
    text = str(mixprec.describe("O1", device_type="cuda", heal={"overflows": 2}))
    assert "heal                   = on" in text and "overflows 2x within 50 updates" in text
    assert "a TrainStep replays the steps skipped before a move" in text
    off = str(mixprec.describe("O1", device_type="cuda", heal={"replay": False}))
    assert "heal                   = on" in off and "replays" not in off
    assert "inactive" in str(mixprec.describe("O1", device_type="cpu", dtype="bf16", heal=True))


# ------------------------------------------------------------------ online healing


def test_healing_moves_the_overflowing_module_and_the_run_continues_as_the_healed_policy():
    model = overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt = mixprec.initialize(model, opt, "O1", dtype="fp16", policy=GPU, heal=True)
    batches = data(30)
    losses = loop(model, opt, batches[:25])
    healer = opt.healer
    assert [m.module for m in healer.moves] == ["ff.wo"]
    move = healer.moves[0]
    assert move.phase == "forward" and move.overflows == 3 and move.op == "mm"
    assert "keep_fp32('ff.wo')" in str(move) and "no loss scale fixes" in str(move)
    assert "its forward (op mm) produced the first inf of 3 skipped steps" in str(move)
    assert not healer.diagnosing  # the watch came off after `quiet` clean updates
    after = [i for i, v in enumerate(losses) if i > move.update + 1]
    assert after and all(torch.isfinite(torch.tensor(losses[i])) for i in after)
    assert opt.options.policy == mixprec.Policy.from_string(f"{GPU},fp32_modules=ff.wo")
    # Found by the start-up watch: moved after its third skipped step; the scale went back
    # to where it was before the streak (2^16, halved three times meanwhile, not left at
    # 2^13), and backed off from there only for this model's gradients.
    assert move.update == 2 and move.scale == 2.0**15  # updates 0, 1, 2 skipped
    assert opt.loss_scale >= 2.0**14
    # From here the run is the healed policy's: a copy initialized with it steps identically.
    twin = overflowing()
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.SGD(twin.parameters(), lr=1e-4)
    twin, twin_opt = mixprec.initialize(twin, twin_opt, "O1", dtype="fp16",
                                        policy=f"{GPU},fp32_modules=ff.wo")  # fmt: skip
    twin_opt.scaler.load_state_dict(opt.scaler.state_dict())
    assert loop(twin, twin_opt, batches[25:]) == loop(model, opt, batches[25:])


def test_a_healthy_run_with_heal_is_bit_for_bit_the_run_without():
    runs = []
    for heal in (False, True):
        model = healthy()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = mixprec.initialize(model, opt, "O1", dtype="fp16", policy=GPU, heal=heal)
        runs.append((loop(model, opt, data(25)), [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    assert not opt.healer.moves and opt.healer.diagnoses == 0


def test_idle_healing_reads_the_device_only_at_the_scalers_reports():
    model = healthy()
    step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3), F.mse_loss,
                             dtype="fp16", policy=GPU, heal=True, compile=False)  # fmt: skip
    reports = []
    step.scaler.add_report_listener(reports.append)
    batches = data(80)
    # The first steps create optimizer state (a host decision) and run under the start-up
    # watch; the scale starts too high for these gradients: their skips are the scaler's
    # business (gradients at a high scale), so nothing moves and no diagnosis follows.
    for x, y in batches[:20]:
        step(x, y)
    assert step.healer.diagnoses == 0 and not step.healer.diagnosing
    assert not step.healer.moves
    # After the diagnosis, reports come after 1, 2, 4, 8, then every 10 updates.
    i = 20
    while step.scaler.check_every < 10:
        step(*batches[i])
        i += 1
    gaps = [b - a for a, b in itertools.pairwise(reports)]
    assert gaps[-4:] == [1, 2, 4, 8], reports
    seen = len(reports)
    while len(reports) == seen:  # up to the next report
        step(*batches[i])
        i += 1
    last = reports[-1]
    with no_host_reads():  # nothing between two reports: 9 steps without a host read
        for x, y in batches[i : i + 9]:
            step(x, y)
    step(*batches[i + 9])
    assert reports[-1] == last + 10


@pytest.mark.parametrize("watch_start", [False, True])
def test_healing_looks_often_at_the_start_and_rarely_once_healthy(watch_start):
    model = healthy()
    step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-3), F.mse_loss,
                             dtype="fp16", policy=GPU, heal={"watch_start": watch_start},
                             compile=False,
                             scaler=mixprec.GradScaler("cpu", init_scale=1.0))  # fmt: skip
    reports = []
    step.scaler.add_report_listener(reports.append)
    for x, y in data(50):
        step(x, y)
    assert step.healer.diagnoses == 0 and step.healer.scaler is step.scaler
    assert not step.healer.diagnosing
    # The start-up watch reads every update until `quiet` (5) pass without an overflow; then
    # (or from the start without it) the reports come after 1, 2, 4, 8, then every 10.
    start = [1, 2, 3, 4, 5] if watch_start else []
    first = start[-1] if start else 0
    assert reports[: len(start) + 5] == start + [first + u for u in (1, 3, 7, 15, 25)], reports


@pytest.mark.parametrize("compile", [False, FAST], ids=["eager", "compiled"])
def test_trainstep_heals_and_rebuilds_its_forward_once(compile):
    model = overflowing()
    step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-4), F.mse_loss,
                             dtype="fp16", policy=GPU, heal=True, compile=compile)  # fmt: skip
    rebuilt = []
    step.healer.add_rebuild(lambda: rebuilt.append(step.calls))
    losses = [step(x, y).item() for x, y in data(30)]
    assert [m.module for m in step.healer.moves] == ["ff.wo"]
    assert len(rebuilt) == 1  # once, when the diagnosis ended
    assert all(torch.isfinite(torch.tensor(v)) for v in losses[-5:])
    assert "moved 'ff.wo' to fp32" in step.explain()
    if compile:
        assert step.compiled  # back on the compiled path after the diagnosis
        # The start-up watch ran the first steps eagerly and moved 'ff.wo' there: the step
        # compiles once, with the move, as one graph (forward to update).
        assert step.graphs_compiled == 1, step.explain()
    # Compiled or eager, the healed run takes the same steps (inductor is not used here).
    ref = overflowing()
    ref_step = mixprec.TrainStep(ref, torch.optim.SGD(ref.parameters(), lr=1e-4), F.mse_loss,
                                 dtype="fp16", policy=GPU, heal=True, compile=False)  # fmt: skip
    ref_losses = [ref_step(x, y).item() for x, y in data(30)]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, equal_nan=True)


def test_moves_are_saved_with_checkpoints_and_loaded_back_exactly():
    model = overflowing()
    step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-4), F.mse_loss,
                             dtype="fp16", policy=GPU, heal=True, compile=False)  # fmt: skip
    for x, y in data(20):
        step(x, y)
    state = step.state_dict()
    assert [m["module"] for m in state["optimizer"]["heal"]["moves"]] == ["ff.wo"]
    resumed = overflowing()
    again = mixprec.TrainStep(resumed, torch.optim.SGD(resumed.parameters(), lr=1e-4),
                              F.mse_loss, dtype="fp16", policy=GPU, heal=True,
                              compile=False)  # fmt: skip
    again.load_state_dict(state)
    assert [m.module for m in again.healer.moves] == ["ff.wo"]
    assert again.healer.moves == step.healer.moves
    assert again.options.policy.fp32_modules == ("ff.wo",)
    x, y = data(1)[0]
    assert torch.equal(again(x, y), step(x, y))  # the resumed run keeps the move
    # A run without healing refuses the moves, and a bad state changes nothing.
    plain = overflowing()
    no_heal = mixprec.TrainStep(plain, torch.optim.SGD(plain.parameters(), lr=1e-4),
                                F.mse_loss, dtype="fp16", policy=GPU, compile=False)  # fmt: skip
    with pytest.raises(AmpCheckpointError, match="initialize with heal=True"):
        no_heal.optimizer.load_state_dict(state["optimizer"])
    bad = copy.deepcopy(state)
    bad["optimizer"]["heal"]["moves"][0]["module"] = "ff.w0"
    lr_before = again.optimizer.param_groups[0]["lr"]
    with pytest.raises(AmpCheckpointError, match="has no such module"):
        again.optimizer.load_state_dict(bad["optimizer"])
    assert [m.module for m in again.healer.moves] == ["ff.wo"]
    assert again.optimizer.param_groups[0]["lr"] == lr_before
    with pytest.raises(HealCheckpointError, match="not a healing state"):
        again.healer.check_state({"moves": []})


def test_healing_gives_up_with_a_warning_where_a_move_cannot_help():
    class Root(nn.Module):  # the overflow is in the model's own forward, not a submodule
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h @ h.new_full((8, 8), 3e4))

    model = Root()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt = mixprec.initialize(model, opt, "O1", dtype="fp16", policy=GPU, heal=True)
    with pytest.warns(RuntimeWarning, match="healing stopped.*own forward.*float_function"):
        loop(model, opt, data(25))
    assert opt.healer.stopped is not None and not opt.healer.moves
    assert opt.scaler.check_every == 100  # the scaler's own setting is back


def test_explain_describe_and_metrics_show_the_moves():
    model = overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt = mixprec.initialize(model, opt, "O1", dtype="fp16", policy=GPU, heal=True)
    metrics = mixprec.AmpMetrics(opt, every=1024)
    loop(model, opt, data(20))
    report = mixprec.explain(model, torch.randn(4, 8), dtype="fp16", policy=GPU)
    rows = [r for r in report.rows if r["module"] == "ff.wo"]
    assert rows and all(r["category"] == "fp32" and "moved 'ff.wo'" in r["reason"] for r in rows)
    assert "ff.wo" in report.fp32_modules and "modules kept in fp32" in str(report)
    assert "fp32 modules" not in str(opt.options) or "ff.wo" in str(opt.options)
    assert "fp32_modules=ff.wo" in str(opt.options.policy)
    batch = metrics.flush()
    ((step, text),) = batch.moves
    assert step == opt.healer.moves[0].update + 1 and "moved 'ff.wo'" in text
    assert batch.totals["fp32-modules"] == 1.0
    assert dict(batch.rows)[step]["fp32-modules"] == 1.0


def test_the_integration_engine_heals_and_checkpoints_the_moves():
    from mixprec.integrations.engine import AmpConfig, AmpEngine

    engine = AmpEngine(AmpConfig("O1", dtype="fp16", policy=GPU, options={"heal": True}), "cpu")
    model = engine.convert_module(overflowing())
    opt = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
    for x, y in data(20):
        opt.zero_grad()
        with engine.autocast():
            loss = F.mse_loss(model(x).float(), y)
        engine.scale(loss).backward()
        engine.after_backward()
        engine.step(opt)
    assert [m.module for m in engine.healer.moves] == ["ff.wo"]
    assert engine.options.policy.fp32_modules == ("ff.wo",)
    state = engine.state_dict()
    other = AmpEngine(AmpConfig("O1", dtype="fp16", policy=GPU, options={"heal": True}), "cpu")
    fresh = other.convert_module(overflowing())
    other.wrap_optimizer(torch.optim.SGD(fresh.parameters(), lr=1e-4))
    other.load_state_dict(state)
    assert [m.module for m in other.healer.moves] == ["ff.wo"]


# ------------------------------------------------------------------ tune_policy


def test_tune_policy_finds_the_overflowing_module_with_its_fp32_magnitude():
    model = overflowing()
    batches = data(2)
    peak = []
    handle = model.ff.wo.register_forward_hook(lambda m, a, o: peak.append(o.abs().max()))
    with torch.no_grad():
        model(batches[0][0])
    handle.remove()
    report = mixprec.tune_policy(model, batches, F.mse_loss, policy=GPU)
    assert report.policy == mixprec.Policy.from_string(f"{GPU},fp32_modules=ff.wo")
    (move,) = report.moves
    assert move.why == "forward overflow" and move.limit == 65504.0
    assert move.measured == pytest.approx(float(peak[0]))
    assert move.error_before == float("inf") and move.error_after < 0.01
    assert 0 < move.flops < 1 and move.cost == pytest.approx(move.flops * 7)
    assert report.before["overflow"] and not report.after["overflow"]
    assert "ff.wo: forward overflow" in str(report) and '"why": "forward overflow"' in (
        report.to_json()
    )
    assert all(p.grad is None for p in model.parameters())  # gradients restored


def test_tune_policy_leaves_a_healthy_model_alone():
    report = mixprec.tune_policy(healthy(), data(2), F.mse_loss, policy=GPU)
    assert report.moves == [] and report.policy == mixprec.Policy.from_string(GPU)
    assert report.after["output_error"] < 0.01


def test_tune_policy_meets_an_error_budget_by_moving_the_first_module_past_it():
    model = healthy()
    report = mixprec.tune_policy(model, data(1), F.mse_loss, policy=GPU, act_tol=1e-6,
                                 max_fraction=0.3)  # fmt: skip
    assert report.moves and report.moves[0].why == "activation error"
    assert report.moves[0].measured > 1e-6
    with pytest.raises(mixprec.MixprecError, match="prepared by mixprec.initialize"):
        m = healthy()
        m, _ = mixprec.initialize(m, torch.optim.SGD(m.parameters(), lr=1), "O1")
        mixprec.tune_policy(m, data(1), F.mse_loss)


def test_tune_policy_argument_errors_are_also_builtin_errors():
    # docs/api.md: every user error is a MixprecError and the built-in a caller would catch.
    with pytest.raises(ValueError, match="at least one batch") as err:
        mixprec.tune_policy(healthy(), [], F.mse_loss)
    assert isinstance(err.value, mixprec.MixprecError)
    with pytest.raises(ValueError, match=r"act_tol=0 must be a number in \(0, inf\]"):
        mixprec.tune_policy(healthy(), data(1), F.mse_loss, act_tol=0)
    with pytest.raises(RuntimeError, match="exactly one of loss_fn"):
        mixprec.tune_policy(healthy(), data(1))


def test_underflow_advice_raises_the_scale_or_keeps_the_module_in_fp32():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    (model(torch.randn(8, 4)).sum() * 1e-9).backward()
    report = mixprec.grad_underflow(model, dtype=torch.float16)
    first, _ = report.advice()
    assert "'0': 100.0% of its gradient elements flush" in first and "raise it" in first
    assert report.fix() == mixprec.Policy()  # a higher scale fixes it: nothing to keep
    model.zero_grad()
    out = model(torch.randn(8, 4))
    (out.sum() * 1e-9).backward()
    model[1].bias.grad.fill_(4e4)  # twice the scale would overflow this one
    model[1].weight.grad.fill_(1.0)
    report = mixprec.grad_underflow(model, dtype=torch.float16)
    assert "cannot go higher" in report.advice()[0]
    assert report.fix().fp32_modules == ("0",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "advice:" in str(report)


def test_healing_leaves_no_dispatch_mode_on_the_rest_of_the_process():
    """Healing's watches span training steps (the start-up watch begins in initialize): their
    op checks run only inside the model's forward, so code between steps, and a run that stops
    mid-watch, sees no dispatch mode (torch.compile under one compiled nothing)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt = mixprec.initialize(model, opt, "O1", dtype="fp16", policy=GPU, heal=True)
    assert opt.healer.diagnosing  # the start-up watch
    assert _get_current_dispatch_mode() is None
    seen = []
    inner = next(model.children())  # inside the model's forward
    hook = inner.register_forward_hook(lambda *_: seen.append(_get_current_dispatch_mode()))
    loop(model, opt, data(2))  # stops while the start-up watch is still on
    hook.remove()
    assert seen and all(mode is not None for mode in seen)  # inside the forward: checked
    assert opt.healer.diagnosing and _get_current_dispatch_mode() is None


def _sgd_step(model: nn.Module, **kw) -> mixprec.TrainStep:
    return mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9),
                             F.mse_loss, dtype="fp16", compile=False, **kw)  # fmt: skip


def _with_dropout() -> Net:
    model = overflowing()
    model.inp = nn.Sequential(model.inp, nn.Dropout(0.2))  # draws from the global generator
    return model


@pytest.mark.parametrize("make", [overflowing, _with_dropout], ids=["plain", "dropout"])
def test_trainstep_replays_the_steps_a_move_explains_so_healing_loses_no_update(make):
    # Reference: the same run with the healed policy from the start (no skipped step).
    tuned = _sgd_step(make(), policy=f"{GPU},fp32_modules=ff.wo")
    batches = data(12)
    torch.manual_seed(1)
    ref = [tuned(x, y).item() for x, y in batches]
    rng_after = torch.get_rng_state()
    # Healing, fed from one buffer that the "loader" refills in place: a held batch must be a
    # copy, or the replays would train on the latest batch three times. With dropout, a replay
    # must draw its first attempt's masks, or the run drifts from the reference.
    model = make()
    step = _sgd_step(model, policy=GPU, heal=True)
    bx, by = torch.empty_like(batches[0][0]), torch.empty_like(batches[0][1])
    torch.manual_seed(1)
    losses = []
    for x, y in batches:
        bx.copy_(x)
        by.copy_(y)
        losses.append(step(bx, by).item())
    healer = step.healer
    assert [m.module for m in healer.moves] == ["ff.wo"]
    assert healer.replayed == 3 and "3 skipped step(s) run again" in healer.report()
    # Steps 0 and 1 were skipped (their losses are inf); step 2 returned its replay's loss; the
    # optimizer took every update, in the batches' order, exactly as the tuned run did.
    assert not any(torch.isfinite(torch.tensor(losses[:2])))
    assert losses[2:] == ref[2:]
    for a, b in zip(model.parameters(), tuned.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), rng_after)  # and the generator is where it was
    assert not healer.diagnosing and not healer._held  # nothing kept after the diagnosis


def test_without_replay_the_diagnosed_steps_stay_skipped():
    model = overflowing()
    step = _sgd_step(model, policy=GPU, heal={"replay": False})
    calls = []
    step.optimizer.optimizer.register_step_post_hook(lambda *a: calls.append(1))
    for x, y in data(12):
        step(x, y)
    assert [m.module for m in step.healer.moves] == ["ff.wo"]
    # The three diagnosed steps are lost (here a fourth too: at the restored scale the first
    # unmoved step's gradients overflow, which the replayed run's earlier updates avoid).
    assert step.healer.replayed == 0 and len(calls) <= 12 - 3


def test_an_initialize_loop_cannot_replay_and_holds_nothing():
    model = overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt = mixprec.initialize(model, opt, "O1", dtype="fp16", policy=GPU, heal=True)
    loop(model, opt, data(12))
    assert [m.module for m in opt.healer.moves] == ["ff.wo"]
    assert opt.healer.replayed == 0 and not opt.healer._held


def test_the_fp16_zoo_benchmark_runs_and_reports_the_replayed_moves(tmp_path):
    """benchmarks/fp16_zoo.py at toy length (primer, 12 steps, one seed): the JSON, the table
    and the PNG are written, and the healed run moved primer's c_proj and replayed its skips.

    Run as ``python benchmarks/fp16_zoo.py``, in a process of its own forked from the test
    worker's server (tests/fork_server.py), which imported torch, its dynamo and mixprec once.
    """
    import json
    import sys
    from pathlib import Path

    from tests import fork_server

    root = Path(__file__).resolve().parents[1]
    js, txt, png = tmp_path / "z.json", tmp_path / "z.txt", tmp_path / "z.png"
    out = fork_server.run(
        [sys.executable, str(root / "benchmarks" / "fp16_zoo.py"), "--steps", "12",
         "--models", "primer", "--seeds", "1", "--json", str(js), "--txt", str(txt),
         "--png", str(png)],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(js.read_text())
    heal = doc["summary"]["primer"]["heal"]
    assert heal["moves"] == ["blocks.1.mlp.c_proj"] and heal["replayed"] == 3
    assert heal["skipped_after_last_move"] == 0
    assert doc["summary"]["primer"]["tuned"]["moves"] == ["blocks.1.mlp.c_proj"]
    assert "bf16/fp32 seeds 0: final loss in" in txt.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_replay_is_off_across_processes(monkeypatch):
    # Each rank decides its moves from its own batches: a replay (a collective) that one rank
    # runs and another does not would hang DDP, so several ranks never replay.
    import mixprec.step.trainstep as trainstep

    step = _sgd_step(overflowing(), policy=GPU, heal=True)
    monkeypatch.setattr(trainstep, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    for x, y in data(12):
        step(x, y)
    assert [m.module for m in step.healer.moves] == ["ff.wo"] and step.healer.replayed == 0
