"""The same user code with torch.amp.GradScaler and with mixprec.GradScaler: equal results.

One test per public behaviour torch documents for its scaler (the AMP examples: the typical
loop, clipping after ``unscale_``, gradient accumulation, gradient penalty, several models,
losses and optimizers; pickling, deepcopy, state dicts before and after first use, the
optimizer contracts, a preset ``grad_scale``, sparse gradients, ``update(new_scale)``, disabled
scalers and the error types). Each test writes the loop once, as a function of the scaler
class, runs it with both, and compares bit for bit: both unscale with the same kernel and the
same fp64 reciprocal, and a skipped step is invisible either way, so the arithmetic is the same.
Overflows are injected (inf and NaN) so that skipping and backing off are exercised too.

The deliberate differences are listed in docs/scaling.md ("Differences from torch.amp").
"""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec

INF, NAN = float("inf"), float("nan")
SCALERS = {"torch": torch.amp.GradScaler, "mixprec": mixprec.GradScaler}


def _model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _batches(n: int, seed: int = 1, width: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, width, generator=g), torch.randn(4, 2, generator=g))
            for _ in range(n)]  # fmt: skip


def _region():
    return torch.autocast("cpu", dtype=torch.float16)


def _poison(model: torch.nn.Module, i: int) -> None:
    model[0].weight.grad[0, 0] = NAN if i % 2 else INF


def _equal(a, b) -> bool:
    """Bitwise equality of nested lists/tuples/dicts of tensors and Python values."""
    if isinstance(a, torch.Tensor):  # NaN equals NaN here (an overflowing step's grad norm)
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
            return False
        nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
        return torch.equal(nan, b.isnan() if b.is_floating_point() else nan) and torch.equal(
            a[~nan], b[~nan]
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _both(run):
    out = {name: run(cls) for name, cls in SCALERS.items()}
    assert _equal(out["mixprec"], out["torch"])
    return out["mixprec"]


def _params(*models):
    return [p.detach().clone() for m in models for p in m.parameters()]


# ----------------------------------------------------------------------- the documented loops

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_typical_loop(name):
    injects = {2, 5, 6, 11}  # (the fused SGD rows avoid the first step: docs/scaling.md)

    def run(cls):
        model = _model()
        opt = OPTIMIZERS[name](model.parameters())
        scaler = cls("cpu", init_scale=2.0**10, growth_interval=3)
        scales = []
        for i, (x, y) in enumerate(_batches(14)):
            opt.zero_grad()
            with _region():
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if i in injects:
                _poison(model, i)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, _params(model), opt.state_dict()["state"]

    scales, _, _ = _both(run)
    assert min(scales) < 2.0**10 and any(b > a for a, b in itertools.pairwise(scales))  # moved


def test_gradient_clipping_after_unscale():
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = cls("cpu", init_scale=2.0**8, growth_interval=4)
        norms = []
        for i, (x, y) in enumerate(_batches(10)):
            opt.zero_grad()
            with _region():
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if i in (3, 4):
                _poison(model, i)
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            scaler.step(opt)
            scaler.update()
        return norms, scaler.get_scale(), _params(model)

    _both(run)


def test_gradient_accumulation():
    iters_to_accumulate = 3

    def run(cls):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = cls("cpu", init_scale=2.0**9, growth_interval=2)
        scales = []
        for i, (x, y) in enumerate(_batches(18)):
            with _region():
                loss = F.mse_loss(model(x), y) / iters_to_accumulate
            scaler.scale(loss).backward()
            if i == 7:  # one overflowing micro-batch spoils its whole accumulation
                _poison(model, i)
            if (i + 1) % iters_to_accumulate == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                scales.append(scaler.get_scale())
        return scales, _params(model), opt.state_dict()["state"]

    _both(run)


def test_gradient_penalty():
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = cls("cpu", init_scale=2.0**8)
        for x, y in _batches(6):
            opt.zero_grad()
            with _region():
                loss = F.mse_loss(model(x), y)
            scaled = torch.autograd.grad(scaler.scale(loss), list(model.parameters()),
                                         create_graph=True)  # fmt: skip
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled]
            with _region():
                loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return _params(model), scaler.get_scale()

    _both(run)


def test_several_models_losses_and_optimizers():
    def run(cls):
        model0, model1 = _model(0), _model(1)
        opt0 = torch.optim.SGD(model0.parameters(), lr=0.05)
        opt1 = torch.optim.Adam(model1.parameters(), lr=1e-2)
        scaler = cls("cpu", init_scale=2.0**8, growth_interval=3)
        scales = []
        for i, (x, y) in enumerate(_batches(10)):
            opt0.zero_grad()
            opt1.zero_grad()
            with _region():
                out0, out1 = model0(x), model1(x)
                loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
                loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if i in (2, 6):
                _poison(model1, i)  # only opt1's gradients overflow: opt0 still steps
            scaler.unscale_(opt0)  # optional, per optimizer
            scaler.step(opt0)
            scaler.step(opt1)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, _params(model0, model1), opt1.state_dict()["state"]

    _both(run)


