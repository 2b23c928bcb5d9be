"""mixprec in an Accelerate loop (`AmpAccelerator`) and in ``transformers.Trainer.train``
(`AmpTrainer`), against hand-written loops and the libraries' own bf16, with injected overflows.

Accelerate runs no autocast for fp16 on a CPU (its fp16 needs a GPU), so the fp16 reference is
what its fp16 does on a GPU, written by hand: torch.autocast around the forward, outputs cast
to fp32, torch.amp.GradScaler. mixprec reproduces torch.autocast op for op, so the numbers are
the same bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from mixprec.integrations.accelerate import AmpAccelerator  # noqa: E402
from mixprec.integrations.engine import AmpConfig, IntegrationError  # noqa: E402
from mixprec.integrations.transformers import AmpMetricsCallback, AmpTrainer  # noqa: E402
from tests.helpers import INF, SCALER, STEPS, Tokens, X, Y, reset_accelerate, tiny_net  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_accelerate"),
]


def _parts():
    model = tiny_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
    return model, opt, sched, loader


def _lr(opt) -> float:
    return float(opt.param_groups[0]["lr"])


def _accelerate_run(acc, bad=(), clip=0.5, metrics=None):
    model, opt, sched, loader = acc.prepare(*_parts())
    losses, lrs, skipped = [], [], []
    for i, (x, y) in enumerate(loader):
        lrs.append(_lr(opt))
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        loss = loss * INF if i in bad else loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
        if metrics is not None:
            metrics.record_loss(loss)
            metrics.step()
    return losses, lrs, skipped, acc.unwrap_model(model)


def _hand(level, dtype, bad=(), clip=0.5):
    model, opt, sched, loader = _parts()
    model, amp = mixprec.initialize(model, opt, level, dtype=dtype)
    if amp.scaler is not None:
        amp.scaler._init_scale = SCALER["init_scale"]
    sched = mixprec.SkipAwareLR(sched, amp.scaler, optimizer=amp)
    losses = []
    for i, (x, y) in enumerate(loader):
        amp.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        losses.append(loss.item())
        with mixprec.scale_loss(loss * INF if i in bad else loss, amp) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(mixprec.master_params(amp), clip)
        amp.step()
        sched.step()
    return losses, model


def test_accelerate_bf16_o2_clips_the_gradients_a_backward_left_on_the_model():
    # bf16 O2 leaves a backward's gradients on the model until clipping or the step needs
    # them in the fp32 masters: Accelerate's clip_grad_norm_(model.parameters()) clips the
    # masters' (a tight clip, so a missed one would change every step).
    losses, _, _, model = _accelerate_run(AmpAccelerator(accelerate.Accelerator(cpu=True), "O2",
                                                         "bf16"), clip=1e-3)  # fmt: skip
    ref_losses, ref = _hand("O2", "bf16", clip=1e-3)
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    unclipped, _ = _hand("O2", "bf16", clip=1e9)
    assert unclipped[1:] != ref_losses[1:]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clipping_on_a_micro_batch_before_the_last_is_refused(level):
    """Inside accelerator.accumulate, clipping on every micro-batch unscaled the first one's
    gradients, and the next backward added scaled ones to them (a grad norm of 29,277 against
    0.58): torch's GradScaler raises there, and so does mixprec, naming sync_gradients."""
    acc = AmpAccelerator(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2), level,
                         "fp16")  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with acc.accumulate(model):
        acc.backward(F.cross_entropy(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
    with acc.accumulate(model), pytest.raises(IntegrationError, match="sync_gradients"):
        acc.backward(F.cross_entropy(model(x), y))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accelerate_loop_equals_the_hand_written_loop(level):
    acc = AmpAccelerator(accelerate.Accelerator(cpu=True), level, "fp16", scaler=SCALER)
    metrics = mixprec.AmpMetrics(acc, every=STEPS)
    losses, lrs, skipped, model = _accelerate_run(acc, bad={3}, metrics=metrics)
    ref_losses, ref = _hand(level, "fp16", bad={3})
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    # The overflow: skipped, reported, and the schedule (wrapped in SkipAwareLR) held still.
    assert skipped == [False, False, False, True, False, False]
    assert lrs == [0.1, 0.05, 0.025, 0.0125, 0.0125, 0.00625]
    assert metrics.totals == {"loss-scale": 512.0, "skipped-iterations": 1.0,
                              "nan-iterations": 1.0}  # fmt: skip


def test_accelerate_fp16_equals_torch_amp_as_accelerate_runs_it_on_a_gpu():
    acc = AmpAccelerator(accelerate.Accelerator(cpu=True), "O1", "fp16", scaler=SCALER)
    losses, _, _, model = _accelerate_run(acc)
    ref, opt, sched, loader = _parts()
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    ref_losses = []
    for x, y in loader:
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x)
        loss = F.mse_loss(out.float(), y)  # Accelerate's convert_outputs_to_fp32
        ref_losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_accelerate_bf16_equals_accelerates_own_bf16():
    ours = _accelerate_run(AmpAccelerator(accelerate.Accelerator(cpu=True), "O1", "bf16"))
    reset_accelerate()
    stock = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    theirs = _accelerate_run(stock)
    assert ours[0] == theirs[0]
    for a, b in zip(ours[3].parameters(), theirs[3].parameters(), strict=True):
        assert torch.equal(a, b)


def test_accelerate_refuses_its_own_mixed_precision():
    with pytest.raises(IntegrationError, match="mixed_precision='no'"):
        AmpAccelerator(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))


