"""Where mixprec's Apex-compatible API follows Apex amp, checked against Apex's own behaviour.

Each test pins one behaviour Apex users relied on (its source: apex/amp at e13873d, the last
commit with amp) that mixprec got wrong; Apex's own tests, adapted, are in tests/peers/apex.
The reference is Apex's semantics, written out here where it is arithmetic (the per-loss
scaler, LARC's step), and fp32 or plain-torch runs where it is training.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import MixprecError
from tests.peers.apex.larc import LARC

FP16 = torch.float16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.lin(x)))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _step(model, opt, x, loss_id=0, zero="optimizer"):
    if zero == "optimizer":
        opt.zero_grad()
    else:
        model.zero_grad()
    with mixprec.scale_loss(model(x).float().pow(2).mean(), opt, loss_id=loss_id) as s:
        s.backward()
    opt.step()


# ------------------------------------------------------------------ options Apex accepted


def test_verbosity_and_enabled_are_apex_keywords(capsys):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", dtype=FP16, verbosity=1)
    assert "O2: low-precision model" in capsys.readouterr().out  # Apex printed the options
    # enabled=False: every amp call a no-op, whatever else is passed (Apex's off switch).
    plain = _net()
    plain, popt = mixprec.initialize(
        plain, torch.optim.SGD(plain.parameters(), lr=0.1), "O2", dtype=FP16, enabled=False,
        keep_batchnorm_fp32=True, loss_scale="dynamic", verbosity=0,
    )  # fmt: skip
    assert capsys.readouterr().out == ""
    assert popt.options.level.value == "O0" and popt.scaler is None
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    _step(plain, popt, torch.randn(3, 4))
    with pytest.raises(TypeError, match="verbosity=3 must be 0, 1 or 2"):
        mixprec.initialize(_net(), None, "O1", verbosity=3)


def test_none_and_argparse_strings_mean_what_they_meant_in_apex():
    """Apex: "any property keyword argument that is not None is a manual override", and its
    ImageNet example passes argparse strings on ("False", "128.0"). None for master_weights
    silently ran O3 (every small update lost), and "False" kept norms in fp32."""

    def options(**kw):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        _, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                    dtype=FP16, **kw)  # fmt: skip
        return opt.options, model[1].weight.dtype

    default, bn_dtype = options()
    for name in ("master_weights", "keep_batchnorm_fp32", "loss_scale", "patch_torch_functions"):
        assert options(**{name: None}) == (default, bn_dtype), name
    assert options(keep_batchnorm_fp32="False")[1] == FP16
    assert options(keep_batchnorm_fp32="True")[1] == torch.float32 == bn_dtype
    assert options(loss_scale="128.0")[0].loss_scale == 128.0
    with pytest.raises(TypeError, match="'no' is not a truth value: pass True or False"):
        options(keep_batchnorm_fp32="no")


def test_cast_model_type_false_keeps_dtypes_and_gives_fp16_weights_masters():
    """Apex's O2 with cast_model_type=False: no cast, fp32 masters for the fp16 weights."""
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    model.half_w = nn.Parameter(torch.tensor([3.0, 4.0], dtype=FP16))
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    model, opt = mixprec.initialize(model, opt, "O2", dtype=FP16, cast_model_type=False,
                                    loss_scale=8.0)  # fmt: skip
    assert (model.weight.dtype, model.half_w.dtype) == (torch.float32, FP16)
    masters = list(mixprec.master_params(opt))
    assert [m.dtype for m in masters] == [torch.float32, torch.float32]
    assert masters[0] is model.weight  # fp32: its own master
    x = torch.ones(1, 2)
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        assert out.dtype == torch.float32  # no output cast without a model cast, as Apex
        loss = (out.sum() * model.half_w.float().sum()).sum()
        with mixprec.scale_loss(loss, opt) as s:
            s.backward()
        opt.step()
        ref_loss = ref[:2].sum() * ref[2:].sum()
        ref.grad = None
        ref_loss.backward()
        with torch.no_grad():
            ref -= 0.25 * ref.grad
    got = torch.cat([masters[0].flatten(), masters[1]])
    assert torch.equal(got, ref.detach())  # small integers: fp16 gradients are exact
    assert torch.equal(model.half_w, ref[2:].detach().half())


