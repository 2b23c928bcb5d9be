"""Lightning under FSDP2, run on every rank of a `RankPool` (tests/test_lightning_fsdp.py).

Each rank runs a real ``lightning.Trainer.fit`` as one of the processes Lightning's own launcher
would have started: ``LOCAL_RANK`` in the environment makes Lightning's default cluster
environment treat the processes as created outside it, and the pool's gloo group is the one
Lightning's ``_init_dist_connection`` finds already initialized. Lightning's launcher for
``ModelParallelStrategy`` re-runs the command line in new processes,
which inside pytest would run the test session again; the pool starts its processes once.

The reference is the same training written by hand on the same ranks: ``mixprec.fully_shard``,
``mixprec.GradScaler`` and ``mixprec.SkipAwareLR``, reading the same rows in the same order
(Lightning's shuffling ``DistributedSampler``), with the same injected inf.

FSDP1 is not run: torch 2.13's ``FullyShardedDataParallel`` refuses a CPU ("FSDP needs a non-CPU
accelerator device"), and Lightning's ``FSDPStrategy`` refuses ``accelerator='cpu'``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from tests.dist_scenarios import environment

STEPS = 6  # optimizer steps of the full run
ROWS = 8  # rows of the data set: one batch of 4 per rank and epoch (see fsdp2_resume)
BATCH = 4
INF_STEP = 1  # the step whose loss is inf on the last rank only
CLIP = 0.5
SCALER = {"init_scale": 2.0**10}


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(ROWS, 8, generator=g),
                                          torch.randn(ROWS, 4, generator=g))  # fmt: skip


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def as_launched(rank: int) -> contextlib.AbstractContextManager[None]:
    """The environment Lightning's launcher gives the process of local rank `rank`."""
    return environment({"LOCAL_RANK": str(rank), "NODE_RANK": "0"}, restore=("WORLD_SIZE",))


def scales(level: str, dtype: str) -> bool:
    """Whether the run scales its loss: fp16, and bf16 O1/O2 told to (to test skips on a CPU);
    O3 bf16 has no masters to unscale into, so no scaler and no injected inf."""
    return dtype == "fp16" or level != "O3"


def _poisoned(loss: torch.Tensor, step: int, rank: int, world: int, scaled: bool) -> torch.Tensor:
    inject = scaled and step == INF_STEP and rank == world - 1
    return loss * float("inf") if inject else loss


def _optimizer(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def _module_class() -> type:
    import lightning as L

    class Module(L.LightningModule):
        """The user's module: its network sharded with FSDP2 in configure_model."""

        def __init__(self, level: str, dtype: str, shard: str = "mixprec") -> None:
            super().__init__()
            self.net = net()
            self.level, self.low, self.shard = level, dtype, shard
            self.losses: list[float] = []
            self.lrs: list[float] = []
            self.snapshots: list[list[torch.Tensor]] = []  # parameters after each step
            self.calls: list[int] = []  # counting_all_reduce's record, where one is open
            self.all_reduces: list[int] = []
            self.offset = 0  # steps run before a resume

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule

            if isinstance(self.net, FSDPModule):  # configure_model runs again in a resume
                return
            mesh = self.device_mesh["data_parallel"]
            if self.shard == "mixprec":
                mixprec.fully_shard(self.net, opt_level=self.level, dtype=self.low, mesh=mesh)
            else:  # torch's own fully_shard (for the refusal test)
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.net, mesh=mesh)

        def on_save_checkpoint(self, checkpoint: dict) -> None:
            checkpoint["steps_seen"] = self.offset + len(self.losses)

        def on_load_checkpoint(self, checkpoint: dict) -> None:
            self.offset = checkpoint["steps_seen"]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))
            x, y = batch
            loss = F.mse_loss(self(x).float(), y)
            step = self.offset + len(self.losses)
            self.losses.append(loss.detach().item())
            return _poisoned(loss, step, self.global_rank, self.trainer.world_size,
                             scales(self.level, self.low))  # fmt: skip

        def on_train_batch_start(self, *args: Any) -> None:
            self.counted = len(self.calls)

        def on_train_batch_end(self, *args: Any) -> None:
            # torch.distributed.all_reduce calls during the step (the scaler's agreement)
            self.all_reduces.append(len(self.calls) - self.counted)
            self.snapshots.append([full(p) for p in self.net.parameters()])  # every rank

        def configure_optimizers(self) -> Any:
            opt, sched = _optimizer(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module


def _trainer(strategy: Any, plugin: Any, steps: int, clip: float | None,
             algorithm: str = "norm") -> Any:  # fmt: skip
    import lightning as L

    return L.Trainer(max_steps=steps, accelerator="cpu", devices=2, strategy=strategy,
                     plugins=[plugin], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     gradient_clip_val=clip, gradient_clip_algorithm=algorithm)  # fmt: skip


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=BATCH)