def test_accelerate_precision_set_earlier_in_the_process_is_explained(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    accelerate.Accelerator(cpu=True, mixed_precision="bf16")  # an earlier one, same process
    later = accelerate.Accelerator(cpu=True)  # given nothing
    assert later.mixed_precision == "bf16"  # Accelerate's one state per process: inherited
    with pytest.raises(IntegrationError) as given:
        AmpAccelerator(later)
    message = str(given.value)
    assert "runs mixed_precision='bf16'" in message and "was created with" not in message
    assert "or an earlier Accelerator in this process was" in message
    assert "one state per process" in message and "first Accelerator of a fresh process" in message
    with pytest.raises(IntegrationError, match="created here without mixed_precision inherited"):
        AmpAccelerator()  # the Accelerator it creates itself was given nothing for sure
    reset_accelerate()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # as accelerate launch sets it
    with pytest.raises(IntegrationError, match="ACCELERATE_MIXED_PRECISION='fp16' is set"):
        AmpAccelerator(accelerate.Accelerator(cpu=True))


def _gpt2():
    torch.manual_seed(3)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
        lr_scheduler_type="linear", logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", max_grad_norm=1.0, disable_tqdm=True, **kw,
    )  # fmt: skip


class _LRs(transformers.TrainerCallback):
    def __init__(self):
        self.lrs = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.lrs.append(_lr(kwargs["optimizer"]))


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_bf16_equals_the_trainers_own_bf16(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.Trainer(model=_gpt2(), args=_args(tmp_path / "a", bf16=True),
                                      train_dataset=Tokens(24))  # fmt: skip
        theirs.train()
        reset_accelerate()
        ours = AmpTrainer(model=_gpt2(), args=_args(tmp_path / "b"), train_dataset=Tokens(24),
                          amp=AmpConfig("O1", "bf16"))  # fmt: skip
        ours.train()
    assert _losses(ours) == _losses(theirs)
    for a, b in zip(ours.model.parameters(), theirs.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_trainer_o2_saves_a_model_that_loads_back_in_fp32(tmp_path):
    """O2 saves the fp32 masters, and config.json said float16 (the live weights' dtype), so
    from_pretrained loaded them as fp16. It says float32 now, as the plain Trainer's does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = AmpTrainer(model=_gpt2(), args=_args(tmp_path / "run"),
                             train_dataset=Tokens(24), amp=AmpConfig("O2", "fp16"))  # fmt: skip
        trainer.train()
        trainer.save_model(str(tmp_path / "final"))
        loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    assert next(trainer.model.parameters()).dtype == torch.float16  # trained at O2
    masters = trainer.model.state_dict()
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.float32, name
        assert torch.equal(value, masters[name]), name


class _Overflow(AmpTrainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * INF if self.state.global_step == 2 else loss


def test_trainer_skips_an_overflow_holds_the_schedule_and_logs_it(tmp_path):
    pytest.importorskip("tensorboard")
    lrs = _LRs()
    callback = AmpMetricsCallback(every=4, tensorboard_dir=str(tmp_path / "tb"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _Overflow(model=_gpt2(), args=_args(tmp_path / "c"), train_dataset=Tokens(24),
                            amp=AmpConfig("O2", "fp16", scaler=SCALER), callbacks=[lrs],
                            amp_callback=callback)  # fmt: skip
        trainer.train()
    assert lrs.lrs[2] == lrs.lrs[3] > lrs.lrs[4]  # the schedule did not advance at step 3
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["loss-scale"] for h in logs] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]
    assert [h["skipped-iterations"] for h in logs] == [0, 0, 1, 1, 1, 1]
    assert logs[-1]["nan-iterations"] == 1  # its loss was inf
    assert callback.events[0][0] == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss-scale")] == [1024.0] * 3 + [512.0] * 3
    assert isinstance(trainer.optimizer.optimizer, mixprec.AmpOptimizer)
    assert trainer.optimizer.optimizer.optimizer.param_groups[0]["params"][0].dtype == torch.float32


def test_trainer_refuses_its_own_fp16_flag(tmp_path):
    with pytest.raises(IntegrationError, match="leave bf16=False"):
        AmpTrainer(model=_gpt2(), args=_args(tmp_path, bf16=True), train_dataset=Tokens(24))
