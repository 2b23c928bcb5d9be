"""Gradient accumulation under DDP's ``no_sync()`` through the integrations, on every rank of a
`RankPool` (tests/test_integrations_no_sync.py).

Each rank trains `STEPS` optimizer steps of `MB` micro-batches of `ROWS` rows, its own rows
(rank r, micro-batch m of step s: rows ``(r * MB + m) * ROWS`` onwards of step s's global
batch), every micro-batch but the last under ``no_sync()``, entered by the framework:
``accelerator.accumulate`` (Accelerate), ``accumulate_grad_batches`` (Lightning's Trainer on its
DDP strategy), ``fabric.no_backward_sync`` (Fabric). With fp16, the last rank's first
micro-batch of step `INF_STEP` holds an inf: every rank must skip that step.

The references: `by_hand` is ``mixprec.initialize`` then DDP with the same ``no_sync()``
accumulation, on the same ranks (docs/distributed.md); `one_process` is fp32 on one process
over each step's whole global batch, which the ranks' runs equal up to rounding (the mean of
the ranks' means of equal-sized micro-batch means is the global batch's mean).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from tests.dist_scenarios import launched, same

__all__ = ["same"]  # (for the tests)

STEPS = 3
MB = 3  # micro-batches per optimizer step: two under no_sync(), then the synchronised one
ROWS = 4
INF_STEP = 1
LR = 0.05


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 4))


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = world * MB * ROWS
    # Targets exact in bf16 and fp16: these runs compare accumulation only (that Lightning's
    # DDP strategy hands training_step its batch uncast is tests/test_lightning_redirect.py's).
    return torch.randn(n, 8, generator=g), torch.randint(-8, 9, (n, 4), generator=g) / 8


def micro_batch(step: int, rank: int, world: int, m: int, inject: bool) -> tuple[Any, Any]:
    x, y = global_batch(step, world)
    i = (rank * MB + m) * ROWS
    x, y = x[i : i + ROWS].clone(), y[i : i + ROWS]
    if inject and step == INF_STEP and rank == world - 1 and m == 0:
        x[0, 0] = float("inf")
    return x, y


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _masters(opt: Any) -> list[torch.Tensor]:
    return [m.detach().clone() for m in mixprec.master_params(opt)]


def one_process(world: int, skip: int | None = None) -> list[torch.Tensor]:
    """fp32 on one process, each step over the whole global batch; step `skip` skipped (the
    fp16 runs' injected inf)."""
    model = net()
    opt = _opt(model.parameters())
    for step in range(STEPS):
        if step == skip:
            continue
        opt.zero_grad()
        loss_of(model, *global_batch(step, world)).backward()
        opt.step()
    return params_of(model)


# ----------------------------------------------------------------------------- by hand


def by_hand(rank: int, world: int, level: str, dtype: str, inject: bool = True) -> dict[str, Any]:
    """``mixprec.initialize``, then DDP, with ``no_sync()`` accumulation written out (one
    process: no DDP, the micro-batches add up in the fp32 masters)."""
    model = net()
    model, opt = mixprec.initialize(model, _opt(model.parameters()), level, dtype=dtype)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else None
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(MB):
            x, y = micro_batch(step, rank, world, m, inject and dtype == "fp16")
            unsynced = ddp is not None and m < MB - 1
            region = ddp.no_sync() if unsynced else contextlib.nullcontext()  # type: ignore[union-attr]
            with region, mixprec.scale_loss(loss_of(ddp or model, x, y) / MB, opt) as scaled:
                scaled.backward()
        opt.step()
    return {"params": params_of(model), "masters": _masters(opt)}


# ----------------------------------------------------------------------------- Accelerate


def accelerate_run(rank: int, world: int, level: str, dtype: str) -> dict[str, Any]:
    """`AmpAccelerator` on Accelerate's MULTI_CPU (DDP), ``accelerator.accumulate(model)``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from mixprec.integrations.accelerate import AmpAccelerator

    with launched(rank, world):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        try:
            accelerator = AmpAccelerator(Accelerator(cpu=True, gradient_accumulation_steps=MB),
                                         level, dtype=dtype)  # fmt: skip
            kind = str(accelerator.distributed_type)
            model = net()
            model, opt = accelerator.prepare(model, _opt(model.parameters()))
            wrapped = type(model).__name__
            skipped = []
            for step in range(STEPS):
                for m in range(MB):
                    with accelerator.accumulate(model):
                        loss = loss_of(model, *micro_batch(step, rank, world, m, dtype == "fp16"))
                        accelerator.backward(loss)
                        opt.step()
                        opt.zero_grad()
                skipped.append(accelerator.optimizer_step_was_skipped)
            amp = accelerator.engine.optimizers[0]
            inner = accelerator.unwrap_model(model)
            return {"params": params_of(inner), "masters": _masters(amp), "skipped": skipped,
                    "kind": kind, "wrapped": wrapped}  # fmt: skip
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()


# ----------------------------------------------------------------------------- Lightning


def _rank_loader(rank: int, world: int) -> torch.utils.data.DataLoader:
    """This rank's micro-batches in training order (Lightning's sampler is turned off)."""
    pairs = [micro_batch(s, rank, world, m, False) for s in range(STEPS) for m in range(MB)]
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(data, batch_size=ROWS)


def _module(level: str, dtype: str) -> Any:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            if dtype == "fp16" and i == INF_STEP * MB and self.global_rank == 1:
                x = x.clone()
                x[0, 0] = float("inf")
            self.calls += 1
            return loss_of(self, x, y)  # Lightning divides by accumulate_grad_batches

        def configure_optimizers(self) -> Any:
            return _opt(self.parameters())

    return Module()


def lightning_run(rank: int, world: int, level: str, dtype: str) -> dict[str, Any]:
    """``Trainer.fit`` on strategy 'ddp' with ``accumulate_grad_batches=MB``."""
    import lightning as L

    from mixprec.integrations.lightning import MixprecPrecision

    with launched(rank, world):
        module = _module(level, dtype)
        plugin = MixprecPrecision(level, dtype, device="cpu")
        trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=world, strategy="ddp",
                            accumulate_grad_batches=MB, plugins=[plugin],
                            use_distributed_sampler=False, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
        trainer.fit(module, _rank_loader(rank, world))
    skipped = plugin.scaler.stats()["losses"][0]["skipped"] if plugin.scaler is not None else 0
    return {"params": params_of(module.net), "masters": _masters(trainer.optimizers[0]),
            "skipped": skipped, "calls": module.calls, "steps": trainer.global_step,
            "strategy": type(trainer.strategy).__name__}  # fmt: skip


def fabric_run(rank: int, world: int, level: str, dtype: str) -> dict[str, Any]:
    """Fabric on strategy 'ddp', ``fabric.no_backward_sync`` for all but the last micro-batch."""
    import lightning as L

    from mixprec.integrations.lightning import MixprecFabricPrecision

    with launched(rank, world):
        precision = MixprecFabricPrecision(level, dtype, device="cpu")
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy="ddp", plugins=[precision])
        fabric.launch()
        model = net()
        model, opt = fabric.setup(*precision.initialize(model, _opt(model.parameters())))
        skipped = []
        for step in range(STEPS):
            for m in range(MB):
                x, y = micro_batch(step, rank, world, m, dtype == "fp16")
                with fabric.no_backward_sync(model, enabled=m < MB - 1):
                    fabric.backward(loss_of(model, x, y) / MB)
            opt.step()
            opt.zero_grad()
            skipped.append(bool(precision.engine.last_step_skipped))
    inner = model.module if hasattr(model, "module") else model
    amp = precision.engine.optimizers[0]
    return {"params": params_of(inner), "masters": _masters(amp), "skipped": skipped}


# ----------------------------------------------------------------------------- Transformers


class Regression(nn.Module):
    """`net` as a Transformers model: the loss from the labels, in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.net(x).float(), labels)}


