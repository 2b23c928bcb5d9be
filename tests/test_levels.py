"""Opt levels O0-O3: presets and their reasons, conflicts, what each level does to a model, master
weights, training quality against O0, optimizers, schedulers, clipping and bitwise resume."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.levels.optimizer import AmpCheckpointError

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def _data(n: int = 256, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x @ torch.randn(16, 4, generator=g)).argmax(-1)


def _train(level, steps=150, dtype=None, make_opt=None, **kw):
    model = _net()
    opt = (make_opt or (lambda p: torch.optim.AdamW(p, lr=3e-3)))(model.parameters())
    model, opt = mixprec.initialize(model, opt, level, dtype=dtype, **kw)
    x, y = _data()
    losses = []
    for i in range(steps):
        idx = torch.arange(i * 32, i * 32 + 32) % 256
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]).float(), y[idx])
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


def _tail(v):
    return sum(v[-20:]) / 20


# ------------------------------------------------------------------------------ presets


def test_describe_explains_every_option():
    text = str(mixprec.describe("O2", device_type="cpu"))
    assert text.startswith("O2: low-precision model with fp32 normalization layers")
    assert "master copies" in text and "Resolved for cpu / bf16" in text
    assert "loss_scale             = 1.0" in text and "bf16 has fp32's exponent range" in text
    fp16 = mixprec.describe("O2", device_type="cuda", dtype="fp16", min_loss_scale=1.0)
    by_name = {o.name: o for o in fp16.options}
    assert by_name["loss_scale"].value == "dynamic" and "underflow" in by_name["loss_scale"].reason
    assert by_name["min_loss_scale"].reason == "set by the caller"


def test_describe_defaults_to_this_machines_device_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = str(mixprec.describe("O2"))
    assert (
        "Resolved for cpu / bf16 (no CUDA device on this machine; pass device_type='cuda'" in text
    )
    assert "loss_scale             = 1.0" in text  # bf16: no loss scaling, not fp16's dynamic
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = mixprec.describe("O2")
    assert (gpu.device_type, gpu.dtype, gpu.loss_scale) == ("cuda", torch.float16, "dynamic")
    assert "Resolved for cuda / fp16 (this machine's GPU" in str(gpu)
    # An explicit device type is taken as given, without a note.
    assert "Resolved for cuda / fp16:" in str(mixprec.describe("O2", device_type="cuda"))


def test_presets_match_apex_table():
    rows = {}
    for level in ("O0", "O1", "O2", "O3"):
        o = mixprec.describe(level, device_type="cuda", dtype="fp16")
        rows[level] = (o.cast_model_type, o.patch_torch_functions, o.master_weights, o.loss_scale)
    assert rows == {
        "O0": (FP32, False, False, 1.0),
        "O1": (None, True, False, "dynamic"),
        "O2": (FP16, False, True, "dynamic"),
        "O3": (FP16, False, False, 1.0),
    }


@pytest.mark.parametrize(
    "level,kwargs,match",
    [
        ("O3", {"loss_scale": "dynamic"}, "without master weights cannot use loss scaling"),
        ("O1", {"master_weights": True}, "needs a low-precision model"),
        ("O2", {"master_weights": False}, "without master weights cannot use loss scaling"),
        ("O1", {"loss_scale": -2}, "loss_scale=-2 is invalid"),
        ("O1", {"cast_model_type": "fp64"}, "neither fp32 nor"),
        ("O1", {"keep_bn_fp32": True}, "unknown initialize option 'keep_bn_fp32'"),
        ("O5", {}, "unknown opt level 'O5'.*'O0', 'O1', 'O2', 'O3' or 'O4'"),
        ("O1", {"num_losses": 0}, "num_losses"),
    ],
)
def test_conflicting_or_bad_options_name_the_problem(level, kwargs, match):
    with pytest.raises(mixprec.PolicyError, match=match):
        mixprec.describe(level, device_type="cuda", dtype="fp16", **kwargs)


def test_o1_with_low_precision_weights_warns():
    with pytest.warns(UserWarning, match="O1 casts around each op"):
        mixprec.describe("O1", device_type="cuda", dtype="fp16", cast_model_type="fp16",
                         loss_scale=1.0)  # fmt: skip


# ------------------------------------------------------------------------------ what levels do


def test_o2_model_layout_inputs_and_outputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.lin = nn.Linear(8, 8)
            self.ln, self.bn, self.gn = nn.LayerNorm(8), nn.BatchNorm1d(8), nn.GroupNorm(2, 8)
            self.seen = {}

        def forward(self, tokens, features):
            self.seen["tokens"], self.seen["features"] = tokens.dtype, features.dtype
            h = self.lin(self.emb(tokens).mean(1) + features)
            return {"logits": self.gn(self.bn(self.ln(h))), "count": tokens.shape[1]}

    model = Net()
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    norm_inputs = []
    model.ln.register_forward_pre_hook(lambda m, a: norm_inputs.append(a[0].dtype))
    out = model(torch.randint(0, 10, (4, 3)), torch.randn(4, 8))
    assert model.seen == {"tokens": torch.int64, "features": BF16}  # ints pass untouched
    assert model.lin.weight.dtype == BF16 and model.emb.weight.dtype == BF16
    assert all(p.dtype == FP32 for m in (model.ln, model.bn, model.gn) for p in m.parameters())
    assert model.bn.running_mean.dtype == FP32
    assert norm_inputs == [FP32]  # the fp32 layer computes in fp32
    assert out["logits"].dtype == FP32 and out["count"] == 3


def test_o2_keeps_a_labels_target_as_given():
    """A Hugging Face model computes its loss from ``labels=`` inside forward: O2 casts the
    inputs, not the target (a bf16 regression target loses bits; torch 2.11's mse_loss backward
    refused an fp32 output beside a bf16 target, which failed every O2 Trainer run there)."""

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, labels):
            self.seen = (x.dtype, labels.dtype)
            return {"loss": F.mse_loss(self.lin(x).float(), labels)}

    model = Regression()
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    target = torch.full((2, 4), 1 / 3)  # not exact in bf16
    loss = model(torch.randn(2, 8), labels=target)["loss"]
    assert model.seen == (BF16, FP32)
    loss.backward()
    assert model.lin.weight.grad.dtype == BF16


def test_o1_runs_forward_under_autocast_and_leaves_on_error():
    model = _net()
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1")
    x = torch.randn(2, 16)
    seen = []
    model[3].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    # The last Linear computes in bf16; the model returns fp32 (see the next test).
    assert model(x).dtype == FP32 and seen == [BF16] and model[0].weight.dtype == FP32
    assert not mixprec.is_autocast_enabled()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong shape: forward raises inside the region
    assert not mixprec.is_autocast_enabled() and torch._C._len_torch_function_stack() == 0


def test_o1_returns_fp32_outputs_so_a_loss_outside_the_model_runs_in_fp32():
    """Apex's O1 patched torch, so a loss called on the outputs anywhere ran in fp32. Here the
    region is the forward alone; fp32 outputs give the loss outside it the same: the value of
    torch.amp's loop, whose loss runs inside the region on the fp16 outputs."""
    x, y = _data(8)
    target = torch.randn(8, 4)
    ref = _net()
    with torch.autocast("cpu", dtype=FP16):
        out = ref(x)
        want = F.cross_entropy(out, y), F.mse_loss(out, target)
    net = _net()
    model, opt = mixprec.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O1",
                                    dtype="fp16")  # fmt: skip
    out = model(x)
    losses = F.cross_entropy(out, y), F.mse_loss(out, target)  # the loss outside the model
    assert out.dtype == FP32 and all(loss.dtype == FP32 for loss in losses)
    assert all(torch.equal(a, b) for a, b in zip(losses, want, strict=True))
    # torch 2.11's mse_loss backward failed on an fp16 input with an fp32 target.
    with mixprec.scale_loss(losses[0] + losses[1], opt) as scaled:
        scaled.backward()
    assert all(p.grad.dtype == FP32 and p.grad.isfinite().all() for p in model.parameters())
    assert "cast_model_outputs     = fp32" in str(mixprec.describe("O1"))
    # The caller can keep the outputs as computed (torch.autocast's region semantics).
    kept = mixprec.initialize(_net(), opt_level="O1", dtype="fp16", cast_model_outputs=None)
    assert kept(x).dtype == FP16