def test_dynamic_scale_ceiling_is_apexs():
    opts = mixprec.describe("O2", device_type="cuda", dtype="fp16")
    assert opts.max_loss_scale == 2.0**24
    model = _net()
    _, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                dtype=FP16)  # fmt: skip
    assert opt.scaler.config.max_scale == 2.0**24


# ------------------------------------------------------------------ exception classes


def _refusals():
    model, opt = _net(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = _net()
    _, amp_opt = mixprec.initialize(other, torch.optim.SGD(other.parameters(), 0.1),
                                    "O1", dtype=FP16)  # fmt: skip
    loss = torch.ones((), requires_grad=True)
    return [  # (call, the class Apex raised)
        (lambda: mixprec.initialize("model", opt, "O1"), TypeError),
        (lambda: mixprec.initialize(model, 5, "O1"), TypeError),
        (lambda: mixprec.initialize(model, opt, "O5"), RuntimeError),  # (O4 is mixprec's)
        (lambda: mixprec.initialize(model, opt, "O1", hard_override=True), TypeError),
        (lambda: mixprec.initialize(model, opt, "O1", master_weights=True), RuntimeError),
        (lambda: mixprec.initialize(_net(), amp_opt, "O1"), RuntimeError),
        (lambda: mixprec.scale_loss(loss, opt).__enter__(), RuntimeError),
        (lambda: mixprec.initialize(model, opt, "O1", loss_scale="dynamc"), ValueError),
    ]


@pytest.mark.parametrize("index", range(8))
def test_errors_are_also_the_class_apex_raised(index):
    call, apex_class = _refusals()[index]
    with pytest.raises(MixprecError) as err:
        call()
    assert isinstance(err.value, apex_class), type(err.value).__mro__


def test_banned_op_is_apexs_not_implemented_error_and_torchs_runtime_error():
    x = torch.rand(4, dtype=FP16)
    cuda_rules = mixprec.Policy(table="cuda")  # CUDA's autocast bans it; the CPU's does not
    with pytest.raises(NotImplementedError), mixprec.autocast("cpu", dtype=FP16, policy=cuda_rules):
        torch.nn.functional.binary_cross_entropy(x, torch.rand(4, dtype=FP16))
    assert issubclass(mixprec.BannedOpError, RuntimeError)


def test_o1_refuses_fp16_weights_at_initialize_before_changing_anything():
    model = _net()
    model.lin.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="parameter 'lin.weight' of Net is fp16"):
        mixprec.initialize(model, opt, "O1", dtype=FP16)
    mixprec.initialize(model, opt, "O2", dtype=FP16, cast_model_type=False)  # the way out


def test_master_params_of_any_optimizer_are_its_params():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert list(mixprec.master_params(opt)) == list(model.parameters())  # Apex's generator


# ------------------------------------------------------------------ checkpoints


def _o2(seed=0, opt_level="O2"):
    model = _net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return mixprec.initialize(model, opt, opt_level, dtype=FP16)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_cast_model_state_dict_is_fp32_and_loads_back(level):
    model, opt = _o2(opt_level=level)
    x = torch.randn(8, 4)
    for _ in range(3):
        _step(model, opt, x)
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values())  # Apex returned fp32
    masters = list(mixprec.master_params(opt)) if level == "O2" else []
    if level == "O2":  # the masters themselves: the rounding to fp16 loses nothing here
        assert torch.equal(sd["lin.weight"], masters[0])
        assert not torch.equal(sd["lin.weight"], model.lin.weight.float())
    # keep_vars=True asks for the live objects (mixprec.save_checkpoint does)
    assert model.state_dict(keep_vars=True)["lin.weight"] is model.lin.weight
    fp32 = _net(1)
    fp32.load_state_dict(sd)
    loaded = fp32.state_dict().values()
    assert all(torch.equal(a, b) for a, b in zip(loaded, sd.values(), strict=True))
    # Into a model initialized first (Apex's documented order): weights cast, masters exact.
    fresh, fopt = _o2(seed=2, opt_level=level)
    fresh.load_state_dict(sd)
    assert fresh.lin.weight.dtype == FP16
    assert torch.equal(fresh.lin.weight, model.lin.weight)
    if level == "O2":
        assert torch.equal(next(iter(mixprec.master_params(fopt))), masters[0])