def trainer_fit(rank: int, world: int, level: str, dtype: str, out: str) -> dict[str, Any]:
    """``AmpTrainer.train``, `MB` micro-batches per step (``gradient_accumulation_steps``): on
    Accelerate's MULTI_CPU (DDP) its accumulation enters ``no_sync()`` through the Accelerator.
    The Trainer clears the model's gradients (``model.zero_grad()``), never the optimizer's."""
    import transformers
    from accelerate.state import AcceleratorState, GradientState

    from mixprec.integrations.engine import AmpConfig
    from mixprec.integrations.transformers import AmpTrainer

    # The rows in the order the Trainer's sequential sampler reads them; Accelerate deals
    # batch k to rank k % world, so rank r gets its micro-batches in order.
    rows = [micro_batch(s, r, world, m, False) for s in range(STEPS) for m in range(MB)
            for r in range(world)]  # fmt: skip
    data = [{"x": x[i], "labels": y[i]} for x, y in rows for i in range(ROWS)]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        args = transformers.TrainingArguments(
            out, per_device_train_batch_size=ROWS, gradient_accumulation_steps=MB,
            max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", report_to=[],
            use_cpu=True, save_strategy="no", max_grad_norm=0.0, disable_tqdm=True,
            train_sampling_strategy="sequential",
        )  # fmt: skip
        model = Regression()
        trainer = AmpTrainer(model=model, args=args, train_dataset=data,
                             optimizers=(_opt(model.parameters()), None),
                             amp=AmpConfig(level, dtype))  # fmt: skip
        trainer.train()
        amp = trainer.accelerator.engine.optimizers[0]
        return {"params": params_of(model.net), "masters": _masters(amp),
                "kind": str(trainer.accelerator.distributed_type),
                "steps": trainer.state.global_step}  # fmt: skip
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def trainer_run(rank: int, world: int, level: str, dtype: str, out: str) -> dict[str, Any]:
    """`trainer_fit` on rank `rank` of the pool (Accelerate's MULTI_CPU)."""
    with launched(rank, world):
        return trainer_fit(rank, world, level, dtype, out)
