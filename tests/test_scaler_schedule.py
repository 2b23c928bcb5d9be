"""`mixprec.SkipAwareLR` and `GradScaler.last_step_skipped`: schedules that ignore skipped steps.

The reference for every schedule is a run whose overflowing batches were removed, with a plain
torch scheduler stepped once per remaining batch: with fp32 models and power-of-two scales a
skipped batch must leave no trace, in the parameters, the optimizer state or the lr.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import mixprec
from tests.helpers import no_host_reads, uncompiled_step
from tests.replay_backend import KernelReplay, install

INF = float("inf")
STEPS = 12
BAD = {0, 4, 5, 9}  # the very first step, two in a row, one later


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


_gen = torch.Generator().manual_seed(3)
BATCHES = [(torch.randn(4, 6, generator=_gen), torch.randn(4, 2, generator=_gen))
           for _ in range(STEPS)]  # fmt: skip


def _warmup_linear(step: int, warmup: int = 3, total: int = STEPS) -> float:
    # The Transformers get_linear_schedule_with_warmup lambda.
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


SCHEDULES = {
    "linear-warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(_warmup_linear)),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6),
    "warmup-then-cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)], milestones=[3]),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=STEPS + 4),
}  # fmt: skip

OPTIMIZERS = {  # (factory, mode SkipAwareLR picks)
    "sgd-momentum": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), "host"),
    "adamw-fused": (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), "device"),
    "adam-tensor-lr": (lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2), fused=True),
                       "device"),
}  # fmt: skip


def _wrapped_run(make_opt, make_sched, steps=range(STEPS), bad=BAD):
    model = _model()
    opt = make_opt(model.parameters())
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    sched = mixprec.SkipAwareLR(make_sched(opt), scaler)
    lrs = []
    for i in steps:
        x, y = BATCHES[i]
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if i in bad:
            model[0].weight.grad[1, 1] = INF
        scaler.step(opt)
        scaler.update()
        sched.step()
        lrs.append([float(v) for v in sched.get_last_lr()])
    return model, opt, sched, lrs


def _reference_run(make_opt, make_sched, bad=BAD, device_lr=True):
    """Only the good batches; a plain torch scheduler. A tensor lr gets the values a plain
    scheduler computes on a float-lr twin (what SkipAwareLR's table holds)."""
    model = _model()
    opt = make_opt(model.parameters())
    tensor_lr = isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    if device_lr and opt.param_groups[0].get("fused") and not tensor_lr:
        # SkipAwareLR puts a fused optimizer's lr on the device, with the values its scheduler
        # computes for the float lr: the reference's come from a float-lr twin.
        twin = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": g["lr"]}
                                for g in opt.param_groups])  # fmt: skip
        sched = make_sched(twin)
        for g, t in zip(opt.param_groups, twin.param_groups, strict=True):
            g["lr"] = torch.tensor(t["lr"], dtype=torch.float32)
    else:
        twin, sched = opt, make_sched(opt)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    lrs = []
    for i in range(STEPS):
        if i not in bad:
            x, y = BATCHES[i]
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            if twin is not opt:
                twin.step()  # a no-op: it tells the scheduler the order is right
            sched.step()
            if twin is not opt:
                for g, t in zip(opt.param_groups, twin.param_groups, strict=True):
                    g["lr"].fill_(t["lr"])
        lrs.append([float(g["lr"]) for g in opt.param_groups])
    return model, opt, lrs


@pytest.mark.parametrize("sched_name", sorted(SCHEDULES))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_schedule_ignores_skipped_steps(opt_name, sched_name):
    make_opt, mode = OPTIMIZERS[opt_name]
    if sched_name == "onecycle":
        mode = "host"  # it cycles the momentum too
    model, opt, sched, lrs = _wrapped_run(make_opt, SCHEDULES[sched_name])
    ref_model, ref_opt, ref_lrs = _reference_run(make_opt, SCHEDULES[sched_name],
                                                 device_lr=mode == "device")  # fmt: skip
    assert sched.mode == mode, sched.reason
    assert lrs == ref_lrs
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(),
                                                 strict=True))  # fmt: skip
    assert sched.applied == STEPS - len(BAD)
    for key, entry in opt.state_dict()["state"].items():
        for field, value in entry.items():
            assert torch.equal(value, ref_opt.state_dict()["state"][key][field]), field


def test_two_param_groups_follow_their_own_schedule():
    def make_opt(params):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}],
                                 lr=1e-2, fused=True)  # fmt: skip

    _, opt, _, lrs = _wrapped_run(make_opt, SCHEDULES["cosine"])
    _, _, ref_lrs = _reference_run(make_opt, SCHEDULES["cosine"])
    assert lrs == ref_lrs and lrs[-1][0] != lrs[-1][1]
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)


def test_device_mode_reads_nothing_on_the_host():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
    sched = mixprec.SkipAwareLR(SCHEDULES["warmup-then-cosine"](opt), scaler, horizon=4)
    for i, (x, y) in enumerate(BATCHES):
        with no_host_reads() if i >= 2 else contextlib.nullcontext():  # state exists after step 1
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if i in BAD:
                model[0].weight.grad[0, 0] = INF
            scaler.step(opt)
            scaler.update()
            sched.step()  # the table (horizon 4) grows on the host, still without a read
    assert sched.mode == "device" and sched.applied == STEPS - len(BAD)