def _rank_loader(rank: int, world: int, epoch: int) -> torch.utils.data.DataLoader:
    """This rank's batches of `epoch`, as Lightning's sampler gives them: a training loader gets
    a shuffling DistributedSampler (seed PL_GLOBAL_SEED, 0 here), its epoch set each epoch."""
    sampler = torch.utils.data.DistributedSampler(dataset(), world, rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return torch.utils.data.DataLoader(dataset(), batch_size=BATCH, sampler=sampler)


def _result(module: Any, trainer: Any) -> dict[str, Any]:
    scaler = trainer.precision_plugin.scaler
    opt = trainer.optimizers[0]
    return {
        "losses": module.losses,
        "lrs": module.lrs,
        "params": [full(p) for p in module.net.parameters()],
        "snapshots": module.snapshots,
        "all_reduces": module.all_reduces,
        "param_dtypes": sorted({str(p.dtype) for p in module.net.parameters()}),
        "scale": scaler.get_scale() if scaler is not None else None,
        "skipped": scaler.stats()["losses"][0]["skipped"] if scaler is not None else None,
        "optimizer": type(opt).__name__,
        "stepped_are_model_params": [id(p) for g in opt.param_groups for p in g["params"]]
        == [id(p) for p in module.parameters()],
    }


def _plugin(level: str, dtype: str) -> Any:
    from mixprec.integrations.lightning import MixprecPrecision

    options = {"loss_scale": "dynamic"} if dtype == "bf16" and scales(level, dtype) else None
    return MixprecPrecision(level, dtype, device="cpu", scaler=SCALER, options=options)


def _fsdp2_strategy(distributed_checkpoint: bool = True) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                 save_distributed_checkpoint=distributed_checkpoint)  # fmt: skip


# ----------------------------------------------------------------------------- FSDP2


def fsdp2_fit(rank: int, world: int, level: str, dtype: str, clip: float | None,
              shard: str = "mixprec") -> dict[str, Any]:  # fmt: skip
    """``Trainer.fit`` with ModelParallelStrategy, the network sharded in configure_model by
    mixprec.fully_shard (or, `shard` 'torch', torch's fully_shard: O0/O1)."""
    from tests.dist_scenarios import counting_all_reduce

    steps = STEPS
    with as_launched(rank):
        module = _module_class()(level, dtype, shard)
        trainer = _trainer(_fsdp2_strategy(), _plugin(level, dtype), steps, clip)
        with counting_all_reduce() as calls:
            module.calls = calls
            trainer.fit(module, _loader())
    out = _result(module, trainer)
    out["ref"] = fsdp2_by_hand(rank, world, level, dtype, clip, steps)
    return out


def fsdp2_by_hand(rank: int, world: int, level: str, dtype: str, clip: float | None,
                  steps: int = STEPS) -> dict[str, Any]:  # fmt: skip
    """The reference: mixprec.fully_shard + mixprec.GradScaler + SkipAwareLR, by hand."""
    model = net()
    mixprec.fully_shard(model, opt_level=level, dtype=dtype)
    opt, sched = _optimizer(model.parameters())
    scaled = scales(level, dtype)
    scaler = mixprec.GradScaler("cpu", enabled=scaled, **SCALER)
    sched = mixprec.SkipAwareLR(sched, scaler)
    losses, lrs = [], []
    for epoch in range(STEPS):
        if len(losses) == steps:
            break
        for x, y in _rank_loader(rank, world, epoch):
            if len(losses) == steps:
                break
            lrs.append(float(opt.param_groups[0]["lr"]))
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            losses.append(loss.item())
            scaler.scale(_poisoned(loss, len(losses) - 1, rank, world, scaled)).backward()
            scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            sched.step()
    return {"losses": losses, "lrs": lrs, "params": [full(p) for p in model.parameters()],
            "scale": scaler.get_scale() if scaled else None}  # fmt: skip


