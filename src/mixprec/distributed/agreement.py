"""Which optimizers' gradients are already identical on every rank, so the scaler need not agree.

The scaler all-reduces its overflow count (MAX, asynchronously, once per step) so that every rank
skips the same steps. Under DistributedDataParallel that collective is redundant: DDP all-reduces
every gradient it manages during backward, so after backward each rank holds the same gradient
bits, and a non-finite value on any rank has become non-finite everywhere (inf + x = inf,
inf - inf = NaN, NaN + x = NaN, and an fp32 sum that overflows is inf on every rank). Every rank
therefore computes the same found-inf from its own gradients, and skips the same steps.

That argument holds only for gradients DDP reduced, so it is applied per optimizer, and only
while *every* gradient the optimizer steps comes from a parameter of a registered DDP model (in
O2, from the low-precision parameter whose fp32 master the optimizer steps). mixprec registers
an optimizer where it sees the DDP wrapper itself: `mixprec.initialize` given a DDP model, and
`TrainStep` (given a DDP model, or wrapping one with ``ddp=``). Anywhere else the scaler keeps
its all-reduce, which is always correct.

Not covered, and therefore not skipped: parameters outside the DDP model, gradients changed on
one rank only after backward (the scaler cannot see that; do not do it), and steps after a
backward run under ``no_sync()`` (DDP did not reduce those gradients; stepping there is a bug
with or without a scaler).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = ["covers", "forget", "is_replicated", "mark_replicated"]

# optimizer -> (ids of the tensors whose gradients DDP reduces, the tensors themselves). Keeping
# the tensors pins their ids, which therefore cannot be reused by other tensors while the entry
# lives; the entry lives as long as the optimizer.
_REPLICATED: weakref.WeakKeyDictionary[
    torch.optim.Optimizer, tuple[frozenset[int], tuple[torch.Tensor, ...]]
] = weakref.WeakKeyDictionary()


def mark_replicated(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor]) -> None:
    """Record that the gradients of `tensors` (tensors `optimizer` steps) are DDP-reduced."""
    pinned = tuple(tensors)
    _REPLICATED[optimizer] = (frozenset(id(t) for t in pinned), pinned)


def forget(optimizer: torch.optim.Optimizer) -> None:
    """Drop `optimizer`'s registration (its gradients are agreed on by all-reduce again)."""
    _REPLICATED.pop(optimizer, None)


def is_replicated(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient `optimizer` would step is DDP-reduced, i.e. identical on all ranks.

    Cost: one pass over the optimizer's parameters in Python (no device access).
    """
    entry = _REPLICATED.get(optimizer)
    if entry is None:
        return False
    covered = entry[0]
    return all(
        id(p) in covered
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    )


def covers(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is registered and every tensor it steps is covered (grads or not)."""
    entry = _REPLICATED.get(optimizer)
    return entry is not None and all(
        id(p) in entry[0] for group in optimizer.param_groups for p in group["params"]
    )
