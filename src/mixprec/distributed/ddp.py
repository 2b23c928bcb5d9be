"""TrainStep under DistributedDataParallel: wrapping in the right order; the capture rules.

PyTorch documents how to capture a DDP step, collectives included, as one CUDA graph
("CUDA semantics" notes, "Usage with DistributedDataParallel"), for NCCL >= 2.9.6:

1. NCCL's asynchronous error handling must be off before the process group is created
   (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, formerly ``NCCL_ASYNC_ERROR_HANDLING``): its watchdog
   queries the collectives' events, which a capturing stream does not allow.
2. DDP must be constructed in a side-stream context, and that stream is the one the graph is
   captured on (DDP keeps autograd nodes created at construction; Megatron-LM's full-iteration
   capture learnt the same: NVIDIA/Megatron-LM PR 6021).
3. At least 11 DDP-enabled eager iterations must run before capture (DDP rebuilds its buckets
   and records runtime statistics during its first iterations, with host work a replay would skip).

`TrainStep(..., ddp=True)` follows all three: it wraps the initialized model itself, on its
side stream, warms up at least `DDP_WARMUP` steps there and captures on the same stream.
`capture_blocker` names the rule a configuration breaks; TrainStep then runs eagerly and says
so (or raises, with ``capture='cuda_graph'``). Capture is a collective decision: every rank
must make the same one, so configure every rank's TrainStep the same way.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.distributed import agreement
from mixprec.distributed.topology import DistributedError, backend_for, fsdp_modules, is_initialized
from mixprec.errors import PolicyError

__all__ = [
    "DDP_WARMUP",
    "MIN_NCCL",
    "capture_blocker",
    "describe_collectives",
    "requested_kwargs",
    "wrap",
]

#: Eager DDP iterations PyTorch requires before a capture.
DDP_WARMUP = 11
#: The first NCCL release whose collectives can be captured.
MIN_NCCL = (2, 9, 6)
_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


def requested_kwargs(ddp: Any, model: nn.Module) -> dict[str, Any] | None:
    """DDP's keyword arguments from TrainStep's ``ddp=`` (None: do not wrap); or raise."""
    if ddp is False or ddp is None:
        return None
    if not (ddp is True or isinstance(ddp, dict)):
        raise PolicyError(
            f"ddp={ddp!r} must be True, False or a dict of DistributedDataParallel keyword "
            f"arguments (for example {{'device_ids': [local_rank]}})."
        )
    if isinstance(model, DistributedDataParallel):
        raise DistributedError(
            "ddp= asks TrainStep to wrap the model in DistributedDataParallel, but the model is "
            "wrapped already. Pass the unwrapped model (model.module) with ddp=..., or drop ddp=."
        )
    if not is_initialized():
        raise DistributedError(
            "ddp= needs torch.distributed: call torch.distributed.init_process_group() first "
            "(torchrun, or `mixprec train --nproc-per-node N`, sets up its environment)."
        )
    return {} if ddp is True else dict(ddp)


def describe_collectives(model: nn.Module, optimizer: Any, device: torch.device) -> str:
    """``'; on the gloo process group of 2 ranks: ...'`` for a step's reason ('' alone)."""
    if not is_initialized():
        return ""
    parts = []
    if isinstance(model, DistributedDataParallel):
        parts.append("DDP's gradient all-reduce")
    scaler = optimizer.scaler
    if scaler is not None and scaler.is_enabled():
        parts.append(
            "no overflow all-reduce (DDP reduced every gradient)"
            if agreement.covers(optimizer.optimizer)
            else "the scaler's overflow all-reduce"
        )
    what = " and ".join(parts) if parts else "collectives"
    ranks = torch.distributed.get_world_size()
    return f"; on the {backend_for(device)} process group of {ranks} ranks: {what}"


def wrap(model: nn.Module, kwargs: dict[str, Any], stream: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(model, **kwargs)``, constructed on `stream` when one is given."""
    if stream is None:
        return DistributedDataParallel(model, **kwargs)
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        ddp = DistributedDataParallel(model, **kwargs)
    torch.cuda.current_stream(stream.device).wait_stream(stream)
    return ddp


def _error_handling() -> str | None:
    for name in _ERROR_HANDLING_VARS:
        value = os.environ.get(name)
        if value is not None:
            return value.strip()
    return None


def capture_blocker(model: nn.Module, device: torch.device, built_here: bool) -> str | None:
    """Why a step of `model` on `device` cannot be captured under torch.distributed, or None.

    Args:
        model: the model the step runs (a DDP wrapper, an FSDP2 model, or a plain module).
        device: the step's device.
        built_here: whether TrainStep constructed the DDP wrapper (on its capture stream).
    """
    if fsdp_modules(model):
        return (
            "the model is sharded with FSDP2, whose hooks decide per call in Python which "
            "parameters to all-gather and free; a replayed graph would skip them"
        )
    if not is_initialized():
        return None
    backend = backend_for(device)
    if backend != "nccl":
        return (
            f"the process group's {backend} backend cannot be captured in a CUDA graph (only "
            f"NCCL can, from {'.'.join(map(str, MIN_NCCL))} on); the step's collectives run "
            f"eagerly"
        )
    version = tuple(torch.cuda.nccl.version())
    if version < MIN_NCCL:
        return (
            f"NCCL {'.'.join(map(str, version))} cannot capture collectives (PyTorch requires "
            f"NCCL >= {'.'.join(map(str, MIN_NCCL))})"
        )
    if _error_handling() != "0":
        return (
            "NCCL's asynchronous error handling is on; PyTorch's rules for capturing DDP ask "
            "for TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in the environment before "
            "init_process_group (its watchdog queries events a capturing stream forbids)"
        )
    if isinstance(model, DistributedDataParallel):
        if not built_here:
            return (
                "the model was wrapped in DistributedDataParallel outside TrainStep, and "
                "PyTorch's rules need DDP constructed on the stream the graph is captured on: "
                "pass the unwrapped model with ddp=True (or ddp={...DDP keyword arguments}), and "
                "TrainStep wraps it on its capture stream"
            )
        if getattr(model, "find_unused_parameters", False):
            return (
                "DDP runs with find_unused_parameters=True, which searches the autograd graph "
                "on the host and reads a bitmap back every step; a replay would do neither"
            )
    return None
