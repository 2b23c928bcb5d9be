"""What the adapted Lightning tests share: Lightning's precision settings as mixprec plugins,
and Lightning's ``RunIf`` for the conditions they use."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from mixprec.integrations.lightning import MixprecFabricPrecision, MixprecPrecision
from tests.fork_server import context

#: Lightning's precision strings -> mixprec's opt level and dtype. O1 is autocast plus loss
#: scaling in fp16, which is what Lightning's "16-mixed" and "bf16-mixed" do. Lightning turns
#: "16-mixed" into bf16 on a CPU; mixprec runs the fp16 it is asked for (docs/integrations.md).
SETTINGS = {"16-mixed": ("O1", "fp16"), "bf16-mixed": ("O1", "bf16")}


def trainer_plugin(precision: str, device: str | None = None, cls: type = MixprecPrecision,
                   **kwargs: Any) -> Any:  # fmt: skip
    """``MixedPrecision(precision, device)`` for the Trainer, as mixprec's plugin."""
    level, dtype = SETTINGS[precision]
    return cls(level, dtype=dtype, device=device, **kwargs)


def fabric_plugin(precision: str, device: str | None = None, **kwargs: Any) -> Any:
    """``MixedPrecision(precision, device)`` for Fabric, as mixprec's plugin."""
    level, dtype = SETTINGS[precision]
    return MixprecFabricPrecision(level, dtype=dtype, device=device, **kwargs)


def RunIf(min_cuda_gpus: int = 0, bf16_cuda: bool = False, skip_windows: bool = False) -> Any:
    """Lightning's ``RunIf`` for the conditions these tests use: a skip mark."""
    reasons = []
    if torch.cuda.device_count() < min_cuda_gpus:
        reasons.append(f"GPUs>={min_cuda_gpus}")
    if bf16_cuda and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        reasons.append("CUDA device bf16")
    if skip_windows and sys.platform == "win32":
        reasons.append("not Windows")
    return pytest.mark.skipif(bool(reasons), reason=f"Requires: [{' + '.join(reasons)}]")


def spawn_strategy(api: str = "trainer") -> Any:
    """Lightning's ``"ddp_spawn"`` for a CPU test, its processes forked from one forkserver.

    ddp_spawn starts each process as a fresh interpreter that imports torch and Lightning (about
    13 s of CPU on the 2-core runner), and a Trainer's fit, test and predict launch two each: 78 s
    of imports in one test. Lightning's ``start_method="forkserver"`` takes the same road for what
    these tests check (the plugin, its scaler and the model are pickled to every process, which
    join one gloo group and agree on overflows), but forks each process from a server that
    imported Lightning and mixprec once per test worker (`tests.fork_server`).
    """
    if api == "trainer":
        from lightning.pytorch.strategies import DDPStrategy
    else:
        from lightning.fabric.strategies import DDPStrategy
    # Lightning starts its processes from the process's one forkserver: have it preload these
    # (importing lightning.pytorch imports lightning.fabric: a server that another test file
    # started with lightning.pytorch serves these tests as it is).
    context("lightning.pytorch", "mixprec.integrations.lightning")
    return DDPStrategy(start_method="forkserver")
