"""What a training job keeps in memory on this rank: parameters, masters, gradients, state.

Counted from the tensors themselves, not from an allocator: each storage once (views and the
shards FSDP2 carves out of one buffer count as the storage they live in), DTensors as this
rank's local shard. Call it between ``backward`` and ``zero_grad`` for the gradients to count.
Activations and FSDP2's transient unsharded parameters are not persistent state and are not
here; on CUDA, ``torch.cuda.max_memory_allocated`` measures those (benchmarks/fsdp_memory.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mixprec.distributed.fp8 import plain_local

__all__ = ["CATEGORIES", "rank_bytes"]

#: The keys of `rank_bytes`, in the order a table shows them.
CATEGORIES = ("params", "masters", "grads", "optimizer", "skip_snapshot")


def rank_bytes(model: nn.Module, optimizer: Any, scaler: Any = None) -> dict[str, int]:
    """Bytes this rank holds, by category (see `CATEGORIES`), plus ``total``.

    Args:
        model: the model (any wrapping: DDP, FSDP2).
        optimizer: its optimizer, or the `AmpOptimizer` from ``mixprec.initialize``.
        scaler: a `mixprec.GradScaler` (default: the AmpOptimizer's), for the snapshot its
            restore-mode skip keeps (an extra copy of parameters and optimizer state).

    ``params`` are the model's parameters, ``masters`` the fp32 copies an unsharded O2 optimizer
    steps (none under `mixprec.fully_shard`: FSDP's fp32 shards are the masters), ``grads`` the
    gradients of both, ``optimizer`` the optimizer state.
    """
    from mixprec.levels.optimizer import AmpOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, AmpOptimizer) else optimizer
    if scaler is None and isinstance(optimizer, AmpOptimizer):
        scaler = optimizer.scaler
    seen: set[int] = set()
    model_params = list(model.parameters())
    ids = {id(p) for p in model_params}
    masters = [p for g in inner.param_groups for p in g["params"] if id(p) not in ids]
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    snapshot = []
    for guard in getattr(scaler, "_guards", {}).values():
        snapshot += guard._snapshot
    out = {
        "params": _bytes(model_params, seen),
        "masters": _bytes(masters, seen),
        "grads": _bytes((p.grad for p in model_params + masters if p.grad is not None), seen),
        "optimizer": _bytes(state, seen),
        "skip_snapshot": _bytes(snapshot, seen),
    }
    out["total"] = sum(out.values())
    return out


def _bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = plain_local(t).untyped_storage()  # an FP8 shard: the storage it wraps
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
