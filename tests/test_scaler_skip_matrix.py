"""Exact skips, the whole matrix: a run whose overflowing batches were skipped must end bitwise
equal, in parameters AND optimizer state, to a run that never saw those batches.

Every torch.optim optimizer x {for-loop, foreach, fused where torch has it on this device} x
{overflow on the very first step, on the first two, later, several in a row} x {one, two param
groups} x the skip modes. fp32 parameters and power-of-two scales make unscaling exact, so any
difference is a skip that left a trace. This found the configuration that was not exact: fused
SGD with momentum whose first step overflowed (torch's kernel leaves the momentum buffer it
allocated uninitialised), and SparseAdam, whose Python-int step counter no device-side restore
can hold back; both now fall back to a host decision, with the reason.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import mixprec

INF, NAN = float("inf"), float("nan")
STEPS = 7

# name -> (class, hyperparameters); a spread of the options that change the update's code path.
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                       "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "maximize": True}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True,
                                  "weight_decay": 0.1}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "centered": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "lr_decay": 0.01}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0, "weight_decay": 0.1}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}  # fmt: skip

PATTERNS = {"first": {0}, "first-two": {0, 1}, "later": {3}, "in-a-row": {2, 3, 4}}


def _fused_here(cls: type) -> bool:
    """Whether torch has a fused kernel for `cls` on the CPU (Adam, AdamW, SGD, Adagrad in 2.13)."""
    if "fused" not in inspect.signature(cls.__init__).parameters:
        return False
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    try:
        cls([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


CONFIGS = [
    (name, impl)
    for name, (cls, _) in OPTIMIZERS.items()
    for impl in ("for-loop", "foreach", "fused")
    if impl != "fused" or _fused_here(cls)
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


_gen = torch.Generator().manual_seed(1)
BATCHES = [(torch.randn(2, 4, generator=_gen), torch.randn(2, 2, generator=_gen))
           for _ in range(STEPS)]  # fmt: skip


def _run(name, impl, groups, use, bad, mode):
    cls, kwargs = OPTIMIZERS[name]
    kwargs = dict(kwargs, **{"for-loop": {"foreach": False}, "foreach": {"foreach": True},
                             "fused": {"fused": True}}[impl])  # fmt: skip
    model = _model()
    params = (
        [{"params": model[0].parameters()},
         {"params": model[1].parameters(), "lr": kwargs["lr"] * 0.5}]
        if groups == 2 else model.parameters()
    )  # fmt: skip
    opt = cls(params, **kwargs)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000, skip_mode=mode)
    for i in use:
        x, y = BATCHES[i]
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if i in bad:
            model[0].weight.grad[0, 1] = NAN if i % 2 else INF
        scaler.step(opt)
        scaler.update()
    state = copy.deepcopy(opt.state_dict()["state"])
    return [p.detach().clone() for p in model.parameters()], state, scaler, opt


def _assert_same(got, want, where):
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"{where}: parameter {i} differs by {(a - b).abs().max()}"
    assert set(got[1]) == set(want[1]), f"{where}: state exists for different parameters"
    for key, entry in got[1].items():
        assert set(entry) == set(want[1][key]), f"{where}: state {key} has other fields"
        for field, value in entry.items():
            other = want[1][key][field]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{where}: state {key}[{field!r}] differs"


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("name,impl", CONFIGS)
def test_skipped_batches_leave_no_trace(name, impl, pattern):
    bad = PATTERNS[pattern]
    good = [i for i in range(STEPS) if i not in bad]
    leading = next(i for i in range(STEPS) if i not in bad)  # overflows before any state
    for groups in (1, 2):
        want = _run(name, impl, groups, good, set(), "sync")
        # 'auto' is 'restore' for the optimizers that are not fused: run it once.
        for mode in ("auto", "restore", "sync") if impl == "fused" else ("auto", "sync"):
            got = _run(name, impl, groups, range(STEPS), bad, mode)
            _assert_same(got, want, f"{name} {impl} groups={groups} skip_mode={mode}")
            scaler, opt = got[2], got[3]
            assert scaler.stats()["losses"][0]["skipped"] == len(bad)
            syncs = scaler._guards[id(opt)].host_syncs
            if mode == "sync":
                assert syncs == STEPS
            else:  # the steps before the state exists, then never again
                assert syncs <= leading + 1, (mode, syncs, scaler.skip_mode(opt))


def test_the_matrix_covers_every_fused_kernel_of_this_torch():
    fused = {name for name, impl in CONFIGS if impl == "fused"}
    # torch 2.13 on the CPU: fused Adam, AdamW, SGD and Adagrad (the SGD and Adam variants too).
    assert {"adam", "adamw", "sgd-momentum", "adagrad"} <= fused


def test_fused_sgd_first_step_overflow_is_decided_on_the_host_and_says_so():
    """The configuration that was not exact: with skip_mode='auto', fused SGD's momentum buffer
    was left uninitialised by a skipped first step (parameters then off by as much as 1e34)."""
    got = _run("sgd-momentum", "fused", 1, range(STEPS), {0}, "auto")
    want = _run("sgd-momentum", "fused", 1, range(1, STEPS), set(), "auto")
    _assert_same(got, want, "fused SGD")
    scaler, opt = got[2], got[3]
    mode, reason = scaler.skip_mode(opt)
    assert mode == "fused"
    assert "the step that creates its state is decided on the host once" in reason


def _embedding_run(make_opt, use, bad, mode):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = make_opt(emb.parameters())
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, skip_mode=mode)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 10, (5,), generator=gen) for _ in range(STEPS)]
    for i in use:
        opt.zero_grad()
        scaler.scale(emb(ids[i]).pow(2).mean()).backward()
        if i in bad:
            emb.weight.grad._values()[0, 0] = INF
        scaler.step(opt)
        scaler.update()
    dense = {k: {f: v.to_dense() if isinstance(v, torch.Tensor) and v.is_sparse else v
                 for f, v in entry.items()}
             for k, entry in copy.deepcopy(opt.state_dict()["state"]).items()}  # fmt: skip
    return [emb.weight.detach().clone()], dense, scaler, opt


SPARSE = {
    "sparse-adam": lambda p: torch.optim.SparseAdam(p, lr=1e-2),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_gradients_skip_exactly(name, pattern):
    bad = PATTERNS[pattern]
    want = _embedding_run(SPARSE[name], [i for i in range(STEPS) if i not in bad], set(), "sync")
    for mode in ("auto", "restore", "sync"):
        got = _embedding_run(SPARSE[name], range(STEPS), bad, mode)
        _assert_same(got, want, f"{name} skip_mode={mode}")


@pytest.mark.parametrize(
    "name,why",
    [
        ("sparse-adam", "SparseAdam keeps its state 'step' as a Python int, which only the host "
                        "can hold back"),
        ("sgd-momentum", "SGD keeps its state 'momentum_buffer' as a sparse tensor"),
    ],
)  # fmt: skip
def test_state_restore_cannot_hold_back_falls_back_to_the_host_with_the_reason(name, why):
    _, _, scaler, opt = _embedding_run(SPARSE[name], range(STEPS), {3}, "auto")
    mode, reason = scaler.skip_mode(opt)
    assert (mode, reason) == ("restore", (
        f"snapshot-and-restore cannot leave this state exactly as it was: {why}; so each step "
        f"is decided on the host instead (one sync per step)"
    ))  # fmt: skip
    assert reason in scaler.explain()


def test_lbfgs_is_refused_with_the_reason():
    model = _model()
    opt = torch.optim.LBFGS(model.parameters())
    scaler = mixprec.GradScaler("cpu")
    text = (
        "LBFGS cannot step under loss scaling: its step() requires a closure that re-evaluates "
        "the loss inside the step, where the scaler can neither scale it nor unscale its "
        "gradients. Train LBFGS without a GradScaler: in bf16 (mixprec.autocast(device, "
        "dtype=torch.bfloat16) needs no scaling) or in fp32."
    )
    with pytest.raises(mixprec.ScalerConfigError) as err:
        scaler.skip_mode(opt)
    assert str(err.value) == text
    x, y = BATCHES[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(mixprec.ScalerConfigError) as err:
        scaler.step(opt)
    assert str(err.value) == text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler._per_optimizer == {}  # nothing recorded: the iteration can go on without it


LATE = {
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
}  # (torch's fused SGD cannot step a mix of parameters with and without momentum buffers)


@pytest.mark.parametrize("name", sorted(LATE))
def test_state_created_later_for_an_unfrozen_layer_is_exact(name):
    """A layer that gets its first gradient late creates its state then: that step is decided
    on the host too, although every other parameter has its state (a fused kernel would
    otherwise leave the new state as its skip left it)."""

    def run(use, bad):
        model = _model()
        opt = LATE[name](model.parameters())
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
        for i in use:
            model[0].requires_grad_(i >= 3)  # frozen for the first three batches
            x, y = BATCHES[i]
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if i in bad:
                model[1].weight.grad[0, 0] = INF
            scaler.step(opt)
            scaler.update()
        state = copy.deepcopy(opt.state_dict()["state"])
        return [p.detach().clone() for p in model.parameters()], state, scaler, opt

    want = run([i for i in range(STEPS) if i != 3], set())
    got = run(range(STEPS), {3})
    _assert_same(got, want, f"{name}, layer 0 unfrozen at an overflowing step")
    scaler, opt = got[2], got[3]
    # the first step, the overflowing one that would create layer 0's state, the next one
    assert scaler._guards[id(opt)].host_syncs == 3
