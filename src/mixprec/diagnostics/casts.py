"""`CastCounter`: count the dtype conversions a piece of code really runs, below autograd.

An instrument, not a model of mixprec's engine: a ``TorchDispatchMode`` that sees every
``aten._to_copy`` that reaches the kernels (autocast's casts, a model's own ``.float()``, the
backward's conversions when the counter is open around it). Tests use it as an oracle for the
casts the engine claims to make; benchmarks use it to put a number beside a compiled graph's.

Cost: one Python call per aten op while open. No host-device synchronisation.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CastCounter"]


class CastCounter(TorchDispatchMode):
    """Counts ``aten._to_copy`` calls by (source dtype, target dtype).

    Examples:
        >>> with CastCounter() as counter, mixprec.autocast("cpu"):
        ...     model(x)
        >>> counter.casts[(torch.float32, torch.bfloat16)]
    """

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[tuple[torch.dtype, torch.dtype]] = Counter()

    @property
    def conversions(self) -> int:
        """Casts that changed a dtype (same-dtype copies excluded)."""
        return sum(n for (src, dst), n in self.casts.items() if src != dst)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.casts[(args[0].dtype, kwargs.get("dtype", args[0].dtype))] += 1
        return func(*args, **kwargs)
