"""Every error a user can cause at the scaler's public entry points, by its exact text, and
the promise that comes with it: a refused call leaves the scaler as it was.

The slips are the ones the issue lists: wrong types (``enabled='False'``, ``init_scale=True``),
misspelled keyword values (``skip_mode='restor'``), suggestions that point at the kind of
thing that was meant (an optimizer's state dict given to the scaler), non-callables.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.levels.model import amp_hooks
from mixprec.scaling import ScalerCheckpointError

G = mixprec.GradScaler


@pytest.mark.parametrize(
    "kwargs,text",
    [
        ({"device": "gpu"},
         "GradScaler device='gpu': unknown device type 'gpu'. Did you mean 'cuda'? Valid device "
         "types: 'cpu', 'cuda', 'mps' or 'xpu'. NVIDIA and AMD GPUs are 'cuda', Intel GPUs "
         "'xpu', Apple GPUs 'mps'."),
        ({"device": 0},
         "GradScaler device=0: device_type must be a string such as 'cuda' or 'cpu', got int 0."),
        ({"enabled": "False"},
         "GradScaler enabled='False' is not a bool: pass True or False (torch would treat any "
         "non-empty string, 'False' included, as True)."),
        ({"enabled": 2},
         "GradScaler enabled=2 is not a bool: pass True or False (torch would treat any "
         "non-empty string, 'False' included, as True)."),
        ({"init_scale": -1},
         "GradScaler init_scale=-1 must be a finite number > 0 (2.0**16 is torch's default)."),
        ({"init_scale": True},
         "GradScaler init_scale=True must be a finite number > 0 (2.0**16 is torch's default)."),
        ({"init_scale": "65536"},
         "GradScaler init_scale='65536' must be a finite number > 0 (2.0**16 is torch's "
         "default)."),
        ({"growth_interval": 100.0},
         "GradScaler growth_interval=100.0 is invalid: it must be an int >= 1."),
        ({"skip_mode": "restor"},
         "GradScaler skip_mode='restor' is not valid. Did you mean 'restore'? Valid skip modes: "
         "'auto', 'fused', 'restore' or 'sync'."),
        ({"skip_mode": "SYNC"},
         "GradScaler skip_mode='SYNC' is not valid. Did you mean 'sync'? Valid skip modes: "
         "'auto', 'fused', 'restore' or 'sync'."),
        ({"skip_mode": None},
         "GradScaler skip_mode=None is not valid. Valid skip modes: 'auto', 'fused', 'restore' "
         "or 'sync'."),
        ({"unscale_impl": "foreah"},
         "GradScaler unscale_impl='foreah' is not valid. Did you mean 'foreach'? Valid unscale "
         "impls: 'auto', 'foreach' or 'torch'."),
        ({"on_skip": 42},
         "GradScaler on_skip=42 must be a callable taking a SkipEvent, or None."),
        ({"check_every": 0}, "GradScaler check_every=0 must be an int >= 1."),
        ({"num_losses": 0}, "GradScaler num_losses=0 must be an int >= 1."),
        ({"num_losses": 2.0}, "GradScaler num_losses=2.0 must be an int >= 1."),
    ],
)  # fmt: skip
def test_constructor_errors(kwargs, text):
    """Issue 13: GradScaler(init_scale=-1) raised PolicyError; each is a ScalerConfigError."""
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(mixprec.ScalerConfigError) as err:
        G(**kwargs)
    assert str(err.value) == text
    assert isinstance(err.value, ValueError) and isinstance(err.value, mixprec.MixprecError)
    assert not isinstance(err.value, mixprec.PolicyError)


def test_valid_spellings_are_accepted():
    G(torch.device("cpu"), enabled=1, skip_mode=mixprec.scaling.SkipMode.SYNC)
    assert G("cpu", enabled=0).is_enabled() is False


def test_bounds_clamp_the_initial_scale_and_say_so():
    scaler = G("cpu", max_scale=1024.0)  # Apex lowers its initial scale the same way
    assert scaler.get_scale() == 1024.0
    assert "decided: init_scale 65536 lowered to max_scale 1024 (Apex does the same)" in (
        scaler.explain()
    )
    assert G("cpu", init_scale=2.0, min_scale=8.0).get_scale() == 8.0
    assert G("cpu", init_scale=2.0**20, max_scale=4.0, dynamic=False).get_scale() == 2.0**20


def _used(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = G("cpu", init_scale=64.0, **kwargs)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 2))).backward()
        scaler.step(opt)
        scaler.update()
    return scaler, model, opt


def _calls(scaler, model, opt):
    loss = torch.tensor(1.0)
    return [
        (lambda: scaler.scale({"loss": loss}), TypeError,
         "GradScaler.scale expects a tensor or a list/tuple of tensors, got dict (a dict: scale "
         "its loss, e.g. scaler.scale(out['loss']))."),
        (lambda: scaler.scale("loss"), TypeError,
         "GradScaler.scale expects a tensor or a list/tuple of tensors, got str."),
        (lambda: scaler.scale(loss, loss_id="0"), mixprec.ScalerConfigError,
         "loss_id='0' is not valid: this scaler has num_losses=1, so loss_id must be an int in "
         "0..0."),
        (lambda: scaler.unscale_(model), TypeError,
         "GradScaler.unscale_ expects an optimizer, got Linear: this is a model (Linear); pass "
         "the optimizer that steps its parameters."),
        (lambda: scaler.step([opt]), TypeError,
         "GradScaler.step expects an optimizer, got list: call scaler.step(optimizer) once per "
         "optimizer."),
        (lambda: scaler.step(loss), TypeError,
         "GradScaler.step expects an optimizer, got Tensor: this is a tensor; pass the optimizer "
         "(the loss goes to scaler.scale(loss))."),
        (lambda: scaler.skip_mode("adam"), TypeError,
         "GradScaler.skip_mode expects an optimizer, got str: pass the torch.optim.Optimizer "
         "that steps the scaled gradients."),
        (lambda: scaler.step(torch.optim.LBFGS(model.parameters())), mixprec.ScalerConfigError,
         "LBFGS cannot step under loss scaling: its step() requires a closure that re-evaluates "
         "the loss inside the step, where the scaler can neither scale it nor unscale its "
         "gradients. Train LBFGS without a GradScaler: in bf16 (mixprec.autocast(device, "
         "dtype=torch.bfloat16) needs no scaling) or in fp32."),
        (lambda: scaler.update("1024"), mixprec.ScalerConfigError,
         "update(new_scale='1024') must be a finite number > 0 or a 1-element tensor."),
        (lambda: scaler.update(float("inf")), mixprec.ScalerConfigError,
         "update(new_scale=inf) must be a finite number > 0 or a 1-element tensor."),
        (lambda: scaler.update(torch.ones(2)), mixprec.ScalerConfigError,
         "update(new_scale=...) got a tensor of shape (2,), dtype torch.float32, "
         "requires_grad=False: it must be a float or a 1-element floating-point tensor that does "
         "not require grad."),
        (lambda: scaler.set_growth_factor(0.5), mixprec.ScalerConfigError,
         "GradScaler growth_factor=0.5 is invalid: it must be a number > 1.0 (2.0 doubles the "
         "scale)."),
        (lambda: scaler.set_backoff_factor(2), mixprec.ScalerConfigError,
         "GradScaler backoff_factor=2 is invalid: it must be a number in (0, 1) (0.5 halves the "
         "scale)."),
        (lambda: scaler.set_growth_interval("10"), mixprec.ScalerConfigError,
         "GradScaler growth_interval='10' is invalid: it must be an int >= 1."),
        (lambda: scaler.load_state_dict(opt.state_dict()), ScalerCheckpointError,
         "not a GradScaler state dict: this is an optimizer's state dict (keys 'state' and "
         "'param_groups'): load it with optimizer.load_state_dict(...) and pass "
         "scaler.state_dict()'s output here."),
        (lambda: scaler.load_state_dict({"model": {}, "scaler": G("cpu").state_dict()}),
         ScalerCheckpointError,
         "not a GradScaler state dict: this looks like a whole training checkpoint; the scaler's "
         "state is under 'scaler': pass state_dict['scaler']."),
        (lambda: scaler.load_state_dict({"format": "mixprec.AmpOptimizer/1", "scaler": {}}),
         ScalerCheckpointError,
         "not a GradScaler state dict: this is an AmpOptimizer's state dict "
         "(mixprec.initialize's optimizer), which holds the scaler under 'scaler': load it with "
         "optimizer.load_state_dict(...), or pass state_dict['scaler'] here."),
        (lambda: scaler.load_state_dict({"format": "mixprec.TrainStep/1"}), ScalerCheckpointError,
         "not a GradScaler state dict: this is a TrainStep's state dict: load it with "
         "step.load_state_dict(...), which restores the scaler too."),
        (lambda: scaler.load_state_dict([64.0]), ScalerCheckpointError,
         "GradScaler.load_state_dict expects a dict (from scaler.state_dict() or "
         "torch.amp.GradScaler's), got list."),
    ]  # fmt: skip


def test_method_errors_are_exact_and_change_nothing():
    scaler, model, opt = _used(hysteresis=2)
    before = scaler.state_dict()
    for call, kind, text in _calls(scaler, model, opt):
        with pytest.raises(kind) as err:
            call()
        assert str(err.value) == text
        assert scaler.state_dict() == before
        assert scaler._per_optimizer == {}  # no half-started iteration
        pickle.dumps(scaler)  # still between iterations


def test_a_state_dict_before_first_use_loads_everywhere():
    """Issue 12: GradScaler('cpu').load_state_dict(GradScaler('cpu').state_dict()) raised."""
    fresh = G("cpu", init_scale=512.0, growth_interval=9).state_dict()
    assert len(fresh["history"]) == 1024 and set(fresh["history"]) == {None}
    for make in (lambda: G("cpu"), lambda: _used()[0]):
        scaler = make()
        scaler.load_state_dict(fresh)
        assert scaler.state_dict() == fresh
    loaded_torch = G("cpu")
    loaded_torch.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    again = G("cpu")
    again.load_state_dict(loaded_torch.state_dict())  # a scaler that loaded torch's, not run
    assert again.get_scale() == 8.0
    legacy = dict(fresh, history=[])  # what mixprec 0.6 wrote before first use
    again.load_state_dict(legacy)
    assert again.state_dict() == fresh


# ----------------------------------------------------------------------- levels and TrainStep


def _fresh():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "args,kwargs,kind,text",
    [
        ((), {"min_loss_scale": 1024.0, "max_loss_scale": 2.0}, mixprec.PolicyError,
         "min_loss_scale=1024.0 is above max_loss_scale=2.0: the floor must not exceed the "
         "ceiling."),
        ((), {"max_loss_scale": True}, mixprec.PolicyError,
         "max_loss_scale=True is invalid: use None or a finite number > 0."),
        ((), {"num_losses": True}, mixprec.PolicyError,
         "num_losses=True is invalid: use an int >= 1."),
        ((), {"loss_scale": "dynamc"}, mixprec.PolicyError,
         "loss_scale='dynamc' is invalid: use 'dynamic' or a positive number (1.0 turns loss "
         "scaling off). Did you mean 'dynamic'?"),
        (("params",), {}, mixprec.PolicyError,
         "optimizers must be torch.optim.Optimizer instances, objects used as optimizers (with "
         "param_groups, state, step and zero_grad, such as Apex's LARC), factories or None; got "
         "generator (parameters or a model, not an optimizer: build one, e.g. "
         "torch.optim.AdamW(model.parameters(), lr=1e-3))."),
    ],
)  # fmt: skip
def test_initialize_refuses_before_changing_the_model(args, kwargs, kind, text):
    """A refused argument used to surface after the model was cast and hooked (the scaler was
    built last): the model could then never be initialized again."""
    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    target = model.parameters() if args == ("params",) else opt
    with pytest.raises(kind) as err:
        mixprec.initialize(model, target, "O2", dtype="fp16", **kwargs)
    assert str(err.value) == text
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k])
               for k, v in model.state_dict().items())  # fmt: skip
    mixprec.initialize(model, opt, "O2", dtype="fp16")  # still possible


def _amp_iteration(model, opt, x):
    for loss_id in (0, 1):
        with mixprec.scale_loss(model(x).float().pow(2).mean(), opt, loss_id=loss_id) as s:
            s.backward()
    opt.step()


def test_amp_optimizer_with_several_losses_loads_its_own_state_dict():
    """The scaler part was checked against a fresh one-loss scaler, so this was refused."""
    model, opt = mixprec.initialize(*_fresh(), "O1", dtype="fp16", num_losses=2)
    x = torch.randn(3, 4)
    _amp_iteration(model, opt, x)
    saved = opt.state_dict()
    _amp_iteration(model, opt, x)  # its scale update is still deferred when loading
    opt.load_state_dict(saved)
    assert opt.scaler.state_dict() == saved["scaler"]


def test_amp_optimizer_load_errors_point_at_the_right_object():
    from mixprec.levels.optimizer import AmpCheckpointError

    model, opt = mixprec.initialize(*_fresh(), "O2", dtype="fp16")
    x = torch.randn(3, 4)
    with mixprec.scale_loss(model(x).float().sum(), opt) as s:
        s.backward()
    opt.step()
    good = opt.state_dict()
    cases = [
        (opt.scaler.state_dict(),
         "not an AmpOptimizer state dict (format 'mixprec.GradScaler/1', expected "
         "'mixprec.AmpOptimizer/2'): it is a GradScaler's; load it with "
         "optimizer.scaler.load_state_dict(...)."),
        (torch.amp.GradScaler("cpu").state_dict(),
         "not an AmpOptimizer state dict (format None, expected 'mixprec.AmpOptimizer/2'): it "
         "is a GradScaler's; load it with optimizer.scaler.load_state_dict(...)."),
        ({**good, "scaler": {"scale": 4.0}},
         "state_dict['scaler'] is refused: the state dict lacks ['growth_factor', "
         "'backoff_factor', 'growth_interval', '_growth_tracker']; a GradScaler state dict "
         "(torch.amp's or mixprec's) has at least the keys ['scale', 'growth_factor', "
         "'backoff_factor', 'growth_interval', '_growth_tracker']."),
    ]  # fmt: skip
    for bad, text in cases:
        with pytest.raises(AmpCheckpointError) as err:
            opt.load_state_dict(bad)
        assert str(err.value) == text
        after = opt.state_dict()
        assert after["scaler"] == good["scaler"]
        assert all(torch.equal(a, b) for a, b in zip(after["masters"], good["masters"],
                                                     strict=True))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,text",
    [
        ({"clip_grad_norm": True}, "clip_grad_norm=True must be a positive number or None."),
        ({"capture": "cuda-graph"},
         "unknown capture mode 'cuda-graph'. Did you mean 'cuda_graph'? Valid modes: 'auto', "
         "'compile', 'cuda_graph' or 'eager'."),
        ({"compile": "max-autotune"},
         "TrainStep compile='max-autotune' must be None (automatic), True, False or a dict of "
         "torch.compile arguments, e.g. compile={'mode': 'max-autotune'}."),
        ({"loss_fn": "mse"},
         "TrainStep loss_fn='mse' is not callable: pass a function, e.g. "
         "loss_fn=torch.nn.functional.cross_entropy."),
        ({"loss_fn": None, "compute_loss": 3},
         "TrainStep compute_loss=3 is not callable: pass a function, e.g. compute_loss=lambda "
         "model, x, y: F.mse_loss(model(x), y)."),
        ({"scaler": torch.amp.GradScaler("cpu")},
         "scaler must be a mixprec.GradScaler, got torch.amp.grad_scaler.GradScaler: "
         "torch.amp's scaler reads found-inf on the host every step, which a captured step "
         "cannot do. mixprec.GradScaler takes the same arguments."),
    ],
)  # fmt: skip
def test_trainstep_argument_slips(kwargs, text):
    model, opt = _fresh()
    kwargs = {"loss_fn": F.mse_loss, **kwargs}
    with pytest.raises(mixprec.PolicyError) as err:
        mixprec.TrainStep(model, opt, **kwargs)
    assert str(err.value) == text
    assert amp_hooks(model) is None  # refused before initialize touched the model