def test_load_state_dict_with_assign_is_refused_before_anything_changes():
    model, _ = _o2()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="assign=True"):
        model.load_state_dict(_net(3).state_dict(), assign=True)
    after = model.state_dict().values()
    assert all(torch.equal(a, b) for a, b in zip(before.values(), after, strict=True))


def _run(model, opt, xs):
    for x in xs:
        _step(model, opt, x)


@pytest.mark.parametrize("before_initialize", [True, False])
def test_checkpoint_resumes_in_either_order_apex_allowed(before_initialize):
    """Apex's checkpoint test loads model and optimizer before or after initialize."""
    xs = [torch.randn(8, 4) for _ in range(6)]
    model, opt = _o2()
    _run(model, opt, xs)
    want = [p.detach().clone() for p in mixprec.master_params(opt)]
    model, opt = _o2()
    _run(model, opt, xs[:3])
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    fresh = _net(5)
    plain = torch.optim.SGD(fresh.parameters(), lr=0.01, momentum=0.9)
    if before_initialize:  # a plain optimizer over the fp32 model loads mixprec's dict
        fresh.load_state_dict(ckpt["model"])
        plain.load_state_dict(ckpt["optimizer"])
        fresh, fopt = mixprec.initialize(fresh, plain, "O2", dtype=FP16)
        fopt.scaler.load_state_dict(ckpt["optimizer"]["scaler"])
    else:
        fresh, fopt = mixprec.initialize(fresh, plain, "O2", dtype=FP16)
        fresh.load_state_dict(ckpt["model"])
        fopt.load_state_dict(ckpt["optimizer"])
    _run(fresh, fopt, xs[3:])
    got = list(mixprec.master_params(fopt))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_amp_optimizer_loads_a_plain_optimizer_state_dict_and_apex_amp_state():
    """An Apex checkpoint: its optimizer entry is a plain state dict, its 'amp' entry Apex's."""
    model, opt = _o2()
    _run(model, opt, [torch.randn(8, 4)])
    plain = opt.optimizer.state_dict()
    plain["state"][0]["momentum_buffer"].fill_(0.5)
    opt.load_state_dict({"state": plain["state"], "param_groups": plain["param_groups"]})
    assert torch.equal(opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"],
                       torch.full((4, 4), 0.5))  # fmt: skip
    opt.scaler.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 7}})
    assert opt.scaler.stats()["losses"][0]["scale"] == 128.0
    assert opt.scaler.stats()["losses"][0]["growth_tracker"] == 7
    # A checkpoint of mixprec 0.7 (the inner optimizer's entries under 'optimizer') loads too.
    ours = opt.state_dict()
    v1 = {k: ours[k] for k in ("opt_level", "masters", "scaler")}
    v1.update(
        format="mixprec.AmpOptimizer/1",
        optimizer={"state": ours["state"], "param_groups": ours["param_groups"]},
    )
    opt.load_state_dict(v1)
    bad = {"state": {}, "param_groups": plain["param_groups"] * 2}
    before = copy.deepcopy(opt.optimizer.state_dict())
    with pytest.raises(ValueError, match="inner optimizer refused"):
        opt.load_state_dict(bad)
    assert str(opt.optimizer.state_dict()) == str(before)


# ------------------------------------------------------------------ optimizers Apex accepted


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_optimizer_wrapper_larc_is_accepted(level):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ref = copy.deepcopy(model)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5))
    model, opt = mixprec.initialize(model, larc, level, dtype=torch.bfloat16)
    assert larc.param_groups[0]["params"][0] is model.weight  # the wrapper passed in: alone
    ref_opt = LARC(torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.5))
    x = torch.randn(8, 4)
    for _ in range(3):
        opt.zero_grad()
        with mixprec.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    got = list(mixprec.master_params(opt))
    tol = {"O0": 0, "O1": 3e-2, "O2": 3e-2, "O3": 3e-2}[level]
    for a, b in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol)


