"""Lightning workflows beyond one ``Trainer.fit``: callbacks that read the optimizers (the
LearningRateMonitor), a second Trainer on a model an earlier one trained (``trainer.test`` with a
fresh Trainer, a second ``fit``). Each against Lightning's own precision or the same run written
another way. Tiny model, CPU, a few steps."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import LearningRateMonitor  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as LightningAmp  # noqa: E402

from mixprec.integrations.engine import IntegrationError  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402
from tests.helpers import INF, SCALER, X, Y, tiny_net  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _loader(batch: int = 8) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=batch)


class _Memory(Logger):
    name, version = "memory", 0

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *a, **k):
        pass


class Module(L.LightningModule):
    def __init__(self, bad=()):
        super().__init__()
        self.net = tiny_net()
        self.bad = set(bad)
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        loss = F.mse_loss(self(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        return loss * INF if len(self.losses) - 1 in self.bad else loss

    def test_step(self, batch, i):
        self.log("test_loss", F.mse_loss(self(batch[0]).float(), batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9**k)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(plugin, steps=3, **kwargs):
    kwargs.setdefault("logger", False)
    return L.Trainer(max_steps=steps, accelerator="cpu", plugins=[plugin],
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)  # fmt: skip


def _fit(plugin, module, steps=3, batch=48, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(plugin, steps, **kwargs)
        trainer.fit(module, _loader(batch))
    return trainer


@pytest.mark.parametrize(("level", "dtype"), [("O1", "fp16"), ("O2", "fp16"), ("O2", "bf16")])
def test_learning_rate_monitor_logs_each_optimizer_once(level, dtype):
    """The monitor matched the schedule's optimizer (an AmpOptimizer) against the Trainer's,
    unwrapped, found none, and logged the optimizer a second time: 'lr-AmpOptimizer' (the
    schedule) beside 'lr-AdamW' (O1/O2 fp16 and O2 bf16, where the scheduler is wrapped)."""
    logs = {}
    plugins = {"theirs": LightningAmp("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")),
               "ours": MixprecPrecision(level, dtype, device="cpu", scaler=SCALER)}  # fmt: skip
    for name, plugin in plugins.items():
        logger = _Memory()
        _fit(plugin, Module(bad={1} if dtype == "fp16" else ()), steps=4, batch=8, logger=logger,
             callbacks=[LearningRateMonitor("step")], log_every_n_steps=1)  # fmt: skip
        logs[name] = [(s, r) for s, r in logger.rows if any(k.startswith("lr") for k in r)]
    assert {k for _, r in logs["ours"] for k in r} == {k for _, r in logs["theirs"] for k in r}
    assert {k for _, r in logs["ours"] for k in r} == {"lr-AdamW"}
    lrs = [r["lr-AdamW"] for _, r in logs["ours"]]
    if dtype == "fp16":  # step 2 (index 1) overflowed: the schedule held still there
        assert lrs == pytest.approx([0.01, 0.009, 0.009, 0.0081])
    else:
        assert lrs == pytest.approx([0.01, 0.009, 0.0081, 0.00729])


@pytest.mark.parametrize(("level", "dtype"), [("O2", "fp16"), ("O3", "bf16")])
def test_a_new_trainer_takes_over_a_model_an_earlier_plugin_converted(level, dtype):
    """Testing (or training on) with a fresh Trainer after fit, as Lightning's docs do after DDP,
    raised 'M was already prepared by mixprec.initialize' at O2/O3. The new plugin now shares
    the earlier one's fp32 masters: a second fit equals the one with the same plugin, bit for
    bit, and neither takes masters from the cast weights."""
    first = MixprecPrecision(level, dtype, device="cpu", scaler=SCALER)
    module = Module()
    _fit(first, module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _trainer(MixprecPrecision(level, dtype, device="cpu")).test(
            module, _loader(), verbose=False
        )
    assert out[0]["test_loss"] > 0
    second = MixprecPrecision(level, dtype, device="cpu", scaler=SCALER)
    _fit(second, module)
    again = Module()  # the reference: both fits with one plugin
    same = MixprecPrecision(level, dtype, device="cpu", scaler=SCALER)
    _fit(same, again)
    _fit(same, again)
    assert module.losses == again.losses
    for a, b in zip(module.parameters(), again.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
        ma, mb = second.engine.master_of(a), same.engine.master_of(b)
        assert torch.equal(ma, mb) and ma is first.engine.master_of(a)  # shared, not retaken
        assert ma.dtype == (torch.float32 if level == "O2" else a.dtype)  # (O3: no masters)
    other = "O3" if level == "O2" else "O2"
    with pytest.raises(IntegrationError, match=rf"converted to {level} .*same opt level"):
        _fit(MixprecPrecision(other, dtype, device="cpu"), module)


def test_a_second_fit_drops_the_first_fits_optimizers():
    """Every fit builds its optimizers anew (configure_optimizers); the engine kept the earlier
    fit's AmpOptimizers too (2 after the second fit, 3 after the third), flagging them at every
    backward and keeping their state (masters' momentum) alive."""
    plugin = MixprecPrecision("O2", "fp16", device="cpu", scaler=SCALER)
    module = Module()
    trainer = _fit(plugin, module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.test(module, _loader(), verbose=False)  # the same optimizers: kept
        assert plugin.engine.optimizers == trainer.optimizers
        trainer.fit_loop.epoch_loop.max_steps = 6
        trainer.fit(module, _loader(48))
    assert len(plugin.engine.optimizers) == 1
    assert plugin.engine.optimizers == trainer.optimizers
