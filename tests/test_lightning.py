"""mixprec's Lightning plugins: Trainer.fit and Fabric against the hand-written mixprec loop and
against Lightning's own ``MixedPrecision``, with injected overflows, checkpoints, clipping,
accumulation and manual optimization. Tiny model, a few steps, CPU."""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec

L = pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import MixedPrecision as LightningAmp  # noqa: E402

from mixprec.integrations.engine import AmpConfig, IntegrationError  # noqa: E402
from mixprec.integrations.lightning import (  # noqa: E402
    AmpMetricsCallback,
    MixprecFabricPrecision,
    MixprecFSDPPrecision,
    MixprecPrecision,
)
from tests.helpers import INF, SCALER, STEPS, X, Y, tiny_net  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _loader(batch: int = 8) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=batch)


def _opt_and_sched(params):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


class Module(L.LightningModule):
    def __init__(self, bad=(), clip=None, manual=False):
        super().__init__()
        self.net = tiny_net()
        self.bad, self.manual = set(bad), manual
        self.automatic_optimization = not manual
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.offset = 0  # batches seen before a resume

    def on_save_checkpoint(self, checkpoint):
        checkpoint["batches_seen"] = self.offset + len(self.losses)

    def on_load_checkpoint(self, checkpoint):
        self.offset = checkpoint["batches_seen"]

    def forward(self, x):
        return self.net(x)

    def _loss(self, batch):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.losses.append(loss.detach().item())
        if self.offset + len(self.losses) - 1 in self.bad:
            loss = loss * INF
        return loss

    def training_step(self, batch, i):
        opt = self.trainer.optimizers[0]
        lr = opt.param_groups[0]["lr"]
        self.lrs.append(float(lr))
        if not self.manual:
            return self._loss(batch)
        lopt = self.optimizers()
        lopt.zero_grad()
        self.manual_backward(self._loss(batch))
        self.clip_gradients(lopt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        lopt.step()
        self.lr_schedulers().step()
        return None

    def configure_optimizers(self):
        opt, sched = _opt_and_sched(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(plugin, module=None, steps=STEPS, callbacks=(), accumulate=1, clip=None, ckpt=None,
         root=None, checkpoint=False, logger=False, batch=8):  # fmt: skip
    module = module or Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", plugins=[plugin], logger=logger,
                            enable_checkpointing=checkpoint, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=list(callbacks),
                            accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                            default_root_dir=root)  # fmt: skip
        trainer.fit(module, _loader(batch), ckpt_path=ckpt)
    return module, trainer


def _hand(level, dtype, bad=(), steps=STEPS, accumulate=1, clip=None):
    """The same run written by hand with mixprec.initialize (the reference)."""
    model = tiny_net()
    opt, sched = _opt_and_sched(model.parameters())
    model, amp = mixprec.initialize(model, opt, level, dtype=dtype)
    if amp.scaler is not None:
        amp.scaler._init_scale = SCALER["init_scale"]
    sched = mixprec.SkipAwareLR(sched, amp.scaler, optimizer=amp)
    losses, lrs, it = [], [], iter(_loader())
    for _ in range(steps):
        lrs.append(float(amp.param_groups[0]["lr"]))
        amp.zero_grad()
        for _ in range(accumulate):
            x, y = next(it)
            loss = F.mse_loss(model(x).float(), y)
            losses.append(loss.item())
            if len(losses) - 1 in bad:
                loss = loss * INF
            with mixprec.scale_loss(loss / accumulate, amp) as scaled:
                scaled.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(mixprec.master_params(amp), clip)
        amp.step()
        sched.step()
    return losses, lrs, model


@pytest.mark.parametrize(("level", "dtype"), [("O1", "fp16"), ("O1", "bf16"), ("O2", "fp16"),
                                              ("O2", "bf16"), ("O3", "bf16")])  # fmt: skip
def test_trainer_fit_equals_the_hand_written_loop(level, dtype):
    bad = {3} if dtype == "fp16" else set()  # bf16 has no scaler: an inf would stay
    module, trainer = _fit(MixprecPrecision(level, dtype, device="cpu", scaler=SCALER),
                           Module(bad=bad))  # fmt: skip
    losses, lrs, model = _hand(level, dtype, bad=bad)
    assert module.losses == losses  # bit for bit
    assert module.lrs == lrs
    for a, b in zip(module.net.parameters(), model.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if bad:  # the injected overflow: skipped, the schedule held still, the scale halved
        assert lrs[3] == lrs[4] == lrs[2] / 2
        scaler = trainer.precision_plugin.scaler
        assert scaler.stats()["losses"][0]["skipped"] == 1
        assert scaler.get_scale() == SCALER["init_scale"] / 2


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_o1_equals_lightnings_own_mixed_precision(dtype):
    """Same losses and weights as Lightning's MixedPrecision (torch.autocast + torch's scaler)."""
    prec = "16-mixed" if dtype == "fp16" else "bf16-mixed"
    scaler = torch.amp.GradScaler("cpu", **SCALER) if dtype == "fp16" else None
    theirs, _ = _fit(LightningAmp(prec, "cpu", scaler=scaler), clip=0.5)
    ours, _ = _fit(MixprecPrecision("O1", dtype, device="cpu", scaler=SCALER), clip=0.5)
    assert ours.losses == theirs.losses
    # The same region settings: Lightning's turns the weight-cast cache off (a weight used
    # twice in a forward, as tied embeddings are, drifted by 4.6e-6 with the cache on).
    caches = []
    for plugin in (LightningAmp(prec, "cpu"), MixprecPrecision("O1", dtype, device="cpu")):
        with plugin.autocast_context_manager():
            caches.append(torch.is_autocast_cache_enabled())
    assert caches == [False, False]
    for a, b in zip(ours.net.parameters(), theirs.net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_accumulation_and_clipping_equal_the_hand_written_loop():
    module, _ = _fit(MixprecPrecision("O2", "fp16", device="cpu", scaler=SCALER),
                     Module(bad={5}), steps=3, accumulate=2, clip=0.5)  # fmt: skip
    losses, lrs, model = _hand("O2", "fp16", bad={5}, steps=3, accumulate=2, clip=0.5)
    # Lightning divides each micro-batch's loss by 2 before backward, as the reference does;
    # power-of-two scales make unscaling exact, so accumulating before or after it agrees.
    assert module.losses == losses
    assert module.lrs[::2] == lrs
    for a, b in zip(module.net.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_manual_optimization_clips_unscaled_gradients():
    """manual_backward + clip_gradients + step: clipping sees true gradients (unscaled first)."""
    module, _ = _fit(MixprecPrecision("O1", "fp16", device="cpu", scaler=SCALER),
                     Module(manual=True, bad={2}))  # fmt: skip
    losses, lrs, model = _hand("O1", "fp16", bad={2}, clip=0.5)
    assert module.losses == losses
    assert module.lrs == lrs
    for a, b in zip(module.net.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_resume_equals_the_uninterrupted_run(tmp_path):
    """Lightning's own save/resume carries the scaler, the masters and the held schedule."""
    plugin = lambda: MixprecPrecision("O2", "fp16", device="cpu", scaler=SCALER)  # noqa: E731
    # One batch per epoch, so the checkpoint falls on an epoch boundary (a plain DataLoader
    # cannot be resumed mid-epoch).
    full, _ = _fit(plugin(), Module(bad={1}), batch=48)
    first, trainer = _fit(plugin(), Module(bad={1}), steps=3, batch=48)
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)
    assert "MixprecPrecision" in state  # the plugin's state (the scaler) ...
    assert state["optimizer_states"][0]["format"] == "mixprec.AmpOptimizer/2"  # ... and masters
    resumed, trainer2 = _fit(plugin(), Module(bad={1}), ckpt=str(path), batch=48)
    assert first.losses + resumed.losses == full.losses
    assert trainer2.precision_plugin.scaler.get_scale() == SCALER["init_scale"] / 2
    for a, b in zip(resumed.net.parameters(), full.net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_metrics_callback_logs_every_step_in_batches():
    from lightning.pytorch.loggers.logger import Logger

    class Memory(Logger):
        name, version = "memory", 0
        rows: list = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, *a, **k):
            pass

    logger = Memory()
    callback = AmpMetricsCallback(every=4)
    _fit(MixprecPrecision("O1", "fp16", device="cpu", scaler=SCALER), Module(bad={3}),
         callbacks=[callback], logger=logger)  # fmt: skip
    mine = {s: r for s, r in logger.rows if "loss-scale" in r}
    assert sorted(mine) == list(range(1, STEPS + 1))  # every step, though read twice
    scales = [mine[s]["loss-scale"] for s in range(1, STEPS + 1)]
    assert scales == [1024.0] * 4 + [512.0] * 2  # step 4 used 1024 and overflowed
    assert [mine[s]["skipped-iterations"] for s in range(1, STEPS + 1)] == [0, 0, 0, 1, 1, 1]
    assert mine[4]["nan-iterations"] == 1.0  # its loss was inf (Megatron's "nan iterations")
    assert callback.events == [(4, "step 4 skipped (loss scale 1024): no watch attached")]


def test_fabric_o1_and_o2_equal_the_hand_written_loop():
    for level in ("O1", "O2"):
        plugin = MixprecFabricPrecision(level, "fp16", device="cpu", scaler=SCALER)
        fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
        model = tiny_net()
        opt, sched = _opt_and_sched(model.parameters())
        if level == "O2":
            with pytest.raises(IntegrationError, match=r"precision.initialize\(model, optimizer"):
                fabric.setup(model, opt)
            model, opt = fabric.setup(*plugin.initialize(model, opt))
            sched = mixprec.SkipAwareLR(sched, plugin.scaler, optimizer=opt.optimizer)
        else:
            model, opt = fabric.setup(model, opt)
            sched = mixprec.SkipAwareLR(sched, plugin.scaler)
        losses = []
        metrics = mixprec.AmpMetrics(plugin, every=STEPS)
        for i, (x, y) in enumerate(_loader()):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            losses.append(loss.item())
            fabric.backward(loss * INF if i == 3 else loss)
            # Fabric checks the norm by default (a host read, an error on overflow steps).
            fabric.clip_gradients(model, opt, max_norm=0.5, error_if_nonfinite=False)
            opt.step()
            sched.step()
            batch = metrics.step()
        assert [row["skipped-iterations"] for _, row in batch.rows] == [0, 0, 0, 1, 1, 1]
        ref_losses, _, ref = _hand(level, "fp16", bad={3}, clip=0.5)
        assert losses == ref_losses, level
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b), level


def test_fabric_checkpoint_carries_the_scaler(tmp_path):
    plugin = MixprecFabricPrecision("O1", "fp16", device="cpu", scaler=SCALER)
    fabric = L.Fabric(accelerator="cpu", plugins=[plugin])
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = X[:8], Y[:8]
    fabric.backward(F.mse_loss(model(x), y) * INF)
    opt.step()
    fabric.save(tmp_path / "c.pt", {"model": model, "optimizer": opt, "amp": plugin})
    other = MixprecFabricPrecision("O1", "fp16", device="cpu", scaler=SCALER)
    fabric2 = L.Fabric(accelerator="cpu", plugins=[other])
    net2 = tiny_net()
    m2, o2 = fabric2.setup(net2, torch.optim.SGD(net2.parameters(), lr=0.1))
    fabric2.load(tmp_path / "c.pt", {"model": m2, "optimizer": o2, "amp": other})
    assert other.scaler.get_scale() == 512.0 and other.scaler.stats()["losses"][0]["skipped"] == 1
    with pytest.raises(IntegrationError, match="resume with the same opt level"):
        MixprecFabricPrecision("O3", "bf16").load_state_dict(plugin.state_dict())


def test_fsdp_plugin_maps_levels_to_fsdp_mixed_precision():
    from lightning.pytorch.strategies import FSDPStrategy

    o1 = MixprecFSDPPrecision("O1", "fp16", device="cpu")
    assert o1.mixed_precision_config is None and o1.scaler is not None
    o2 = MixprecFSDPPrecision("O2", "fp16", device="cpu")
    mp = o2.mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (
        torch.float16, torch.float32, torch.float32)  # fmt: skip
    assert not o2.engine.options.master_weights  # FSDP's fp32 shards are the masters
    assert o2.scaler is not None
    o3 = MixprecFSDPPrecision("O3", "bf16", device="cpu")
    assert o3.mixed_precision_config.reduce_dtype == torch.bfloat16 and o3.scaler is None
    strategy = FSDPStrategy(precision_plugin=o2)  # Lightning accepts only FSDPPrecision kinds
    assert strategy.precision_plugin is o2
    # Lightning keeps the user's optimizer (FSDP.optim_state_dict reads torch's state-dict
    # format, not an AmpOptimizer's); the engine's step, given it, finds the scaled AmpOptimizer.
    net = tiny_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    o2.convert_module(net)
    _, kept, _ = o2.connect(net, [opt], [])
    assert kept == [opt] and o2.engine.amp_for(opt) in o2.engine.optimizers
    o2.engine.scale(F.mse_loss(net(X[:8]), Y[:8]) * INF).backward()
    before = [p.detach().clone() for p in net.parameters()]
    o2.engine.unscale_(opt)
    o2.engine.step(opt)
    assert o2.scaler.get_scale() == 2.0**15 and all(
        torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))  # fmt: skip
    with pytest.raises(IntegrationError, match="gradient_clip_algorithm='value'"):
        o2.clip_grad_by_norm(None, 1.0)


def test_plugin_errors_name_the_fix():
    with pytest.raises(mixprec.PolicyError, match="O0"):
        MixprecPrecision("O5")
    with pytest.raises(IntegrationError, match="not a GradScaler argument.*init_scale"):
        MixprecPrecision("O1", "fp16", scaler={"init_scal": 1.0})
    plugin = MixprecPrecision("O1", "bf16", device="cpu")
    net = tiny_net()
    amp_model, amp = mixprec.initialize(net, torch.optim.SGD(net.parameters(), lr=1), "O2",
                                        dtype="bf16")  # fmt: skip
    with pytest.raises(IntegrationError, match="already prepared by mixprec.initialize"):
        plugin.convert_module(amp_model)
    with pytest.raises(IntegrationError, match="pass the plain torch optimizer"):
        plugin.engine.wrap_optimizer(amp)
    assert plugin.precision == "bf16-mixed" and not math.isnan(plugin.engine.scale(
        torch.tensor(1.0)).item())  # fmt: skip
    assert MixprecPrecision("O3", "fp16", device="cpu").precision == "16-true"
    assert isinstance(MixprecPrecision(config=AmpConfig("O2", "bf16")).config, AmpConfig)


# --------------------------------------- gaps that Lightning's own AMP tests found (tests/peers)


def test_configs_and_plugins_survive_pickle_and_deepcopy():
    """strategy='ddp_spawn' pickles the Trainer (or Fabric) with its plugin into each process."""
    config = AmpConfig("O2", "fp16", policy="compute=fp16", scaler=SCALER,
                       options={"keep_batchnorm_fp32": True})  # fmt: skip
    roundtrips = [copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))]
    for again in (roundtrip(config) for roundtrip in roundtrips):
        assert again == config and again.scaler == SCALER
        with pytest.raises(TypeError):  # still frozen
            again.scaler["init_scale"] = 1.0  # type: ignore[index]
    for plugin in (MixprecPrecision(config=config, device="cpu"),
                   MixprecFabricPrecision(config=config, device="cpu")):  # fmt: skip
        for roundtrip in roundtrips:
            twin = roundtrip(plugin)
            assert twin.config == config and twin.precision == plugin.precision == "16-mixed"
            assert twin.scaler.get_scale() == SCALER["init_scale"]


