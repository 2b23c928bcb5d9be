"""``mixprec train``: train an image classifier in fp32 and in AMP modes, side by side.

Each mode trains the same model from the same seed on the same batches; the test set is
evaluated after every epoch. Results: per mode and seed, the curves (train loss, test loss, test
accuracy against steps and against wall time), and a summary that puts the final accuracies next
to the seed-to-seed spread of fp32, which is what "AMP matches FP32 within noise" is measured
against.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._optional import require_matplotlib
from mixprec.bench.data import Dataset
from mixprec.bench.models import ResNet50, SmallCNN
from mixprec.bench.variants import tf32
from mixprec.dtypes import dtype_name

__all__ = ["MODELS", "MODES", "figure", "plot", "summarize", "train"]

MODES = ("fp32", "torch.amp", "O1", "O2", "O3", "O4")
MODELS = ("cnn", "resnet50")


def _model(name: str, data: Dataset) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    if name == "cnn":

        def adamw(m: nn.Module) -> Any:
            return torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=1e-4)

        return SmallCNN(data.num_classes, data.in_channels), adamw

    def sgd(m: nn.Module) -> Any:
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    return ResNet50(data.num_classes, in_channels=data.in_channels), sgd


@torch.no_grad()
def _evaluate(model: nn.Module, data: Dataset, device: str, batch: int,
              region: Callable[[], Any]) -> tuple[float, float]:  # fmt: skip
    model.eval()
    total, correct, loss_sum = 0, 0, 0.0
    for i in range(0, len(data.test_x), batch):
        x = data.test_x[i : i + batch].to(device)
        y = data.test_y[i : i + batch].to(device)
        with region():
            logits = model(x).float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        total += len(y)
    model.train()
    return loss_sum / total, correct / total


def _run(
    mode: str,
    seed: int,
    data: Dataset,
    model_name: str,
    epochs: int,
    batch: int,
    device: str,
    dtype: torch.dtype,
    tick: Callable[[str, int], None],
    dist: Any = None,
    tensorboard: str | None = None,
) -> list[dict[str, Any]]:
    torch.manual_seed(seed)
    model, make_opt = _model(model_name, data)
    model = model.to(device)
    opt = make_opt(model)
    null = _nullregion
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)

    def wrap(m: nn.Module) -> nn.Module:
        if world == 1:
            return m
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(m, **dist.ddp_kwargs())

    plain = model  # evaluated without the DDP wrapper (no collectives in eval)
    if mode in ("fp32", "torch.amp"):
        model = wrap(model)
    if mode == "fp32":

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with tf32(False):  # true fp32: torch's default runs cuDNN convolutions in TF32
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            return loss

        def region():
            return tf32(False)
    elif mode == "torch.amp":
        scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        def region():
            return torch.autocast(device, dtype=dtype)
    else:
        model, amp = mixprec.initialize(model, opt, mode, dtype=dtype)
        plain = model
        model = wrap(model)  # after initialize: DDP builds its buckets for the cast weights

        def step(x, y):
            amp.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).float(), y)
            with mixprec.scale_loss(loss, amp) as scaled:
                scaled.backward()
            amp.step()
            return loss

        region = null  # the model's own hooks apply the level in eval too
    source = None if mode in ("fp32", "torch.amp") or amp.scaler is None else amp
    stepped = opt if mode in ("fp32", "torch.amp") else amp  # what memory_report reads
    # One writer, on rank 0 (reading the scaler there needs no collective).
    writer, metrics = _telemetry(tensorboard if rank == 0 else None, f"{mode}-seed{seed}", source)
    g = torch.Generator().manual_seed(seed)
    curve: list[dict[str, Any]] = []
    steps, clock = 0, 0.0
    for epoch in range(1, epochs + 1):
        what = f"{mode} ({dtype_name(dtype) if mode != 'fp32' else 'fp32'}), seed {seed}"
        tick(f"{what}: epoch {epoch}/{epochs}", 0)
        order = torch.randperm(len(data.train_x), generator=g)
        losses = []
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        share = batch // world  # this rank's slice of the global batch
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i + rank * share : i + (rank + 1) * share]
            loss = step(data.train_x[idx].to(device), data.train_y[idx].to(device))
            losses.append(loss.detach())
            steps += 1
            if metrics is not None:
                metrics.record_loss(loss)  # a device op
                metrics.step()  # reads the device every 50 steps
        sync()
        clock += time.perf_counter() - t0
        test_loss, test_acc = _evaluate(plain, data, device, 256, region)
        curve.append({
            "mode": mode, "seed": seed, "epoch": epoch, "step": steps, "time_s": clock,
            "world_size": world,
            "train_loss": _global_mean(torch.stack(losses).float().mean(), world),
            "test_loss": test_loss,
            "test_accuracy": test_acc,
        })  # fmt: skip
        if writer is not None:
            if metrics is not None:
                metrics.flush()
            for key in ("train_loss", "test_loss", "test_accuracy"):
                writer.writer.add_scalar(key.replace("_", "/", 1), curve[-1][key], steps)
            writer.writer.flush()
        tick(f"{what}: epoch {epoch}/{epochs}, test accuracy {100 * test_acc:.1f}%", 1)
    if writer is not None:
        writer.close()
    # Training state held after the last step's backward (its gradients are still there),
    # exactly, by component (mixprec.memory_report): on the last record.
    state = mixprec.memory_report(plain, stepped)
    curve[-1]["state_bytes_per_param"] = state.per_param()
    curve[-1]["state_bytes"] = dict(state.bytes)
    return curve


def _telemetry(root: str | None, name: str, amp: Any) -> tuple[Any, Any]:
    """A TensorBoard writer under `root`/`name` and, for a scaled level, AmpMetrics feeding it."""
    if root is None:
        return None, None
    import os

    from mixprec.integrations.tensorboard import TensorBoardSink

    sink = TensorBoardSink(os.path.join(root, name))
    if amp is None:
        return sink, None
    return sink, mixprec.AmpMetrics(amp, every=50, sinks=[sink])


def _global_mean(value: torch.Tensor, world: int) -> float:
    """The mean over ranks of a per-rank value (each rank saw its share of every batch)."""
    if world > 1:
        value = value.clone()
        torch.distributed.all_reduce(value)  # once per epoch; every rank calls it
        value /= world
    return float(value)


def _nullregion() -> Any:
    import contextlib

    return contextlib.nullcontext()


def train(
    data: Dataset,
    *,
    model: str,
    modes: Sequence[str],
    epochs: int,
    batch_size: int,
    device: str,
    dtype: torch.dtype,
    seeds: Sequence[int],
    tick: Callable[[str, int], None] = lambda label, done: None,
    dist: Any = None,
    tensorboard: str | None = None,
) -> list[dict[str, Any]]:
    """Train every (mode, seed); return the per-epoch records of all runs.

    `tick(label, done)` is told what trains now (mode, dtype, seed, epoch) when an epoch starts
    (``done=0``) and when it ends (``done=1``).

    `dist` (a `mixprec.distributed.launch.DistContext`): train data-parallel under DDP, each
    rank on its contiguous share of every global batch of `batch_size` (the opt levels are
    initialized before wrapping). Every rank evaluates the same weights on the whole test set.
    With `tensorboard`, each run also writes TensorBoard scalars to ``tensorboard/<mode>-seed<k>``
    (on rank 0).
    """
    records: list[dict[str, Any]] = []
    for seed in seeds:
        for mode in modes:
            records += _run(mode, seed, data, model, epochs, batch_size, device, dtype, tick,
                            dist, tensorboard)  # fmt: skip
    return records


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: final accuracy over seeds (mean, std, min, max), time, the verdict vs fp32, and
    the training state's bytes per parameter (`mixprec.memory_report`)."""
    modes = list(dict.fromkeys(r["mode"] for r in records))
    last: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    final_epoch = max(r["epoch"] for r in records)
    for r in records:
        if r["epoch"] == final_epoch:
            last[r["mode"]].append(r)
    rows = []
    for m in modes:
        accs = [r["test_accuracy"] for r in last[m]]
        rows.append({
            "mode": m, "seeds": len(accs), "accuracy_mean": statistics.fmean(accs),
            "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "accuracy_min": min(accs), "accuracy_max": max(accs),
            "train_time_s": statistics.fmean(r["time_s"] for r in last[m]),
            "state_bytes_per_param": last[m][0].get("state_bytes_per_param"),
        })  # fmt: skip
    base = next((r for r in rows if r["mode"] == "fp32"), None)
    for r in rows:
        if base is None:
            r["speedup_vs_fp32"] = r["within_noise_of_fp32"] = None
            continue
        r["speedup_vs_fp32"] = base["train_time_s"] / r["train_time_s"]
        # "Within noise": inside the band fp32's own seeds span, widened by two of its stds.
        spread = max(base["accuracy_max"] - base["accuracy_min"], 2 * base["accuracy_std"], 0.005)
        r["within_noise_of_fp32"] = abs(r["accuracy_mean"] - base["accuracy_mean"]) <= spread
    return rows


