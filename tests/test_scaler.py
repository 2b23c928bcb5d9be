"""GradScaler behaviour: parity with torch.amp.GradScaler, exact device-side skips, the stage
machine's errors, real training patterns, telemetry, checkpoints and their validation."""

from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.scaling import ScalerCheckpointError, SkipEvent
from mixprec.scaling.unscale import Fp16GradientError
from tests.helpers import no_host_reads

INF, NAN = float("inf"), float("nan")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _train(scaler, make_opt, injects=(), steps=30, region=None, model=None):
    model = model or _model()
    opt = make_opt(model.parameters())
    scales = []
    for i, (x, y) in enumerate(_batches(steps)):
        opt.zero_grad(set_to_none=True)
        with region() if region else contextlib.nullcontext():
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if i in injects:
            model[0].weight.grad[0, 0] = INF if i % 2 else NAN
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()], opt


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


# ------------------------------------------------------------------------- parity with torch


@pytest.mark.parametrize("name", ["sgd-momentum", "adam", "adamw-fused", "adagrad"])
def test_trajectory_and_params_equal_torch(name):
    injects = {0, 3, 4, 9, 17}
    kw = {"init_scale": 2.0**10, "growth_interval": 3}
    ref = _train(torch.amp.GradScaler("cpu", **kw), OPTIMIZERS[name], injects,
                 region=lambda: torch.autocast("cpu"))  # fmt: skip
    got = _train(mixprec.GradScaler("cpu", **kw), OPTIMIZERS[name], injects,
                 region=lambda: mixprec.autocast("cpu"))  # fmt: skip
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1], strict=True))


@pytest.mark.parametrize("name", ["adamw-fused", "adam-fused", "sgd-fused", "adam"])
def test_every_gradient_overflowing_skips_like_torch(name):
    # An inf in the input makes every gradient non-finite: found_inf counts several tensors,
    # which fused kernels must still read as "skip" (they compare it with 1.0).
    def run(scaler):
        model = _model()
        opt = OPTIMIZERS[name](model.parameters())
        for i, (x, y) in enumerate(_batches(8)):
            if i in (2, 3):
                x = x.clone()
                x[0, 0] = INF
            opt.zero_grad(set_to_none=True)
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        return model, opt

    ours, ours_opt = run(mixprec.GradScaler("cpu", init_scale=256.0))
    theirs, theirs_opt = run(torch.amp.GradScaler("cpu", init_scale=256.0))
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        for key, value in ours_opt.state[p].items():
            assert torch.equal(value, theirs_opt.state[q][key]), key


def test_default_arguments_match_torch_defaults():
    ours, theirs = mixprec.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    assert ours.get_scale() == theirs.get_scale() == 2.0**16
    assert ours.get_growth_factor() == theirs.get_growth_factor()
    assert ours.get_backoff_factor() == theirs.get_backoff_factor()
    assert ours.get_growth_interval() == theirs.get_growth_interval()


# ------------------------------------------------------------------------- exact skips


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    return params, state


def _same_state(a, b) -> bool:
    if set(a) != set(b):
        return False
    for k in a:
        for name, v in a[k].items():
            w = b[k][name]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v, w):
                    return False
            elif v != w:
                return False
    return True


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["auto", "restore", "sync"])
def test_skipped_step_leaves_params_and_state_bitwise_unchanged(name, mode):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = mixprec.GradScaler("cpu", init_scale=256.0, skip_mode=mode)
    batches = _batches(4)
    for x, y in batches[:2]:  # two clean steps: the optimizer's state exists
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    before = _snapshot(model, opt)
    x, y = batches[2]
    opt.zero_grad()
    scaler.scale(F.mse_loss(model(x), y)).backward()
    model[2].bias.grad[0] = INF
    scaler.step(opt)
    scaler.update()
    params, state = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], params, strict=True))
    assert _same_state(before[1], state)
    assert scaler.get_scale() == 128.0