class _Lbfgs(L.LightningModule):
    """LBFGS calls the closure (forward and backward) several times in each step."""

    def __init__(self):
        super().__init__()
        self.net = tiny_net()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, i):
        loss = F.mse_loss(self.net(batch[0]).float(), batch[1])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)


def _fit_lbfgs(**precision):
    module = _Lbfgs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False, **precision)  # fmt: skip
        trainer.fit(module, _loader())
    return module


def _fabric_lbfgs(**precision):
    fabric = L.Fabric(accelerator="cpu", **precision)
    net = tiny_net()
    model, opt = fabric.setup(net, torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=3))
    losses = []
    for x, y in list(_loader())[:2]:

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            losses.append(loss.detach())
            return loss

        opt.step(closure)
    return losses, net


def test_lbfgs_with_a_closure_runs_in_bf16_as_under_lightnings_own_plugin():
    """Without loss scaling and masters (bf16 at O1) the optimizer runs the closure, as under
    Lightning's "bf16-mixed": same losses and weights, bit for bit (Trainer and Fabric)."""
    theirs = _fit_lbfgs(precision="bf16-mixed")
    ours = _fit_lbfgs(plugins=[MixprecPrecision("O1", "bf16", device="cpu")])
    assert len(ours.losses) > 2  # the closure ran several times per step
    assert torch.equal(torch.stack(ours.losses), torch.stack(theirs.losses))
    for a, b in zip(ours.net.parameters(), theirs.net.parameters(), strict=True):
        assert torch.equal(a, b)
    ref_losses, ref = _fabric_lbfgs(precision="bf16-mixed")
    losses, net = _fabric_lbfgs(plugins=[MixprecFabricPrecision("O1", "bf16", device="cpu")])
    assert len(losses) > 2 and torch.equal(torch.stack(losses), torch.stack(ref_losses))
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_lbfgs_under_loss_scaling_or_masters_is_refused_naming_bf16():
    for level in ("O1", "O2"):  # fp16: a scaled loss; O2: fp32 masters
        with pytest.raises(IntegrationError, match=r"LBFGS .*dtype='bf16'"):
            _fit_lbfgs(plugins=[MixprecPrecision(level, "fp16", device="cpu")])
    with pytest.raises(mixprec.ScalerStateError, match="closure.*bf16 at O1 or O3"):
        _fabric_lbfgs(plugins=[MixprecFabricPrecision("O1", "fp16", device="cpu")])