def test_sparse_gradients():
    def run(cls):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=2.0**6)
        ids = torch.Generator().manual_seed(2)
        for i in range(8):
            opt.zero_grad()
            idx = torch.randint(0, 10, (6,), generator=ids)  # repeated ids: uncoalesced grads
            scaler.scale(emb(idx).pow(2).sum()).backward()
            if i == 3:
                emb.weight.grad._values()[0, 0] = INF
            scaler.step(opt)
            scaler.update()
        return emb.weight.detach().clone(), scaler.get_scale()

    _both(run)


def test_update_with_a_new_scale():
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = cls("cpu", init_scale=2.0**8)
        scales = []
        for i, (x, y) in enumerate(_batches(6)):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if i == 2:
                _poison(model, i)
            scaler.step(opt)
            scaler.update(2.0 ** (4 + i) if i % 2 else torch.tensor(2.0 ** (3 + i)))
            scales.append(scaler.get_scale())
        return scales, _params(model)

    scales, _ = _both(run)
    assert scales == [8.0, 32.0, 32.0, 128.0, 128.0, 512.0]


def test_disabled_scaler_passes_everything_through():
    def run(cls):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = cls("cpu", enabled=False)
        out = []
        for x, y in _batches(3):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            out.append(scaler.scale(loss) is loss)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        return out, _params(model), scaler.get_scale(), scaler.is_enabled(), scaler.state_dict()

    assert _both(run)[0] == [True] * 3


def test_getters_and_setters():
    def run(cls):
        scaler = cls("cpu", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25,
                     growth_interval=7)  # fmt: skip
        before = (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
                  scaler.get_growth_interval())  # fmt: skip
        scaler.set_growth_factor(3.0)
        scaler.set_backoff_factor(0.5)
        scaler.set_growth_interval(2)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scales = []
        for x, y in _batches(5):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return before, scales

    assert _both(run)[1] == [8.0, 24.0, 24.0, 72.0, 72.0]


def test_scale_accepts_tensors_lists_tuples_and_iterables():
    def run(cls):
        scaler = cls("cpu", init_scale=4.0)
        a, b = torch.tensor(1.0), torch.tensor(2.0)
        out = [scaler.scale(a), scaler.scale([a, b]), scaler.scale((a, [b]))]
        lazy = scaler.scale(iter([a, b]))
        return out, type(out[2]), list(lazy)

    _both(run)


# ----------------------------------------------------------------------- copies and checkpoints


def _steps(scaler, model, opt, batches, poison=()):
    scales = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        with _region():
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if i in poison:
            _poison(model, i)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("when", ["before-use", "after-scale", "after-update"])
def test_copies_keep_working(how, when):
    """Issue 12: a pickled scaler that had scaled a loss failed with 'must be real number'."""
    copier = {"pickle": lambda s: pickle.loads(pickle.dumps(s)), "deepcopy": copy.deepcopy}[how]

    def run(cls):
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = cls("cpu", init_scale=2.0**10, growth_interval=2)
        batches = _batches(8)
        first = []
        if when == "after-update":
            first = _steps(scaler, model, opt, batches[:3], poison={1})
        elif when == "after-scale":
            scaler.scale(torch.tensor(1.0))
        clone = copier(scaler)
        scale = clone.get_scale()
        # The copy carries on for the original, which is never used again.
        rest = _steps(clone, model, opt, batches[3:], poison={2})
        return first, scale, rest, _params(model), clone.state_dict()["_growth_tracker"]

    _both(run)


def test_copying_mid_iteration_is_refused_by_both():
    for cls in SCALERS.values():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu")
        scaler.scale(model(torch.randn(2, 8)).sum()).backward()
        scaler.unscale_(opt)
        # torch raises AssertionError, mixprec ScalerStateError (docs/scaling.md)
        with pytest.raises((AssertionError, mixprec.ScalerStateError)):
            pickle.dumps(scaler)
        with pytest.raises((AssertionError, mixprec.ScalerStateError)):
            copy.deepcopy(scaler)
        scaler.step(opt)
        scaler.update()
        pickle.dumps(scaler)  # between iterations again: fine


@pytest.mark.parametrize("saver", sorted(SCALERS))
@pytest.mark.parametrize("loader", sorted(SCALERS))
@pytest.mark.parametrize("when", ["before-use", "after-use"])
def test_state_dict_round_trips_between_both(saver, loader, when):
    """Issue 12: a state dict saved before first use did not load (history of length 0)."""
    batches = _batches(10)

    def resume(cls_save, cls_load):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = cls_save("cpu", init_scale=2.0**9, growth_interval=3)
        done = 4 if when == "after-use" else 0
        first = _steps(scaler, model, opt, batches[:done], poison={1})
        fresh = cls_load("cpu")
        fresh.load_state_dict(scaler.state_dict())
        return first + _steps(fresh, model, opt, batches[done:], poison={2}), _params(model)

    reference = resume(torch.amp.GradScaler, torch.amp.GradScaler)
    assert _equal(resume(SCALERS[saver], SCALERS[loader]), reference)


