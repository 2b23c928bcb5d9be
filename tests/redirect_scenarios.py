"""Lightning's forward redirection at O2, on every rank of a `RankPool` and on one process
(tests/test_lightning_redirect.py).

Under a wrapping strategy (``"ddp"``) Lightning runs ``training_step`` (and ``validation_step``
inside ``fit``) as the wrapper's forward: its ``_ForwardRedirection`` (Fabric:
``_FabricModule``) sets the LightningModule's ``forward`` to a closure that calls the step, then
calls the DDP wrapper, which calls the LightningModule. O2's entry cast, a forward pre-hook on
the LightningModule, then met the batch the step receives: float targets arrived rounded to the
low dtype. On one process the step is called directly and nothing is rounded.

Each scenario records, per step, the dtype of the targets the step received, whether
they were still the exact fp32 targets, the dtype of the input at the network's entry (``self(x)``
must still cast it at O2) and the loss; for ``validation_step``, the dtype of what it returned.
The targets ``1 + k * 2**-12`` (k odd) are representable in neither bf16 nor fp16.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_scenarios import environment, launched

ROWS = 4


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 8, generator=g)
    k = torch.arange(2 * ROWS * 2, dtype=torch.float32).reshape(ROWS, 4) * 2 + 1
    return x, 1 + k * 2.0**-12


def _loader() -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(*batch())
    return torch.utils.data.DataLoader(data, batch_size=ROWS)


def _module() -> Any:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(),
                                     nn.Linear(16, 4))  # fmt: skip
            self.seen: dict[str, dict[str, Any]] = {}
            self._entry: torch.dtype | None = None
            self.net.register_forward_pre_hook(self._record_entry)

        def _record_entry(self, module: nn.Module, args: tuple) -> None:
            self._entry = args[0].dtype

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def _step(self, name: str, b: Any) -> torch.Tensor:
            x, y = b
            self._entry = None
            loss = F.mse_loss(self(x).float(), y.float())
            exact = y.dtype == torch.float32 and torch.equal(y, batch()[1])
            record = {"y": str(y.dtype), "exact": exact, "entry": str(self._entry),
                      "loss": loss.item()}  # fmt: skip
            self.seen.setdefault(name, record)
            return loss

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return self._step("training_step", b)

        def validation_step(self, b: Any, i: int) -> torch.Tensor:
            # What the step returns is not the model's output: it comes back as the step made it.
            return self._step("validation_step", b).to(torch.bfloat16)

        def on_validation_batch_end(self, outputs: Any, *_: Any) -> None:
            self.seen["validation_step"]["returned"] = str(outputs.dtype)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def _as_launched(rank: int, world: int) -> contextlib.AbstractContextManager[None]:
    """Lightning's launcher's environment for rank `rank` on several ranks (the pool already
    joined the gloo group, which Lightning reuses); one process keeps its own."""
    return launched(rank, world) if world > 1 else environment({})


def trainer_run(rank: int, world: int, dtype: str) -> dict[str, Any]:
    """``fit`` at O2 for one step, after one sanity-check validation step: strategy 'ddp' on the
    pool's ranks (`world` > 1), Lightning's single-device strategy on one process. (``validate``,
    ``test`` and ``predict`` on 'ddp' do not wrap the model in DDP: nothing is redirected.)"""
    import lightning as L

    from mixprec.integrations.lightning import MixprecPrecision

    with _as_launched(rank, world):
        module = _module()
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=world,
                            strategy="ddp" if world > 1 else "auto",
                            plugins=[MixprecPrecision("O2", dtype, device="cpu")],
                            use_distributed_sampler=False, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=1)  # fmt: skip
        trainer.fit(module, _loader(), _loader())
    return {"seen": module.seen, "strategy": type(trainer.strategy).__name__}


def fabric_run(rank: int, world: int, dtype: str) -> dict[str, Any]:
    """Fabric at O2 (strategy 'ddp' on the pool's ranks): ``model.training_step(batch, 0)`` and
    ``model.validation_step``, which Fabric redirects through the DDP wrapper's forward, then
    ``model(x)``."""
    import lightning as L

    from mixprec.integrations.lightning import MixprecFabricPrecision

    with _as_launched(rank, world):
        precision = MixprecFabricPrecision("O2", dtype, device="cpu")
        fabric = L.Fabric(accelerator="cpu", devices=world,
                          strategy="ddp" if world > 1 else "auto", plugins=[precision])  # fmt: skip
        fabric.launch()
        module = _module()
        model, opt = fabric.setup(*precision.initialize(module, module.configure_optimizers()))
        fabric.backward(model.training_step(batch(), 0))
        opt.step()
        module.seen["validation_step"]["returned"] = str(model.validation_step(batch(), 0).dtype)
        out = model(batch()[0])
    wrapped = type(model._forward_module).__name__
    return {"seen": module.seen, "wrapped": wrapped, "out": str(out.dtype)}