def test_reasons_are_stated():
    model = _model()
    scaler = mixprec.GradScaler("cpu")
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (mixprec.SkipAwareLR(SCHEDULES["step"](fused), scaler),
         "AdamW reads a device lr (fused or capturable): the lr became a 0-dim device tensor and "
         "the schedule writes it there, no host sync"),
        (mixprec.SkipAwareLR(SCHEDULES["step"](sgd), scaler),
         "SGD reads its lr on the host (pass fused=True, or capturable=True for Adam/AdamW, to "
         "keep the lr on the device): one host read of the skip flag per step, a sync on an "
         "accelerator"),
        (mixprec.SkipAwareLR(SCHEDULES["onecycle"](torch.optim.SGD(model.parameters(), lr=0.1,
                                                                   momentum=0.9)), scaler),
         "OneCycleLR cycles the momentum too, which SGD reads on the host: one host read of the "
         "skip flag per step"),
        (mixprec.SkipAwareLR(SCHEDULES["step"](torch.optim.SGD(model.parameters(), lr=0.1)),
                             None),
         "no loss scaler: no step is ever skipped, so no flag is read"),
    ]  # fmt: skip
    for sched, reason in cases:
        assert sched.reason == reason


def test_without_a_scaler_it_is_the_plain_schedule():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin = torch.optim.SGD(_model().parameters(), lr=0.1)
    sched = mixprec.SkipAwareLR(SCHEDULES["exponential"](opt), None)
    plain = SCHEDULES["exponential"](twin)
    with no_host_reads():
        for _ in range(5):
            sched.step()
            twin.step()  # a no-op (no gradients) that keeps torch's order check quiet
            plain.step()
    assert sched.get_last_lr() == plain.get_last_lr()