def test_state_dicts_before_first_use_equal_torchs_fields():
    ours, theirs = mixprec.GradScaler("cpu").state_dict(), torch.amp.GradScaler("cpu").state_dict()
    assert {k: ours[k] for k in theirs} == theirs


# ----------------------------------------------------------------------- optimizer contracts


class _KeywordSGD(torch.optim.SGD):
    """torch's older contract, written the way apex/Transformer Engine's FusedAdam and
    ColossalAI's HybridAdam are: check infs and read the scale through the scaler's methods."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is None:
            return super().step(closure)
        found = sum(grad_scaler._check_inf_per_device(self).values())
        inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    # unscale; on overflow, subtract nothing (lr * 0)
                    update = p.grad * inv_scale * group["lr"] * (1 - found)
                    p.sub_(torch.nan_to_num(update, nan=0.0, posinf=0.0, neginf=0.0))
        return "stepped"


class _UnscalingSGD(torch.optim.SGD):
    """The same contract through the public API: unscale_ itself, then decide on the host."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        if grad_scaler is not None:
            grad_scaler.unscale_(self)
            if any(bool(f) for f in grad_scaler._found_inf_per_device(self).values()):
                return "skipped"
        return super().step(closure)


@pytest.mark.parametrize("cls", [_KeywordSGD, _UnscalingSGD], ids=lambda c: c.__name__)
def test_keyword_contract_hands_the_optimizer_the_scaler(cls):
    """Issue 12: mixprec passed None, so the optimizer stepped on scaled gradients."""

    def run(scaler_cls):
        w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        opt = cls([w], lr=0.1)
        scaler = scaler_cls("cpu", init_scale=1024.0)
        returned, warned = [], []
        for i in range(4):
            opt.zero_grad()
            scaler.scale((w * torch.tensor([2.0, 3.0])).sum()).backward()
            if i == 2:
                w.grad[0] = INF
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                returned.append(scaler.step(opt))
            warned.append([c.category for c in caught])
            scaler.update()
        return w.detach().clone(), returned, warned, scaler.get_scale()

    _, _, warned, scale = _both(run)
    assert warned == [[FutureWarning]] * 4  # torch deprecates the contract; both say so
    assert scale == 512.0  # the overflow the optimizer reported backed the scale off


def test_issue12_keyword_contract_repro():
    """init_scale 1024, grad 2, lr 0.1: torch's w = 0.8, mixprec's was -203.8."""

    def run(cls):
        w = torch.nn.Parameter(torch.tensor(1.0))
        opt = _UnscalingSGD([w], lr=0.1)
        scaler = cls("cpu", init_scale=1024.0)
        scaler.scale(w * 2).backward()
        with pytest.warns(FutureWarning):
            scaler.step(opt)
        scaler.update()
        return w.item()

    assert _both(run) == pytest.approx(0.8)


@pytest.mark.parametrize("unscale_first", [False, True])
def test_preset_grad_scale_is_multiplied_like_torch(unscale_first):
    """Issue 12: a grad_scale set on a fused optimizer was overwritten; torch multiplies it."""

    def run(cls):
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        scaler = cls("cpu", init_scale=2.0**8)
        present = []
        for i, (x, y) in enumerate(_batches(5)):
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            if i == 3:
                _poison(model, i)
            opt.grad_scale = torch.tensor(4.0)  # e.g. to average over 4 accumulation steps
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            present.append(hasattr(opt, "grad_scale"))  # torch deletes it after the step
            scaler.update()
        return _params(model), present, opt.state_dict()["state"]

    params, present, _ = _both(run)
    assert present == [False] * 5
    reference = _model()  # the preset matters: without it the run differs
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, fused=True)
    _steps(mixprec.GradScaler("cpu", init_scale=2.0**8), reference, ref_opt, _batches(5), {3})
    assert not _equal(params, _params(reference))


# ----------------------------------------------------------------------- errors


def test_misuse_raises_the_same_exception_types():
    """mixprec's errors subclass the builtin torch raises, so `except` clauses keep working."""
    for cls in SCALERS.values():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu")
        scaler.scale(F.mse_loss(*[model(torch.randn(2, 8)), torch.randn(2, 2)])).backward()
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError):
            scaler.unscale_(opt)  # twice in one iteration
        scaler.step(opt)
        with pytest.raises(RuntimeError):
            scaler.step(opt)  # twice in one iteration
        with pytest.raises(RuntimeError):
            scaler.unscale_(opt)  # after step
        scaler.update()
        with pytest.raises(RuntimeError):
            scaler.step(opt, closure=lambda: 0.0)
        half = _model().half()
        half_opt = torch.optim.SGD(half.parameters(), lr=0.1)
        scaler.scale(half(torch.randn(2, 8, dtype=torch.float16)).float().sum()).backward()
        with pytest.raises(ValueError):
            scaler.unscale_(half_opt)  # fp16 gradients cannot be unscaled in place
