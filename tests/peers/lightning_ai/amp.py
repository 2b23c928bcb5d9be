"""What the adapted Lightning tests share: Lightning's precision settings as mixprec plugins,
and Lightning's ``RunIf`` for the conditions they use."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from mixprec.integrations.lightning import MixprecFabricPrecision, MixprecPrecision

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


def spawn_cost() -> Any:
    """The mark of a ddp_spawn run that CI leaves out.

    Each ddp_spawn launch starts two fresh interpreters that import torch and Lightning (about
    10 s of CPU each on a 2-core runner). CI runs one launch per API at "16-mixed", which pickles
    the plugin with its scaler and agrees on overflows across the two ranks; the "bf16-mixed"
    launches add little to that and run with ``MIXPREC_PEER_SPAWN=all``.
    """
    return pytest.mark.skipif(
        os.environ.get("MIXPREC_PEER_SPAWN") != "all",
        reason="a second ddp_spawn launch (slow on a CPU); MIXPREC_PEER_SPAWN=all runs it",
    )
