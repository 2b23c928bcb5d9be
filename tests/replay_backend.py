"""A CPU stand-in for a CUDA graph that replays kernels only, to test TrainStep's capture logic.

A CUDA graph records the kernels a step launches and replays them on the same memory, with no
Python, no autograd and no host reads: any decision made in Python at capture time is frozen,
and a host read during capture is an error. `KernelReplay` does the same with aten ops: while
recording it runs the step under a dispatch mode that logs every op with its arguments and
outputs (and refuses host reads, as CUDA capture does); a replay calls each logged op again on
the same tensors and copies fresh outputs into the logged ones, so later ops see them, as they
would see the graph's static memory. If TrainStep left any per-step decision on the host (a
Python step counter, a read of found_inf, a host-side lr), a replay differs from an eager step
and the tests comparing them fail.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten

# Ops whose result the host must read (a sync on a GPU, forbidden while capturing).
HOST_READS = frozenset({
    aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select,
    aten._unique2, aten.unique_consecutive, aten.unique_dim,
})  # fmt: skip


class _Log(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket in HOST_READS:
            raise RuntimeError(
                f"operation not permitted when stream is capturing: {func} reads a device value "
                "on the host"
            )
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


class KernelReplay:
    """The `graphs.Backend` protocol: record by running under a log, replay the logged ops."""

    executes_on_capture = True

    def __init__(self) -> None:
        self.captured = 0
        self.replayed = 0

    def capture(self, body: Any, inputs: list[Any], spec: Any) -> tuple[Any, torch.Tensor]:
        log = _Log()
        with log:
            loss = body(*tree_unflatten(inputs, spec))
        self.captured += 1
        return log.calls, loss

    def replay(self, calls: list[tuple[Any, tuple, dict, Any]]) -> None:
        with torch.no_grad():  # kernels only: no autograd, as in a graph
            for func, args, kwargs, out in calls:
                if func.is_view:
                    continue  # a view aliases memory the other ops rewrite
                fresh = func(*args, **kwargs)
                for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0], strict=True):
                    if isinstance(old, torch.Tensor) and old is not new:
                        old.copy_(new)
        self.replayed += 1


def install(step: Any) -> KernelReplay:
    """Make a TrainStep capture with `KernelReplay` (on a CPU it would run eagerly)."""
    backend = KernelReplay()
    step._backend = backend
    step._blocked = None
    return backend