def test_the_issue12_pattern_last_step_skipped():
    """Accelerate / Transformers Trainer: step the scheduler only `if not step_was_skipped`."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, hysteresis=2)
    sched = SCHEDULES["linear-warmup"](opt)
    flags = []
    assert scaler.last_step_skipped is False  # before the first update
    for i, (x, y) in enumerate(BATCHES):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if i in BAD:
            model[0].weight.grad[0, 0] = INF
        scaler.step(opt)
        scaler.update()
        flags.append(scaler.last_step_skipped)
        if not flags[-1]:
            sched.step()
    assert flags == [i in BAD for i in range(STEPS)]  # exact, hysteresis or not
    ref_model, _, ref_lrs = _reference_run(OPTIMIZERS["sgd-momentum"][0],
                                           SCHEDULES["linear-warmup"])  # fmt: skip
    assert sched.get_last_lr() == ref_lrs[-1]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(),
                                                 strict=True))  # fmt: skip
    # The flag survives a checkpoint and a copy, like every other field.
    other = mixprec.GradScaler("cpu")
    other.load_state_dict(scaler.state_dict())
    assert other.last_step_skipped is copy.deepcopy(scaler).last_step_skipped is (STEPS - 1 in BAD)


def test_step_skipped_is_one_persistent_flag_per_optimizer():
    model = _model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu")
    assert scaler.step_skipped(opt_a) is None
    seen = []
    for i, (x, y) in enumerate(BATCHES[:3]):
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if i == 1:
            model[2].bias.grad[0] = INF  # only opt_b's gradients overflow
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        seen.append((float(scaler.step_skipped(opt_a)), float(scaler.step_skipped(opt_b))))
        flag = scaler.step_skipped(opt_b)
        assert flag is scaler.step_skipped(opt_b)  # the same tensor every step
    assert seen == [(0.0, 0.0), (0.0, 1.0), (0.0, 0.0)]


def test_step_skipped_finds_the_optimizer_inside_a_wrapper():
    model = _model()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                                    dtype="fp16")  # fmt: skip
    x, y = BATCHES[0]
    # .float(): torch 2.11's mse_loss backward fails on mixed fp16/fp32 operands.
    with mixprec.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert opt.scaler.step_skipped(opt) is opt.scaler.step_skipped(opt.optimizer) is not None


def test_checkpoint_and_resume_equals_an_uninterrupted_run():
    make_opt = OPTIMIZERS["adamw-fused"][0]
    full_model, _, full_sched, full_lrs = _wrapped_run(make_opt, SCHEDULES["warmup-then-cosine"])

    model, opt, sched, lrs = _wrapped_run(make_opt, SCHEDULES["warmup-then-cosine"],
                                          steps=range(7))  # fmt: skip
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                          "sched": sched.state_dict()})  # fmt: skip
    assert ckpt["sched"]["applied"] == 7 - len(BAD & set(range(7)))
    # a plain torch scheduler loads the wrapped one's state: the same lr at the same step
    plain_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    plain = SCHEDULES["warmup-then-cosine"](plain_opt)
    plain.load_state_dict(ckpt["sched"]["scheduler"])
    assert plain.last_epoch == ckpt["sched"]["applied"]

    model = _model()
    model.load_state_dict(ckpt["model"])
    opt = make_opt(model.parameters())
    opt.load_state_dict(ckpt["opt"])
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    sched = mixprec.SkipAwareLR(SCHEDULES["warmup-then-cosine"](opt), scaler)
    sched.load_state_dict(ckpt["sched"])
    for i in range(7, STEPS):
        x, y = BATCHES[i]
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if i in BAD:
            model[0].weight.grad[1, 1] = INF
        scaler.step(opt)
        scaler.update()
        sched.step()
        lrs.append([float(v) for v in sched.get_last_lr()])
    assert lrs == full_lrs
    assert sched.applied == full_sched.applied
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), full_model.parameters(),
                                                 strict=True))  # fmt: skip


def test_bad_state_dicts_are_refused_unchanged():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    sched = mixprec.SkipAwareLR(SCHEDULES["step"](opt), mixprec.GradScaler("cpu"))
    sched.step()
    good = sched.state_dict()
    for bad, text in [
        (SCHEDULES["step"](opt).state_dict(),
         "not a SkipAwareLR state dict (format 'mixprec.SkipAwareLR/1' expected); a plain torch "
         "scheduler's state dict loads into the scheduler before wrapping it."),
        ({**good, "groups": []}, "the state dict has 0 param groups, this optimizer 1."),
        ({**good, "applied": -1}, "state_dict['applied'] = -1 must be an int >= 0."),
    ]:  # fmt: skip
        with pytest.raises(mixprec.ScalerConfigError) as err:
            sched.load_state_dict(bad)
        assert str(err.value) == text
        assert sched.state_dict() == good


# ------------------------------------------------------------------ captured steps


def test_trainstep_replays_read_the_device_lr_and_the_count_ignores_skips():
    """TrainStep captured (the kernel-replay stand-in): the schedule advances between replays,
    on the device; the graph reads the lr tensor; nothing is re-captured; no host read."""
    from tests.test_trainstep import _batches

    batches = _batches(14, overflows={6, 7, 11})

    def build(capture):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sched = SCHEDULES["warmup-then-cosine"](opt)
        step = uncompiled_step(model, opt, F.cross_entropy, dtype="fp16", warmup=1,
                               capture=capture)  # fmt: skip
        return model, step, mixprec.SkipAwareLR(sched, step.scaler, horizon=8)

    ref_model, ref_step, ref_sched = build("eager")
    model, step, sched = build("auto")
    backend = install(step)
    got, want = [], []
    for i, (x, y) in enumerate(batches):
        want.append(ref_step(x, y))
        ref_sched.step()
        with no_host_reads() if i >= 3 else contextlib.nullcontext():
            got.append(step(x, y))
            sched.step()
    assert backend.captured == 1 and step.captured, step.reason
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(),
                                                 strict=True))  # fmt: skip
    stats = step.scaler.stats()["losses"][0]
    assert sched.applied == ref_sched.applied == stats["steps"] - stats["skipped"]
    assert stats["skipped"] >= 3
    assert sched.get_last_lr() == ref_sched.get_last_lr()


def test_schedule_step_inside_a_recorded_step_replays_like_eager():
    """The schedule's step() itself recorded into the graph (device ops only) and replayed."""
    from torch.utils._pytree import tree_flatten

    def make():
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
        return model, opt, scaler, mixprec.SkipAwareLR(SCHEDULES["cosine"](opt), scaler,
                                                       horizon=64)  # fmt: skip

    def body(model, opt, scaler, sched, x, y):
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss * (1 + 0 * x.sum())).backward()  # x[0, 0] = inf poisons the grads
        scaler.step(opt)
        scaler.update()
        sched.step()
        return loss.detach()

    data = [(x.clone(), y) for x, y in BATCHES]
    for i in BAD - {0}:
        data[i][0][0, 0] = INF
    ref = make()
    ref_losses = [body(*ref, x, y) for x, y in data]

    parts = make()
    got = [body(*parts, *data[i]) for i in range(2)]  # optimizer state exists
    static = [t.clone() for t in data[2]]
    leaves, spec = tree_flatten(static)
    backend = KernelReplay()
    graph, loss = backend.capture(lambda x, y: body(*parts, x, y), leaves, spec)
    got.append(loss.clone())
    for x, y in data[3:]:
        static[0].copy_(x)
        static[1].copy_(y)
        backend.replay(graph)
        got.append(loss.clone())
    assert len(got) == len(ref_losses)
    pairs = zip(got, ref_losses, strict=True)
    assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) for a, b in pairs)
    assert all(torch.equal(a, b) for a, b in zip(parts[0].parameters(), ref[0].parameters(),
                                                 strict=True))  # fmt: skip
    assert torch.equal(parts[3]._count, ref[3]._count)  # the applied count, on the device
    assert math.isclose(float(parts[1].param_groups[0]["lr"]), float(ref[1].param_groups[0]["lr"]))
