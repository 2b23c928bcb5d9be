"""What a model is wrapped in (DDP, FSDP2) and what the process group can do; the error type.

Everything here is a cheap look at Python objects: no collective, no device access. FSDP2 and
DTensor are only looked for when their modules are already imported (a model cannot be sharded
otherwise), so importing mixprec does not import them.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.errors import MixprecError

__all__ = [
    "DistributedError",
    "backend_for",
    "ddp_params",
    "fsdp_modules",
    "is_initialized",
    "launched_world_size",
    "unwrap_ddp",
]


class DistributedError(MixprecError, RuntimeError):
    """mixprec was combined with DDP or FSDP2 in a way that cannot work (the message says how)."""


def is_initialized() -> bool:
    """Whether a default process group exists in this process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def ddp_params(model: DistributedDataParallel) -> list[torch.Tensor]:
    """The parameters whose gradients `model` all-reduces (trainable, not ignored by DDP)."""
    return [
        p
        for p in model.module.parameters()
        if p.requires_grad and not getattr(p, "_ddp_ignored", False)
    ]


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units inside `model` (``fully_shard`` applied), with their names; root first."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FSDPModule"):
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, fsdp.FSDPModule)]


def backend_for(device: torch.device, group: object = None) -> str | None:
    """The backend the process group uses for tensors on `device` (``'nccl'``, ``'gloo'``, ...).

    ``init_process_group()`` without a backend gives ``'cpu:gloo,cuda:nccl'``: the entry for the
    device's type is returned. None without a process group.
    """
    if not is_initialized():
        return None
    name = str(torch.distributed.get_backend(group))
    if ":" not in name:
        return name
    pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return pairs.get(device.type)


def launched_world_size() -> int:
    """WORLD_SIZE as set by torchrun (torch.distributed.run) for this process; 1 if not set."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1