def test_add_param_group_gives_new_fp16_weights_masters():
    a, b = _net(0), _net(1)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    (a, b), opt = mixprec.initialize([a, b], opt, "O2", dtype=FP16, loss_scale=1024.0)
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's check
        opt.add_param_group({"params": list(a.parameters())[:1]})
    assert len(opt._masters) == 4  # a refused group added nothing
    opt.add_param_group({"params": b.parameters(), "lr": 0.05})
    added = opt.param_groups[1]["params"]
    assert [p.dtype for p in added] == [torch.float32] * len(added)
    assert added[0] is not b.lin.weight and added[2] is b.norm.weight  # fp32 norm: its own
    x = torch.randn(8, 4)
    before = b.lin.weight.detach().clone()
    opt.zero_grad()
    with mixprec.scale_loss((a(x) + b(x)).float().pow(2).mean(), opt) as s:
        s.backward()
    opt.step()
    assert not torch.equal(b.lin.weight, before)
    assert torch.equal(b.lin.weight, added[0].half())  # the model follows its master


def test_zeroing_the_model_gradients_is_enough_between_o2_iterations():
    """Apex dropped the masters' gradients in step: model.zero_grad() then suffices."""
    xs = [torch.randn(8, 4) for _ in range(3)]
    results = []
    for zero in ("optimizer", "model"):
        model, opt = _o2()
        for x in xs:
            _step(model, opt, x, zero=zero)
        results.append([p.detach().clone() for p in mixprec.master_params(opt)])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_plain_backward_at_bf16_o2_uses_only_this_steps_gradients():
    """bf16 O2 needs no scale_loss block: a plain backward then step must not add the masters'
    gradients of the steps before (they were kept, and each step summed all earlier ones)."""
    xs = [torch.randn(8, 4) for _ in range(3)]
    used = {}
    for zero in ("optimizer", "model"):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16)
        used[zero] = []
        for x in xs:
            (opt.zero_grad if zero == "optimizer" else model.zero_grad)()
            model(x).float().pow(2).mean().backward()
            opt.step()
            used[zero].append([m.grad.clone() for m in mixprec.master_params(opt)])
    for a, b in zip(used["optimizer"], used["model"], strict=True):
        assert all(torch.equal(ga, gb) for ga, gb in zip(a, b, strict=True))


# ------------------------------------------------------------------ several losses


class ApexLossScaler:
    """apex/amp/scaler.py's LossScaler.update_scale, per loss, run at each scale_loss exit."""

    def __init__(self, window: int) -> None:
        self.scale, self.unskipped, self.window = 2.0**16, 0, window

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.unskipped = self.scale / 2.0, 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.scale, self.unskipped = min(2.0**24, self.scale * 2.0), 0


def test_each_loss_scale_moves_only_when_its_loss_ran_as_apex():
    random.seed(0)
    window = 3
    model = nn.Linear(4, 1)
    # bf16 with dynamic scaling: its range never overflows, so only the injected infs do.
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(
        model, sgd, "O1", dtype=torch.bfloat16, loss_scale="dynamic", num_losses=3
    )
    opt.scaler.set_growth_interval(window)
    apex = [ApexLossScaler(window) for _ in range(3)]
    x = torch.randn(2, 4)
    for it in range(40):
        opt.zero_grad()
        # loss 0 every iteration, loss 1 every 3rd, loss 2 at random; rare overflows
        for loss_id in [0] + [1] * (it % 3 == 0) + [2] * (random.random() < 0.5):
            overflow = random.random() < 0.1
            with mixprec.scale_loss(model(x).float().sum(), opt, loss_id=loss_id) as s:
                s.backward()
                if overflow:
                    model.weight.grad[0, 0] = float("inf")
            apex[loss_id].update(overflow)
        opt.step()
        opt.loss_scale  # noqa: B018 (runs the deferred update)
        got = [(e["scale"], e["growth_tracker"]) for e in opt.scaler.stats()["losses"]]
        assert got == [(a.scale, a.unskipped) for a in apex], it


def test_an_overflow_skips_only_the_optimizers_of_its_block():
    """Apex patched the step of the optimizers passed to the overflowing scale_loss only."""
    m0, m1 = nn.Linear(2, 1), nn.Linear(2, 1)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.1), torch.optim.SGD(m1.parameters(), lr=0.1)
    (m0, m1), (o0, o1) = mixprec.initialize([m0, m1], [o0, o1], "O1", dtype=FP16, num_losses=2,
                                            loss_scale=128.0)  # fmt: skip
    before = [p.detach().clone() for p in (*m0.parameters(), *m1.parameters())]
    x = torch.ones(1, 2)
    with mixprec.scale_loss(m0(x).float().sum(), o0, loss_id=0) as s:
        s.backward()
        m0.weight.grad[0, 0] = float("inf")
    with mixprec.scale_loss(m1(x).float().sum(), o1, loss_id=1) as s:
        s.backward()
    o0.step()
    o1.step()
    after = [p.detach() for p in (*m0.parameters(), *m1.parameters())]
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])  # skipped
    assert not torch.equal(after[2], before[2])  # o1 stepped