def test_inference_and_lists():
    model = mixprec.initialize(_net(), opt_level="O3")
    assert isinstance(model, nn.Module) and model[0].weight.dtype == BF16
    a, b = _net(1), _net(2)
    (a, b), (oa, ob) = mixprec.initialize(
        [a, b],
        [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters())],
        "O2",
        dtype="fp16",
    )
    assert isinstance(oa, mixprec.AmpOptimizer) and oa.scaler is not None
    assert oa.scaler is ob.scaler  # one loss scaler per initialize call
    with pytest.raises(mixprec.MixprecError, match="already initialized"):
        mixprec.initialize(a, opt_level="O1")


# ------------------------------------------------------------------------------ master weights


@pytest.mark.parametrize("level,moved", [("O2", True), ("O3", False)])
def test_master_weights_keep_updates_below_bf16_resolution(level, moved):
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    lin, opt = mixprec.initialize(lin, torch.optim.SGD(lin.parameters(), lr=1.0), level)
    steps = 200
    for _ in range(steps):
        opt.zero_grad()
        loss = lin(torch.ones(1, 1)).float().sum() * 1e-4  # each step: weight -= 1e-4
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    master = next(iter(mixprec.master_params(opt))).item()
    if moved:
        # (the gradient itself passes through bf16: 1e-4 becomes 1.0014e-4, hence 1%)
        assert master == pytest.approx(1.0 - steps * 1e-4, abs=steps * 1e-4 * 0.01)
        assert lin.weight.item() == pytest.approx(1.0 - steps * 1e-4, abs=4e-3)  # bf16 copy
    else:
        assert master == 1.0 and lin.weight.item() == 1.0  # 1e-4 < bf16's step at 1.0