@pytest.mark.parametrize("name", ["sgd-momentum", "adam", "adamw-fused", "rmsprop"])
def test_run_with_skipped_batches_equals_run_without_them(name):
    """fp32 model, power-of-two scales: scaling is exact, so skipping must be invisible."""
    batches = _batches(8)
    bad = {2, 5}

    def run(use):
        model = _model()
        opt = OPTIMIZERS[name](model.parameters())
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
        for i in use:
            x, y = batches[i]
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if i in bad:
                model[0].weight.grad.view(-1)[3] = NAN
            scaler.step(opt)
            scaler.update()
        return [p.detach() for p in model.parameters()], opt.state_dict()["state"]

    with_bad = run(range(8))
    without = run([i for i in range(8) if i not in bad])
    assert all(torch.equal(a, b) for a, b in zip(with_bad[0], without[0], strict=True))
    assert _same_state(with_bad[1], without[1])


def test_first_step_overflow_creates_no_state():
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    scaler = mixprec.GradScaler("cpu")
    x, y = _batches(1)[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    model[0].weight.grad[0, 0] = INF
    scaler.step(opt)
    scaler.update()
    assert len(opt.state) == 0  # decided on the host, once: nothing to restore afterwards


def _one_step(model, opt, scaler, clip=None):
    """One scaled MSE step; `inject=True` plants an inf in a gradient."""

    def one(x, y, inject=False):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if inject:
            model[0].bias.grad[0] = INF
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        scaler.step(opt)
        scaler.update()

    return one


@pytest.mark.parametrize("name", ["sgd-momentum-foreach", "adamw-fused", "adam-fused-preset",
                                  "sgd-fused", "adagrad-fused"])  # fmt: skip
@pytest.mark.parametrize("clip", [None, 1.0])
def test_no_host_reads_in_steady_state(name, clip):
    """After the first step, scale/unscale_/step/update never read a tensor on the host; nor
    do the skip flag and the fused paths (a preset grad_scale included).

    (Not non-capturable Adam: it reads its own step counter with .item(), which on a GPU is a
    host-side tensor, not a sync, but would trip this CPU test.)
    """
    model = _model()
    opt = {
        "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
        "adamw-fused": OPTIMIZERS["adamw-fused"],
        "adam-fused-preset": OPTIMIZERS["adam-fused"],
        "sgd-fused": OPTIMIZERS["sgd-fused"],
        "adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
    }[name](model.parameters())
    scaler = mixprec.GradScaler("cpu")
    batches = _batches(4)
    one = _one_step(model, opt, scaler, clip=clip)
    one(*batches[0])

    with no_host_reads():
        if name.endswith("preset"):
            opt.grad_scale = torch.tensor(2.0)
        one(*batches[1], inject=True)
        flag = scaler.step_skipped(opt)
        one(*batches[2])
        assert flag is scaler.step_skipped(opt)
    assert scaler.get_scale() == 2.0**15 and float(flag) == 0.0
    assert scaler.last_step_skipped is False


def test_stateless_optimizer_syncs_once_then_never():
    """SGD without momentum keeps no state: after its first step it must not read the host."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu")
    batches = _batches(4)
    one = _one_step(model, opt, scaler)
    one(*batches[0])
    before = [p.detach().clone() for p in model.parameters()]
    with no_host_reads():
        one(*batches[1], inject=True)  # skipped on the device, exactly
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with no_host_reads():
        one(*batches[2])
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler._per_optimizer == {} and scaler.skip_mode(opt)[0] == "restore"


def test_skip_modes_explain_themselves():
    scaler = mixprec.GradScaler("cpu")
    assert scaler.skip_mode(OPTIMIZERS["adamw-fused"](_model().parameters()))[0] == "fused"
    mode, why = scaler.skip_mode(OPTIMIZERS["adam"](_model().parameters()))
    assert mode == "restore" and "no host sync" in why
    sync = mixprec.GradScaler("cpu", skip_mode="sync")
    assert sync.skip_mode(OPTIMIZERS["adam"](_model().parameters()))[0] == "sync"


# ------------------------------------------------------------------------- training patterns


def test_gradient_accumulation_and_clipping_match_torch():
    results = []
    for make, region in ((torch.amp.GradScaler, torch.autocast),
                         (mixprec.GradScaler, mixprec.autocast)):  # fmt: skip
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = make("cpu", init_scale=2.0**8, growth_interval=2)
        batches = _batches(12)
        for step in range(3):
            opt.zero_grad()
            for x, y in batches[step * 4 : step * 4 + 4]:  # 4 micro-batches
                with region("cpu"):
                    loss = F.mse_loss(model(x), y) / 4
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach() for p in model.parameters()], scaler.get_scale()))
    (ref, ref_scale), (got, got_scale) = results
    assert got_scale == ref_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_several_optimizers_skip_independently_like_torch():
    out = []
    for make in (torch.amp.GradScaler, mixprec.GradScaler):
        model = _model()
        opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
        opt_b = torch.optim.Adam(model[2].parameters(), lr=0.1)
        scaler = make("cpu", init_scale=64.0)
        for i, (x, y) in enumerate(_batches(3)):
            opt_a.zero_grad()
            opt_b.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if i == 1:
                model[2].weight.grad[0, 0] = INF  # only opt_b's gradients overflow
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
        out.append(([p.detach() for p in model.parameters()], scaler.get_scale()))
    assert out[0][1] == out[1][1] == 32.0
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0], strict=True))


def test_per_loss_scales():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=1024.0, num_losses=2)
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    out = model(x)
    with scaler.scaled(F.mse_loss(out, y), opt, loss_id=0) as s:
        s.backward(retain_graph=True)
    with scaler.scaled(out.pow(2).mean() * 1e38, opt, loss_id=1) as s:
        s.backward()  # overflows: 1e38 * 1024 is inf in fp32
    scaler.step(opt)
    scaler.update()
    stats = scaler.stats()["losses"]
    assert [round(e["scale"]) for e in stats] == [1024, 512]  # only loss 1 backs off
    assert [e["skipped"] for e in stats] == [0, 1]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    # a clean iteration: unscaled gradients equal the sum of both losses' true gradients
    ref = _model()
    ref.load_state_dict(model.state_dict())
    out, ref_out = model(x), ref(x)
    opt.zero_grad()
    with scaler.scaled(F.mse_loss(out, y), opt, loss_id=0) as s:
        s.backward(retain_graph=True)
    with scaler.scaled(out.pow(2).mean(), opt, loss_id=1) as s:
        s.backward()
    scaler.unscale_(opt)
    (F.mse_loss(ref_out, y) + ref_out.pow(2).mean()).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_per_loss_scaler_refuses_plain_unscale():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", num_losses=2)
    x, y = _batches(1)[0]
    scaler.scale(F.mse_loss(model(x), y), loss_id=1).backward()
    with pytest.raises(mixprec.ScalerStateError, match="scaler.scaled"):
        scaler.step(opt)
    with pytest.raises(mixprec.ScalerConfigError, match=r"must be an int in 0\.\.1"):
        scaler.scale(torch.tensor(1.0), loss_id=2)


def test_sparse_gradients():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=8.0)
    idx = torch.tensor([1, 2, 2])
    ref = emb.weight.detach().clone()
    scaler.scale(emb(idx).sum()).backward()
    scaler.step(opt)
    scaler.update()
    expected = ref.clone()
    expected[1] -= 0.1
    expected[2] -= 0.2
    torch.testing.assert_close(emb.weight.detach(), expected)
    before = emb.weight.detach().clone()
    opt.zero_grad()
    scaler.scale(emb(idx).sum()).backward()
    emb.weight.grad._values()[0, 0] = INF
    scaler.step(opt)
    scaler.update()
    assert torch.equal(emb.weight.detach(), before) and scaler.get_scale() == 4.0


def test_disabled_scaler_is_a_no_op():
    scaler = mixprec.GradScaler("cpu", enabled=False)
    loss = torch.tensor(2.0, requires_grad=True)
    assert scaler.scale(loss) is loss
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()


def test_cuda_scaler_without_cuda_warns_and_disables():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = mixprec.GradScaler()
    assert not scaler.is_enabled()


# ------------------------------------------------------------------------- stage machine


def _one_backward(scaler, model):
    x, y = _batches(1)[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()


def test_stage_errors_name_the_rule():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu")
    with pytest.raises(mixprec.ScalerStateError, match="before the scaler scaled anything"):
        scaler.update()
    with pytest.raises(mixprec.ScalerStateError, match="call scaler.scale"):
        scaler.unscale_(opt)
    _one_backward(scaler, model)
    with pytest.raises(mixprec.ScalerStateError, match="no optimizer was stepped"):
        scaler.update()
    scaler.unscale_(opt)
    with pytest.raises(mixprec.ScalerStateError, match="already called for this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(mixprec.ScalerStateError, match="already called since the last update"):
        scaler.step(opt)
    with pytest.raises(mixprec.ScalerStateError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(mixprec.ScalerStateError, match="does not take a closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_fp16_gradients_point_to_master_weights():
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 8, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(Fp16GradientError, match="opt level O2") as err:
        scaler.step(opt)
    assert "master weights" in str(err.value)


def test_pickling_only_between_iterations():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=32.0)
    _one_backward(scaler, model)
    scaler.unscale_(opt)
    text = (
        "a GradScaler can only be pickled or copied between iterations (before the first "
        "unscale_/step of an iteration, or after update()); this one is in the middle of an "
        "iteration: call scaler.update() first."
    )
    for copier in (pickle.dumps, copy.deepcopy):
        with pytest.raises(mixprec.ScalerStateError) as err:
            copier(scaler)
        assert str(err.value) == text
    scaler.step(opt)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 32.0


@pytest.mark.parametrize("copier", [lambda s: pickle.loads(pickle.dumps(s)), copy.deepcopy],
                         ids=["pickle", "deepcopy"])  # fmt: skip
def test_a_copy_carries_every_field_and_continues_like_the_original(copier):
    kw = {"init_scale": 256.0, "growth_interval": 3, "hysteresis": 2, "min_scale": 2.0}
    original = mixprec.GradScaler("cpu", **kw)
    _train(original, OPTIMIZERS["sgd"], injects={1, 2, 4}, steps=6)
    clone = copier(original)
    assert clone.state_dict() == original.state_dict()  # trackers, counters and history
    assert clone.last_step_skipped is original.last_step_skipped
    # (how each optimizer is skipped is found again at its first step with the copy)
    assert clone.explain().splitlines()[:2] == original.explain().splitlines()[:2]
    ref = _train(original, OPTIMIZERS["sgd"], injects={2}, steps=5)
    got = _train(clone, OPTIMIZERS["sgd"], injects={2}, steps=5)
    assert got[0] == ref[0]
    assert clone.state_dict() == original.state_dict()


def test_a_copy_before_first_use_and_of_a_loaded_scaler_works():
    for scaler in (mixprec.GradScaler("cpu", init_scale=64.0), mixprec.GradScaler("cpu")):
        if scaler.get_scale() != 64.0:
            theirs = torch.amp.GradScaler("cpu", init_scale=64.0)
            scaler.load_state_dict(theirs.state_dict())  # loaded, not run
        for clone in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
            assert clone.state_dict() == scaler.state_dict()
            assert clone.scale(torch.tensor(2.0)).item() == 128.0


# ------------------------------------------------------------------------- telemetry


def test_on_skip_reports_each_overflow_in_batches():
    events: list[SkipEvent] = []
    scaler = mixprec.GradScaler("cpu", init_scale=64.0, on_skip=events.append, check_every=4)
    _train(scaler, OPTIMIZERS["sgd"], injects={1, 2, 6}, steps=8)
    assert [(e.step, e.scale) for e in events] == [(1, 64.0), (2, 32.0), (6, 16.0)]
    stats = scaler.stats()["losses"][0]
    assert stats["skipped"] == 3 and stats["steps"] == 8 and stats["last_skip"] == 6


# ------------------------------------------------------------------------- checkpoints


def test_save_and_resume_is_bitwise_identical():
    injects = {1, 6, 7, 12}
    make = lambda: mixprec.GradScaler("cpu", init_scale=256.0, growth_interval=3, hysteresis=2)  # noqa: E731
    full = _train(make(), OPTIMIZERS["adam"], injects, steps=16)
    model = _model()
    opt = OPTIMIZERS["adam"](model.parameters())
    scaler = make()
    batches = _batches(16)
    scales = []
    for i, (x, y) in enumerate(batches):
        if i == 8:  # save everything, rebuild from scratch, load, continue
            ckpt = pickle.loads(pickle.dumps({
                "model": model.state_dict(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict(),
            }))  # fmt: skip
            model = _model(seed=123)
            model.load_state_dict(ckpt["model"])
            opt = OPTIMIZERS["adam"](model.parameters())
            opt.load_state_dict(ckpt["opt"])
            scaler = mixprec.GradScaler("cpu")
            scaler.load_state_dict(ckpt["scaler"])
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if i in injects:
            model[0].weight.grad[0, 0] = INF
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == full[0]
    assert all(torch.equal(a, b) for a, b in zip(full[1], model.parameters(), strict=True))
    assert scaler.stats()["losses"][0]["skipped"] == len(injects)


def test_state_dict_carries_every_field_and_round_trips():
    scaler = mixprec.GradScaler("cpu", init_scale=128.0, growth_interval=5, hysteresis=3,
                                min_scale=1.0, max_scale=2.0**20)  # fmt: skip
    _train(scaler, OPTIMIZERS["sgd"], injects={2}, steps=4)
    sd = scaler.state_dict()
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",
                "hysteresis", "_hysteresis_tracker", "min_scale", "max_scale", "steps",
                "skipped", "last_skip", "history", "format"):  # fmt: skip
        assert key in sd, key
    assert (sd["_hysteresis_tracker"], sd["skipped"], sd["last_skip"]) == (2, 1, 2)
    other = mixprec.GradScaler("cpu")
    other.load_state_dict(sd)
    assert other.state_dict() == sd  # every field, before first use (lazy state)
    _one_backward(other, _model())
    assert other.state_dict()["history"][:4] == sd["history"][:4]


def test_loads_torch_amp_state_dict_and_torch_loads_ours():
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    _train(theirs, OPTIMIZERS["sgd"], injects={1}, steps=3)
    ours = mixprec.GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == theirs.get_scale() == 256.0
    assert ours.get_growth_interval() == 7
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.get_scale() == 256.0 and back._get_growth_tracker() == 1


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda sd: sd.update(scale=-1.0), "scale.*invalid"),
        (lambda sd: sd.update(scale=float("inf")), "scale.*invalid"),
        (lambda sd: sd.update(scale="big"), "is not a number"),
        (lambda sd: sd.update(growth_factor=0.5), "growth_factor"),
        (lambda sd: sd.update(_growth_tracker=99), "growth_interval"),
        (lambda sd: sd.update(skipped=10, steps=2), "inconsistent"),
        (lambda sd: sd.update(format="other/9"), "format"),
        (lambda sd: sd.pop("growth_interval"), "lacks"),
        (lambda sd: sd.update(history=[1.0]), "history"),
        (lambda sd: sd.update(losses=[{"scale": 2.0}, {"scale": 4.0}]), "num_losses=2"),
        (lambda sd: sd.clear(), "empty"),
    ],
)
def test_bad_state_dict_is_refused_and_changes_nothing(mutate, match):
    scaler = mixprec.GradScaler("cpu", init_scale=64.0, growth_interval=5)
    _train(scaler, OPTIMIZERS["sgd"], injects={1}, steps=3)
    before = scaler.state_dict()
    bad = scaler.state_dict()
    mutate(bad)
    with pytest.raises(ScalerCheckpointError, match=match):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


def test_static_scale_still_skips():
    scaler = mixprec.GradScaler("cpu", init_scale=128.0, dynamic=False)
    scales, _, _ = _train(scaler, OPTIMIZERS["sgd"], injects={1, 2}, steps=5)
    assert scales == [128.0] * 5
    assert scaler.stats()["losses"][0]["skipped"] == 2


def test_unscale_impls_agree_bitwise():
    grads = {}
    for impl in ("foreach", "torch"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**13, unscale_impl=impl)
        _one_backward(scaler, model)
        scaler.unscale_(opt)
        grads[impl] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["foreach"], grads["torch"], strict=True))


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_without_gradients_is_refused_and_changes_nothing(fused):
    """torch.amp's GradScaler raises ("No inf checks were recorded") where the optimizer has no
    gradient, e.g. a forgotten backward: counting that step as clean would grow the scale on no
    evidence while nothing trains. mixprec refuses it before any change, naming the fix."""
    model = torch.nn.Linear(2, 2)
    opt = (torch.optim.Adam(model.parameters(), fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # fmt: skip
    scaler = mixprec.GradScaler("cpu", growth_interval=1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 2)
    scaler.scale(model(x).sum())  # no backward
    with pytest.raises(mixprec.ScalerStateError, match=r"no gradient.*scale\(loss\)\.backward\(\)"):
        scaler.step(opt)
    assert scaler.get_scale() == 2.0**16 and not opt.state
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    # Nothing was half done: the same iteration, with its backward, steps and grows the scale.
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**17 and opt.state


def test_scaled_block_restores_gradients_when_backward_fails():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", num_losses=2)
    x, y = _batches(1)[0]
    with scaler.scaled(F.mse_loss(model(x), y), opt, loss_id=0) as s:
        s.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"), scaler.scaled(model(x).sum(), opt, 1):
        raise RuntimeError("boom")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_a_new_optimizer_at_a_dead_ones_id_gets_its_own_skip_mode():
    """Guards are keyed by id(optimizer): a fused optimizer's guard must not be applied to a
    plain optimizer that Python later allocates at the same address."""
    import gc

    scaler = mixprec.GradScaler("cpu", init_scale=64.0)
    x, y = _batches(1)[0]

    def one_step(opt, model):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    fused_model, plain_model = _model(), _model()
    fused = OPTIMIZERS["adam-fused"](fused_model.parameters())
    plain = OPTIMIZERS["adam"](plain_model.parameters())
    one_step(fused, fused_model)
    # What the allocator does when `plain` reuses the dead `fused`'s address:
    scaler._guards[id(plain)] = scaler._guards.pop(id(fused))
    one_step(plain, plain_model)  # a fused guard would hand plain Adam grad_scale: it asserts
    assert scaler.skip_mode(plain)[0] == "restore"
    del fused
    gc.collect()
    one_step(plain, plain_model)
    assert list(scaler._guards) == [id(plain)]  # the dead one's guard is dropped


def test_torchs_private_growth_tracker_methods_that_accelerate_calls():
    """Accelerate calls `_lazy_init_scale_growth_tracker` after loading a scaler's checkpoint
    under FSDP2; both private methods keep torch's meaning (values checked against torch's)."""
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=5)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        ref.scale(model(torch.ones(1, 2)).sum()).backward()
        ref.step(opt)
        ref.update()
        opt.zero_grad()
    ours = mixprec.GradScaler("cpu")
    ours.load_state_dict(ref.state_dict())
    assert ours._get_growth_tracker() == ref._get_growth_tracker() == 3  # before first use
    ours._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert ours._get_scale_async() is not None and ours.get_scale() == ref.get_scale()
    assert ours._get_growth_tracker() == 3
    ours._lazy_init_scale_growth_tracker("cpu")  # again: nothing changes
    assert ours.get_scale() == 2.0**8
    assert mixprec.GradScaler("cpu", enabled=False)._get_growth_tracker() == 0