class _KeywordSGD(torch.optim.SGD):
    def step(self, closure=None, *, note=None):
        self.notes.append(note)
        return super().step(closure)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_step_keyword_arguments_reach_the_optimizer(dtype):
    """optimizer.step(..., note=...) in manual optimization: passed on, scaled step or not."""

    class Manual(Module):
        def training_step(self, batch, i):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self._loss(batch))
            opt.step(note=i)

        def configure_optimizers(self):
            opt = _KeywordSGD(self.parameters(), lr=0.1)
            opt.notes = []
            return opt

    module = Manual(manual=True)
    _, trainer = _fit(MixprecPrecision("O1", dtype, device="cpu", scaler=SCALER), module, steps=3)
    assert trainer.optimizers[0].optimizer.notes == [0, 1, 2]


def test_scaler_can_be_replaced_before_setup_only():
    plugin = MixprecPrecision("O1", "fp16", device="cpu")
    with pytest.raises(IntegrationError, match=r"mixprec.GradScaler.*scaler=\{'init_scale'"):
        plugin.scaler = torch.amp.GradScaler("cpu")
    mine = mixprec.GradScaler("cpu", init_scale=4.0)
    plugin.scaler = mine  # before setup: the optimizers will step with it
    net = tiny_net()
    plugin.connect(net, [torch.optim.SGD(net.parameters(), lr=0.1)], [])
    assert plugin.engine.optimizers[0].scaler is mine
    with pytest.raises(IntegrationError, match="before trainer.fit / fabric.setup"):
        plugin.scaler = mixprec.GradScaler("cpu")
    assert plugin.scaler is mine