def figure(records: Sequence[dict[str, Any]], title: str) -> Any:
    """Loss and test accuracy (in percent, as the summary table prints it) against training
    steps and wall time, a line per mode (the band: min-max over seeds). A matplotlib Figure."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharey="row", layout="constrained")
    modes = list(dict.fromkeys(r["mode"] for r in records))
    for mode in modes:
        mine = [r for r in records if r["mode"] == mode]
        epochs = sorted({r["epoch"] for r in mine})

        def mean(key: str, e: int, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.fmean(r[key] for r in mine if r["epoch"] == e)

        steps = [mean("step", e) for e in epochs]
        times = [mean("time_s", e) for e in epochs]
        for row, key, unit in ((0, "train_loss", 1.0), (1, "test_accuracy", 100.0)):
            ys = [unit * mean(key, e) for e in epochs]
            lo = [unit * min(r[key] for r in mine if r["epoch"] == e) for e in epochs]
            hi = [unit * max(r[key] for r in mine if r["epoch"] == e) for e in epochs]
            for col, xs in ((0, steps), (1, times)):
                (line,) = axes[row][col].plot(xs, ys, marker="o", ms=3, label=mode)
                axes[row][col].fill_between(xs, lo, hi, alpha=0.15, color=line.get_color())
    axes[0][0].set_ylabel("train loss")
    axes[1][0].set_ylabel("test accuracy (%)")
    axes[1][0].set_xlabel("training steps")
    axes[1][1].set_xlabel("training wall time (s)")
    axes[0][0].legend()
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return fig


def plot(path: str, records: Sequence[dict[str, Any]], title: str) -> None:
    """Write `figure` as a PNG at `path`."""
    plt = require_matplotlib()
    fig = figure(records, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