# ------------------------------------------------------------------------------ training


def test_levels_train_and_o1_o2_match_o0():
    results = {level: _tail(_train(level)[2]) for level in ("O0", "O1", "O2", "O3")}
    start = _train("O0", steps=1)[2][0]
    assert all(v < 0.5 * start for v in results.values()), results
    assert abs(results["O1"] - results["O0"]) < 0.02, results
    assert abs(results["O2"] - results["O0"]) < 0.02, results


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_levels_scale_the_loss_and_train(level):
    _, opt, losses = _train(level, dtype="fp16", steps=80)
    assert opt.scaler is not None and opt.loss_scale >= 1.0
    assert _tail(losses) < 0.5 * losses[0]


OPTS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=3e-3, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=3e-2),
}


@pytest.mark.parametrize("name", list(OPTS))
def test_any_optimizer_works_with_master_weights(name):
    _, opt, losses = _train("O2", make_opt=OPTS[name], dtype="fp16", steps=60)
    assert type(opt.optimizer) is type(OPTS[name]([torch.zeros(1, requires_grad=True)]))
    assert all(p.dtype == FP32 for p in mixprec.master_params(opt))
    assert _tail(losses) < losses[0]


def test_param_groups_and_lr_scheduler():
    model = _net()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[3].parameters(), "lr": 0.01, "momentum": 0.5}],
                          lr=0.05)  # fmt: skip
    model, opt = mixprec.initialize(model, opt, "O2")
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    assert opt.param_groups[1]["momentum"] == 0.5
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _data(32)
    for _ in range(2):
        opt.zero_grad()
        with mixprec.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.025, 0.0025]


def test_clipping_sees_true_fp32_gradients():
    ref = _net()
    x, y = _data(32)
    F.cross_entropy(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                    dtype="fp16")  # fmt: skip
    with mixprec.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(mixprec.master_params(opt), float("inf"))
    assert norm.dtype == FP32
    assert norm.item() == pytest.approx(ref_norm.item(), rel=0.05)  # fp16 forward, true scale


def test_gradient_accumulation_happens_in_fp32_masters():
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    x, y = _data(64)
    for half in (slice(0, 32), slice(32, 64)):
        with mixprec.scale_loss(F.cross_entropy(model(x[half]), y[half]) / 2, opt) as scaled:
            scaled.backward()
    grads = [p.grad for p in mixprec.master_params(opt)]
    assert all(g is not None and g.dtype == FP32 for g in grads)
    assert all(p.grad is None for p in model.parameters() if p.dtype == BF16)


def test_step_without_scale_loss_is_refused_when_scaling():
    net = _net()
    model, opt = mixprec.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), "O1",
                                    dtype="fp16")  # fmt: skip
    model(torch.randn(2, 16)).float().sum().backward()
    with pytest.raises(mixprec.ScalerStateError, match="inside `with mixprec.scale_loss"):
        opt.step()


