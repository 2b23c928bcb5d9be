"""O2 under Lightning's forward redirection: the batch a step receives is never cast.

Under strategy 'ddp' Lightning runs ``training_step`` (``validation_step`` inside ``fit``; in
Fabric, ``model.training_step(...)`` and the other step methods) as the DDP wrapper's forward,
through the LightningModule's call, where O2's entry cast is. Float targets arrived rounded to
the low dtype (bf16: loss 1.171249 against 1.171470 on one process, the same code and data);
the step's result came back widened to fp32. Now each step sees exactly what it sees on one
process (fp32 targets, the same loss to the bit), while ``self(x)`` inside it still casts the
network's input. tests/redirect_scenarios.py has the runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pytest.importorskip("lightning")

from tests import redirect_scenarios as S
from tests.dist_pool import RankPool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LOW = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2, preload=("lightning.pytorch", S.__name__))
    yield ranks
    ranks.close()


def _expected(seen: dict, dtype: str) -> None:
    for step in ("training_step", "validation_step"):
        assert seen[step]["y"] == "torch.float32" and seen[step]["exact"], (step, seen[step])
        assert seen[step]["entry"] == LOW[dtype], (step, seen[step])  # self(x) is still cast
    assert seen["validation_step"]["returned"] == "torch.bfloat16"  # as the step returned it


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_trainer_ddp_steps_see_the_batch_as_on_one_process(pool, dtype):
    one = S.trainer_run(0, 1, dtype)
    assert one["strategy"] == "SingleDeviceStrategy"
    _expected(one["seen"], dtype)
    for rank in pool.run(S.trainer_run, dtype):
        assert rank["strategy"] == "DDPStrategy"
        assert rank["seen"] == one["seen"]  # the losses too, bit for bit


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_fabric_ddp_steps_see_the_batch_as_on_one_process(pool):
    one = S.fabric_run(0, 1, "bf16")
    _expected(one["seen"], "bf16")
    for rank in pool.run(S.fabric_run, "bf16"):
        assert rank["wrapped"] == "DistributedDataParallel"
        assert rank["seen"] == one["seen"]
        assert rank["out"] == "torch.float32"  # model(x) itself: O2's fp32 output


class _Wrapper(nn.Module):
    """A stand-in for DDP: its forward calls the wrapped module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_redirected_step_is_not_cast_but_forward_inside_it_is():
    """One process, Lightning's own ``_ForwardRedirection`` through a wrapper: the routed call
    casts neither its arguments (keyword ones too) nor its result; ``self(x)`` casts both."""
    import lightning as L
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    from mixprec.integrations.lightning import MixprecPrecision

    seen = {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def forward(self, x):
            seen["x"] = x.dtype
            return self.net(x)

        def training_step(self, batch, i, *, weight):
            x, y = batch
            seen["y"], seen["weight"] = y.dtype, weight.dtype
            out = self(x)
            seen["out"] = out.dtype
            return F.mse_loss(out, y).to(torch.bfloat16) * weight.bfloat16()

    module = Module()
    MixprecPrecision("O2", "bf16", device="cpu").convert_module(module)
    x, y = torch.randn(3, 4), torch.full((3, 2), 1 + 2**-12)
    loss = _ForwardRedirection()(_Wrapper(module), module, "training_step", (x, y), 0,
                                 weight=torch.tensor(1 + 2**-12))  # fmt: skip
    assert seen == {"y": torch.float32, "weight": torch.float32, "x": torch.bfloat16,
                    "out": torch.float32}  # fmt: skip
    assert loss.dtype == torch.bfloat16  # the step's result, as it returned it
    # Lightning puts the real forward back as an instance attribute (a bound method): a plain
    # call still casts, as always at O2.
    assert module.__dict__["forward"].__func__ is Module.forward
    assert module(x).dtype == torch.float32
