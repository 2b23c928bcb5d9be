"""`mixprec.AmpMetrics`: loss-scale telemetry read off the device in batches, its names, the
watch's diagnosis of skipped steps, TensorBoard event files read back, ``mixprec train
--tensorboard``."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.diagnostics.metrics import NAMES
from tests.helpers import no_host_reads

INF = float("inf")
BAD = {2, 3, 9}


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    return model, opt, scaler


def _step(model, opt, scaler, i, metrics=None):
    x, y = torch.randn(4, 6), torch.randn(4, 2)
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    if i in BAD:
        loss = loss * INF
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if metrics is not None:
        metrics.record_loss(loss)
    return loss


def test_no_host_read_between_flushes_and_rows_match_the_scale_history():
    model, opt, scaler = _setup()
    metrics = mixprec.AmpMetrics(scaler, every=4)
    batches = []
    for i in range(12):
        # Step 0 creates the optimizer's state, a host decision by design (docs/scaling.md);
        # after that the step and the bookkeeping never read the device ...
        with no_host_reads() if i else contextlib.nullcontext():
            _step(model, opt, scaler, i, metrics)
            if (i + 1) % 4:
                assert metrics.step() is None
        if (i + 1) % 4 == 0:
            batches.append(metrics.step())  # ... only every 4th call does, once
    rows = [row for batch in batches for row in batch.rows]
    history = mixprec.scale_history(scaler).rows
    assert [step for step, _ in rows] == list(range(1, 13))
    assert [r["loss-scale"] for _, r in rows] == [h["scale"] for h in history]
    skipped = [h["update"] + 1 for h in history if h["skipped"]]
    assert skipped == [b + 1 for b in sorted(BAD)]
    cumulative = [sum(s <= step for s in skipped) for step in range(1, 13)]
    assert [r["skipped-iterations"] for _, r in rows] == cumulative
    # Each batch's last row carries the count of inf/NaN losses so far (Megatron's nan iterations).
    assert [b.rows[-1][1]["nan-iterations"] for b in batches] == [0.0 + 2, 2.0, 3.0]
    assert batches[-1].totals == {"loss-scale": scaler.get_scale(), "skipped-iterations": 3.0,
                                  "nan-iterations": 3.0}  # fmt: skip
    assert [step for step, _ in batches[0].events] == [3, 4]


@pytest.mark.parametrize("scaled", [True, False])
def test_a_flush_with_nothing_new_adds_no_row(scaled):
    """A flush at the end of training, right after a batch (Lightning's on_train_end), logged
    a partial duplicate row for the last step; without a scaler (bf16) too."""
    model, opt, scaler = _setup()
    metrics = mixprec.AmpMetrics(scaler if scaled else None, every=2)
    for i in range(4):
        if scaled:
            _step(model, opt, scaler, i, metrics)
        else:
            metrics.record_loss(torch.tensor(1.0))
        metrics.step()
    assert metrics.flush().rows == []
    metrics.record_loss(torch.tensor(INF))  # a new count, no new step: still no row
    # (steps 2 and 3 of _step overflow their loss; the plain counts had none)
    assert metrics.flush().rows == []
    assert metrics.totals["nan-iterations"] == (3.0 if scaled else 1.0)


def test_names_follow_megatron_and_deepspeed():
    # Megatron-LM's TensorBoard tag and console counters; DeepSpeed's monitor tag and counter.
    assert NAMES["megatron"].loss_scale == "loss-scale"
    assert NAMES["megatron"].skipped == "skipped-iterations"  # "number of skipped iterations"
    assert NAMES["megatron"].nan == "nan-iterations"  # "number of nan iterations"
    assert NAMES["deepspeed"].loss_scale == "Train/Samples/loss_scale"
    assert NAMES["deepspeed"].skipped == "Train/Samples/skipped_steps"  # engine.skipped_steps
    model, opt, scaler = _setup()
    metrics = mixprec.AmpMetrics(scaler, every=2, names="deepspeed")
    for i in range(2):
        _step(model, opt, scaler, i)
        batch = metrics.step()
    _, row = batch.rows[-1]
    assert set(row) == {"Train/Samples/loss_scale", "Train/Samples/skipped_steps"}


def test_watch_names_the_module_of_a_skipped_step():
    model, opt, scaler = _setup()
    with mixprec.watch_nonfinite(model, attach=scaler) as watch:
        metrics = mixprec.AmpMetrics(scaler, every=5, watch=watch)
        for i in range(5):
            x, y = torch.randn(4, 6), torch.randn(4, 2)
            if i == 2:
                x[0, 0] = INF  # a forward overflow in module '0'
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            batch = metrics.step()
    assert [step for step, _ in batch.events] == [3]
    assert "forward output of module '0'" in batch.events[0][1]


def test_errors_name_the_fix():
    with pytest.raises(mixprec.MixprecError, match=r"1\.\.1024"):
        mixprec.AmpMetrics(None, every=5000)
    with pytest.raises(mixprec.MixprecError, match="Valid: 'deepspeed' or 'megatron'"):
        mixprec.AmpMetrics(None, names="wandb")
    with pytest.raises(mixprec.MixprecError, match="torch.amp.GradScaler keeps no history"):
        mixprec.AmpMetrics(torch.amp.GradScaler("cpu"))
    assert mixprec.AmpMetrics(None).flush().rows == []  # bf16: nothing to read, no error


def _read_events(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return acc


def test_tensorboard_event_file_has_every_step(tmp_path):
    pytest.importorskip("tensorboard")
    from mixprec.integrations.tensorboard import TensorBoardSink

    model, opt, scaler = _setup()
    sink = TensorBoardSink(tmp_path / "tb")
    metrics = mixprec.AmpMetrics(scaler, every=5, sinks=[sink])
    for i in range(12):
        _step(model, opt, scaler, i, metrics)
        metrics.step()
    metrics.flush()
    sink.close()
    acc = _read_events(tmp_path / "tb")
    history = mixprec.scale_history(scaler).rows
    scale = acc.Scalars("loss-scale")
    assert [e.step for e in scale] == list(range(1, 13))
    assert [e.value for e in scale] == [h["scale"] for h in history]
    assert [e.value for e in acc.Scalars("skipped-iterations")][-1] == len(BAD)
    assert acc.Scalars("nan-iterations")[-1].value == len(BAD)
    texts = acc.Tensors("nonfinite-source/text_summary")
    assert [t.step for t in texts] == [b + 1 for b in sorted(BAD)]


def test_train_writes_tensorboard(tmp_path):
    """``mixprec train --tensorboard DIR``'s trainer, on 24 tiny images (fp16 convolutions are
    slow on a CPU; the command line itself is checked below)."""
    pytest.importorskip("tensorboard")
    from mixprec.bench import train
    from mixprec.bench.data import Dataset

    g = torch.Generator().manual_seed(0)
    data = Dataset(
        "tiny",
        torch.randn(24, 1, 8, 8, generator=g),
        torch.randint(0, 3, (24,), generator=g),
        torch.randn(4, 1, 8, 8, generator=g),
        torch.randint(0, 3, (4,), generator=g),
        3,
    )
    train.train(data, model="cnn", modes=["O1", "fp32"], epochs=2, batch_size=8, device="cpu",
                dtype=torch.float16, seeds=[0], tensorboard=str(tmp_path / "tb"))  # fmt: skip
    acc = _read_events(tmp_path / "tb" / "O1-seed0")
    assert [e.step for e in acc.Scalars("loss-scale")] == list(range(1, 7))  # every step
    assert acc.Scalars("loss-scale")[0].value == 2.0**16
    assert [e.step for e in acc.Scalars("test/accuracy")] == [3, 6]  # per epoch
    fp32 = _read_events(tmp_path / "tb" / "fp32-seed0")
    assert "loss-scale" not in fp32.Tags()["scalars"] and "train/loss" in fp32.Tags()["scalars"]


def test_train_cli_checks_the_tensorboard_dir(tmp_path, capsys):
    from mixprec.cli import main

    (tmp_path / "file").write_text("x")
    code = main(["train", "--epochs", "1", "--out", str(tmp_path / "run"), "--tensorboard",
                 str(tmp_path / "file" / "tb")])  # fmt: skip
    assert code == 2
    assert (
        "--tensorboard" in capsys.readouterr().err
        and not (tmp_path / "run" / "train.json").exists()
    )


def test_integrations_name_the_extra_to_install():
    from mixprec.integrations import require

    # mixprec is installed from its checkout: the extra, as pip install -e takes it there
    with pytest.raises(ImportError, match=r"pip install -e '\.\[lightning\]' in the mixprec ch"):
        require("lightning_that_is_not_installed", "lightning", "mixprec.integrations.lightning")