def fsdp2_resume(rank: int, world: int, path: str, level: str, dtype: str,
                 distributed_checkpoint: bool) -> dict[str, Any]:  # fmt: skip
    """Fit 4 steps, save through Lightning, resume to STEPS.

    Lightning saves a DCP folder (each rank its shards, ``meta.pt`` the rest) or, with
    ``save_distributed_checkpoint=False``, one file that rank 0 assembles.
    """
    Module = _module_class()
    with as_launched(rank):
        first = Module(level, dtype)
        strategy = _fsdp2_strategy(distributed_checkpoint)
        trainer = _trainer(strategy, _plugin(level, dtype), 4, None)
        trainer.fit(first, _loader())
        trainer.save_checkpoint(path)
        resumed = Module(level, dtype)
        trainer2 = _trainer(_fsdp2_strategy(distributed_checkpoint), _plugin(level, dtype),
                            STEPS, None)  # fmt: skip
        trainer2.fit(resumed, _loader(), ckpt_path=path)
    meta = None
    if rank == 0:
        file = os.path.join(path, "meta.pt") if distributed_checkpoint else path
        meta = torch.load(file, weights_only=False)
    out = _result(resumed, trainer2)
    out.update(first_losses=first.losses, is_folder=os.path.isdir(path),
               saved_plugin=None if meta is None else meta.get("MixprecPrecision"))  # fmt: skip
    out["ref"] = fsdp2_by_hand(rank, world, level, dtype, None, STEPS)
    return out


def fsdp2_errors(rank: int, world: int) -> dict[str, str]:
    """A plugin whose level differs from the sharding, and O2 on torch's own fully_shard."""
    Module = _module_class()
    out = {}
    cases = {
        "level": (Module("O2", "bf16"), _plugin("O1", "bf16")),
        "torch_sharded": (Module("O2", "bf16", shard="torch"), _plugin("O2", "bf16")),
    }
    for key, (module, plugin) in cases.items():  # fmt: skip
        with as_launched(rank):
            trainer = _trainer(_fsdp2_strategy(), plugin, 1, None)
            try:
                trainer.fit(module, _loader())
            except Exception as err:  # the message is the result
                out[key] = f"{type(err).__name__}: {err}"
    # The same checks, straight through the plugin's convert_module (what Lightning calls).
    from mixprec.integrations.lightning import MixprecPrecision

    holder = nn.Module()
    holder.net = mixprec.fully_shard(net(), opt_level="O2", dtype="bf16")
    holder.head = nn.Linear(4, 2)  # outside the sharded network
    plugins = {"outside": MixprecPrecision("O2", "bf16", device="cpu"),
               "option": MixprecPrecision("O2", "bf16", device="cpu",
                                          options={"keep_batchnorm_fp32": False})}  # fmt: skip
    for key, plugin in plugins.items():
        if key == "option":
            del holder.head  # every parameter inside now: the option is what is wrong
        try:
            plugin.convert_module(holder)
        except Exception as err:  # the message is the result
            out[key] = f"{type(err).__name__}: {err}"
        out[key + "_unchanged"] = not plugin.engine.sharded and not plugin.engine._masters
    return out


# ----------------------------------------------------------------------------- Lightning's launcher


def main(out: str) -> None:
    """``python -m tests.lightning_scenarios OUT``: the O2 fp16 run under Lightning's own launcher.

    Started as one process, the Trainer re-runs this command for local rank 1 (Lightning's
    ``_SubprocessScriptLauncher``) and joins both in a gloo group itself; each rank writes its
    result (with the hand-written reference) to ``OUT/rank<r>.pt``.
    """
    from tests.dist_scenarios import counting_all_reduce

    with warnings.catch_warnings(), counting_all_reduce() as calls:
        warnings.simplefilter("ignore")
        module = _module_class()("O2", "fp16")
        module.calls = calls
        trainer = _trainer(_fsdp2_strategy(), _plugin("O2", "fp16"), STEPS, CLIP)
        trainer.fit(module, _loader())
        rank, world = trainer.global_rank, trainer.world_size
        result = _result(module, trainer)
        result["ref"] = fsdp2_by_hand(rank, world, "O2", "fp16", CLIP)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