def test_factory_optimizer_and_per_loss_scales():
    model = _net()
    model, opt = mixprec.initialize(model, lambda params: torch.optim.SGD(params, lr=0.1), "O2",
                                    dtype="fp16", num_losses=2)  # fmt: skip
    x, y = _data(32)
    out = model(x)
    with mixprec.scale_loss(F.cross_entropy(out, y), opt, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with mixprec.scale_loss(out.pow(2).mean(), opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()
    assert len(opt.scaler.stats()["losses"]) == 2


# ------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_save_load_continue_is_bitwise_identical(dtype):
    x, y = _data()

    def fresh():
        model = _net(seed=7)
        return mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "O2",
                                  dtype=dtype)  # fmt: skip

    def run(model, opt, steps):
        for i in steps:
            idx = torch.arange(i * 32, i * 32 + 32) % 256
            opt.zero_grad()
            with mixprec.scale_loss(F.cross_entropy(model(x[idx]), y[idx]), opt) as scaled:
                scaled.backward()
            opt.step()

    m1, o1 = fresh()
    run(m1, o1, range(20))
    m2, o2 = fresh()
    run(m2, o2, range(10))
    ckpt = pickle.loads(pickle.dumps({"model": m2.state_dict(), "opt": o2.state_dict()}))
    m3, o3 = fresh()
    m3.load_state_dict(ckpt["model"])
    o3.load_state_dict(ckpt["opt"])
    run(m3, o3, range(10, 20))
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters(), strict=True))
    masters = zip(mixprec.master_params(o1), mixprec.master_params(o3), strict=True)
    assert all(torch.equal(a, b) for a, b in masters)
    assert o1.loss_scale == o3.loss_scale


def test_bad_checkpoints_are_refused_and_change_nothing():
    _, opt, _ = _train("O2", steps=3)
    good = opt.state_dict()
    before = copy.deepcopy(good)
    bad = [
        ({"format": "x"}, "not an AmpOptimizer state dict"),
        ({**good, "opt_level": "O1"}, "saved at opt level 'O1'"),
        ({**good, "masters": good["masters"][:1]}, "master weights do not match"),
        ({**good, "scaler": {"scale": 1.0}}, "loss-scaling setting differs"),
    ]
    for sd, match in bad:
        with pytest.raises(AmpCheckpointError, match=match):
            opt.load_state_dict(sd)
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(before["masters"], after["masters"], strict=True))


def test_scale_loss_argument_errors():
    with (
        pytest.raises(mixprec.PolicyError, match="returned by mixprec.initialize"),
        mixprec.scale_loss(torch.tensor(1.0), torch.optim.SGD([torch.zeros(1)], lr=0.1)),
    ):
        pass  # fmt: skip


def test_two_optimizers_share_one_scale_update_per_iteration():
    model = _net()
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1),
            torch.optim.Adam([*model[1].parameters(), *model[3].parameters()])]  # fmt: skip
    model, (oa, ob) = mixprec.initialize(model, opts, "O2", dtype="fp16")
    x, y = _data(32)
    before = [p.detach().clone() for p in model.parameters()]
    for i in range(3):
        oa.zero_grad()
        ob.zero_grad()
        loss = F.cross_entropy(model(x), y) * (1e30 if i == 1 else 1.0)  # overflow at step 1
        with mixprec.scale_loss(loss, [oa, ob]) as scaled:
            scaled.backward()
        oa.step()
        ob.step()
        if i == 0:
            after_first = [p.detach().clone() for p in model.parameters()]
        if i == 1:
            assert all(torch.equal(a, b) for a, b in zip(after_first, model.parameters(),
                                                         strict=True))  # fmt: skip
    assert oa.loss_scale == ob.loss_scale == 2.0**15  # one backoff, not one per optimizer
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_amp_optimizer_groups_follow_the_inner_optimizer_after_load_state_dict():
    """torch's load_state_dict replaces the group list: schedulers on the wrapper must follow."""
    model = torch.nn.Linear(4, 4)
    _, amp = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                dtype="bf16")  # fmt: skip
    amp.load_state_dict(amp.state_dict())
    sched = torch.optim.lr_scheduler.StepLR(amp, 1, gamma=0.5)
    amp.step()
    sched.step()
    assert amp.optimizer.param_groups[0]["lr"] == 0.05
    assert amp.param_groups is amp.optimizer.param_groups and amp.state is amp.optimizer.state


def test_skip_aware_lr_writes_the_optimizer_that_stands_in():
    """A scheduler built on the original optimizer, then O2: SkipAwareLR(optimizer=) rebinds."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    _, amp = mixprec.initialize(model, opt, "O2", dtype="bf16")
    held = mixprec.SkipAwareLR(sched, None, optimizer=amp)
    amp.step()
    held.step()
    assert amp.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(mixprec.ScalerConfigError, match="param group"):
        mixprec.SkipAwareLR(sched, None, optimizer=torch.optim.SGD(
            [{"params": [torch.zeros(1)]}, {"params": [torch.ones(1)]}], lr=1))  # fmt: skip