def test_a_wrapper_that_cannot_be_rebuilt_for_o2_is_refused_before_the_model_changes():
    class TwoInner:  # wraps two optimizers: which one to rebuild over the masters is unknown
        def __init__(self, params):
            params = list(params)
            self.a = torch.optim.SGD(params[:1], lr=0.1)
            self.b = torch.optim.SGD(params[1:], lr=0.1)
            self.param_groups = self.a.param_groups + self.b.param_groups
            self.state = {}

        def step(self):
            self.a.step()
            self.b.step()

        def zero_grad(self):
            self.a.zero_grad()
            self.b.zero_grad()

    model = nn.Linear(2, 2)
    with pytest.raises(MixprecError, match="Pass a factory instead"):
        mixprec.initialize(model, TwoInner(model.parameters()), "O2", dtype=FP16)
    assert model.weight.dtype == torch.float32 and not model._forward_pre_hooks


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_model_after_initialize_can_be_copied_and_pickled(level, tmp_path):
    """EMA/SWA (torch.optim.swa_utils.AveragedModel, timm's ModelEmaV2) deep-copy the model, and
    torch.save(model) pickles it: the hooks' per-thread stack could be neither."""
    model, opt = _o2(opt_level=level)
    x = torch.randn(8, 4)
    _step(model, opt, x)
    ema = torch.optim.swa_utils.AveragedModel(model)
    ema.update_parameters(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(ema(x), want) and torch.equal(loaded(x), want)
    assert loaded.lin.weight.dtype == model.lin.weight.dtype
    assert all(v.dtype == torch.float32 for v in loaded.state_dict().values())
    _step(model, opt, x)  # the original trains on, its masters untouched by the copies
    assert not torch.equal(model(x), loaded(x))


def test_o3_recasts_the_state_an_optimizer_already_holds():
    """Apex's order "load the checkpoint, then initialize" (or resuming fp32 training at O3):
    the optimizer's moments were fp32 beside bf16 weights, and the first step failed. They are
    cast as torch's load_state_dict casts them (Apex did the same)."""
    x = torch.randn(8, 4)

    def warmed():
        model = _net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    model, opt = warmed()
    model, opt = mixprec.initialize(model, opt, "O3", dtype=torch.bfloat16)
    ref_model, ref_opt = warmed()
    ref_model.to(torch.bfloat16)
    ref_opt.load_state_dict(ref_opt.state_dict())  # torch casts the moments to the weights'
    for _ in range(2):
        with mixprec.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            ref_model(x.bfloat16()).float().pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
        assert all(
            torch.equal(a, b)
            for a, b in zip(opt.optimizer.state[p].values(), ref_opt.state[q].values(), strict=True)
        )


@pytest.mark.parametrize("level", ["O2", "O4"])
def test_a_scheduler_made_before_a_level_that_steps_a_new_optimizer_is_warned_about(level):
    """At O2/O4 the optimizer that steps is a new one: a scheduler created on the one passed in
    drives nothing and training runs at the first lr (Apex patched in place, so HF's Apex
    recipe, scheduler then amp.initialize, worked there). A warning names both fixes (a
    scheduler made after initialize, checked here; SkipAwareLR(optimizer=), test_levels)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step else 1.0)
    with pytest.warns(UserWarning, match="Create the scheduler after initialize.*SkipAwareLR"):
        mixprec.initialize(model, opt, level, dtype=torch.bfloat16)

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = mixprec.initialize(model, opt, level, dtype=torch.bfloat16)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step else 1.0)
    x = torch.randn(8, 4)
    moved = []
    for _ in range(2):
        opt.zero_grad()
        with mixprec.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        before = model.weight.detach().clone()
        opt.step()
        scheduler.step()
        moved.append(not torch.equal(before, model.weight))
    assert moved == [True, False]  # lr 1, then 0: the scheduler drives the stepping optimizer


def test_an_optimizer_class_that_cannot_be_rebuilt_is_refused_before_the_model_changes():
    class TaggedSGD(torch.optim.SGD):  # a required constructor argument it does not record
        def __init__(self, params, lr, tag):
            super().__init__(params, lr=lr)
            self.tag = tag

    model = nn.Linear(2, 2)
    with pytest.raises(MixprecError, match="Pass a factory instead"):
        mixprec.initialize(model, TaggedSGD(model.parameters(), 0.1, "x"), "O2", dtype=FP16)
    assert model.weight.dtype == torch.float32 and not model._forward_pre_hooks
    model, opt = mixprec.initialize(model, lambda p: TaggedSGD(p, 0.1, "x"), "O2", dtype=FP16)
    assert isinstance(opt.optimizer, TaggedSGD)  # the fix the message gives works


def test_apexs_scale_loss_keywords_run_and_change_nothing():
    """Apex's accumulation recipe passes delay_unscale=True on all but the last block; mixprec's
    blocks accumulate correctly without it, so the keyword is accepted and has no effect."""
    xs = [torch.randn(8, 4) for _ in range(4)]
    results = []
    for apex_style in (False, True):
        model, opt = _o2()
        for i, x in enumerate(xs):
            extra = {"delay_unscale": i % 2 == 0, "model": model} if apex_style else {}
            with mixprec.scale_loss(model(x).float().pow(2).mean(), opt, **extra) as s:
                s.backward()
            if i % 2:
                opt.step()
                opt.zero_grad()
        results.append([p.detach().clone() for p in mixprec.master_params(opt)])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    model, opt = _o2()
    with (
        pytest.raises(TypeError, match="delay_unscale='yes' must be True or False"),
        mixprec.scale_loss(model(xs[0]).sum(), opt, delay_unscale="yes"),
    ):
        pass


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_outputs_are_widened_to_fp32_never_narrowed(level):
    """O1/O2 return 16-bit outputs in fp32; a deliberate fp64 output stays fp64, as under
    torch.autocast (Apex's O1 cast no outputs)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h, h.double().cumsum(0)

    model = mixprec.initialize(Twice(), None, level, dtype=torch.bfloat16)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = Twice()(x)
    low, wide = model(x)
    assert (low.dtype, wide.dtype) == (torch.float32, torch.float64)
    assert want[1].dtype == torch.float64


def test_cast_model_type_names_the_low_dtype_when_dtype_is_not_given():
    """Apex code names fp16 in cast_model_type (there was no dtype argument): on a CPU, where
    the default is bf16, that was refused with a message that did not say how to fix it."""
    model = nn.Linear(4, 2)
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                    cast_model_type=torch.float16)  # fmt: skip
    assert model.weight.dtype == FP16 and opt.options.dtype == FP16 and opt.scaler is not None
    with pytest.raises(mixprec.PolicyError, match="dtype='fp16' \\(or no dtype"):
        mixprec.initialize(nn.Linear(2, 2), None, "O2", dtype="bf16", cast_model_type=FP16)


def test_an_apex_amp_state_with_an_unexpected_key_is_refused_naming_it():
    _, opt = _o2()
    before = opt.scaler.state_dict()
    with pytest.raises(mixprec.ScalerCheckpointError, match=r"unexpected key\(s\): \['bogus'\]"):
        opt.scaler.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0},
                                    "bogus": 1})  # fmt: skip
    assert opt.scaler.state_dict() == before


def test_refusals_are_also_the_builtin_exceptions_api_md_promises():
    model = nn.Linear(2, 2)
    mixprec.initialize(model, None, "O1")
    with pytest.raises(RuntimeError, match="already initialized"):
        mixprec.initialize(model, None, "O1")

    class NoInner:  # an optimizer-like wrapper holding no torch optimizer: cannot be rebuilt
        def __init__(self, params):
            self.param_groups = [{"params": list(params)}]
            self.state = {}

        def step(self):
            pass

        def zero_grad(self):
            pass

    plain = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="Pass a factory instead"):
        mixprec.initialize(plain, NoInner(plain.parameters()), "O2", dtype=FP16)
